"""GPT-2 equals Hugging Face's GPT2LMHeadModel (logits and gradients, fp32 CPU) in every input
form and through every attention backend that runs on CPU."""
import pytest
import torch
import transformers

import conftest
import fastzoo
from fastzoo.equivalence import draw_
from conftest import backends
from fastzoo import equivalence
from fastzoo.data import nested, pack, pad_to_longest
from fastzoo.errors import BackendUnavailableError
from fastzoo.losses import causal_lm_loss
from fastzoo.models.decoder.convert import GPT2 as HF_CONVERTER

TINY = conftest.TINY["gpt2"]
LOGIT_TOL = equivalence.FP32_OUT_ATOL  # fastzoo.equivalence's rule: fp32 CPU, same weights (1e-4)
GRAD_RTOL = equivalence.FP32_GRAD_RTOL  # gradients: relative to each tensor's scale (1e-4; fastzoo.equivalence's rule)

# from the registry: every backend that trains on CPU; ALL_BACKENDS adds those without a CPU
# backward (flex, varlen's flex impl: inference tests below)
TRAIN_BACKENDS = backends(backward=True)
ALL_BACKENDS = backends()
IDS = lambda b: f"{b[0]}{'-' + '-'.join(map(str, b[1].values())) if b[1] else ''}"  # noqa: E731


def hf_model(**kw):
    cfg = transformers.GPT2Config(
        **{**TINY, **kw}, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None
    )
    return draw_(transformers.GPT2LMHeadModel(cfg)).eval()


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(1)
    return hf_model()


def ours(hf, attn="eager", **opts):
    return fastzoo.create("gpt2", attn=attn, attn_options=opts, pretrained=hf).eval()


def seqs(lengths=(5, 11, 3), vocab=128):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def hf_grads(hf):
    """HF's gradients with fastzoo's names and layout (Conv1D transposed)."""
    return HF_CONVERTER.to_fastzoo({k: p.grad for k, p in hf.named_parameters()})


def assert_grads_close(model, ref: dict):
    """Every parameter gradient against ``ref`` (fastzoo names), by fastzoo.equivalence's rule."""
    grads = {n: p.grad for n, p in model.named_parameters()}  # the tied head is the embedding: named once
    c = equivalence.compare_grads("grads", grads, {n: g for n, g in ref.items() if n in grads})
    assert c.err <= GRAD_RTOL, f"grad of {c.worst}: relative error {c.err:.2e}"


def assert_logits_close(logits, ref, name="logits"):
    """Logits against the reference's, by fastzoo.equivalence's rule (fp32: within 1e-4)."""
    c = equivalence.compare_outputs(name, logits, ref)
    assert c.err <= LOGIT_TOL, f"{name}: max |logit diff| {c.err:.2e}"


def assert_equal_to_hf(m, hf, inputs, original_inputs=None):
    """Logits and every parameter gradient against HF's model on the same weights
    (fastzoo.equivalence.compare: the rows ``keep`` selects, gradients of a fixed projection)."""
    logits, grads = equivalence.compare(m, hf, inputs, original_inputs=original_inputs)[0]
    assert logits.err <= LOGIT_TOL, f"max |logit diff| {logits.err:.2e}"
    assert grads.err <= GRAD_RTOL, f"grad of {grads.worst}: relative error {grads.err:.2e}"


def hf_loss_and_grads(hf, input_ids, attention_mask=None, position_ids=None, labels=None):
    hf.zero_grad()
    out = hf(input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), hf_grads(hf)


# -- padded batches -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", TRAIN_BACKENDS, ids=IDS)
def test_padded_right_logits_loss_grads_equal_hf(hf, backend):
    batch = pad_to_longest(seqs())
    ref_logits, ref_loss, ref_grads = hf_loss_and_grads(hf, batch.input_ids, batch.attention_mask, labels=batch.labels)
    m = ours(hf, backend[0], **backend[1])
    real = batch.attention_mask.bool()  # real positions only: padding is not scored
    assert_equal_to_hf(m, hf, equivalence.Inputs((batch.input_ids,), {"attention_mask": batch.attention_mask}, keep=real))
    m.zero_grad()
    loss = causal_lm_loss(m(batch.input_ids, attention_mask=batch.attention_mask).logits, batch.labels)
    assert (loss - ref_loss).abs() <= 1e-5  # mean CE of O(5): fp32 rounding
    loss.backward()
    assert_grads_close(m, ref_grads)  # the loss's gradients too


@pytest.mark.parametrize("name", ["varlen", "nested"])
def test_packed_only_backends_unpad_once_per_forward_padding_gets_zeros(hf, name):
    """varlen/nested take no padding mask: the model packs the real tokens (holes included),
    runs packed, and scatters back; padding positions are zeros, real tokens equal HF's."""
    ids = torch.stack(seqs((7, 7, 7)))
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        logits = ours(hf, name)(ids, attention_mask=mask).logits
        ref = hf(ids, attention_mask=mask).logits
    assert_logits_close(logits[mask], ref[mask])
    assert (logits[~mask] == 0).all()


@pytest.mark.parametrize("backend", [("eager", {}), ("sdpa", {}), ("varlen", {})], ids=IDS)
def test_left_padding_with_collator_positions_equals_each_sequence_alone(hf, backend):
    batch = pad_to_longest(seqs(), side="left")
    m = ours(hf, backend[0], **backend[1])
    with torch.no_grad():
        logits = m(**batch.model_inputs()).logits
        same_inputs = hf(**batch.model_inputs()).logits
        real = batch.attention_mask.bool()
        assert_logits_close(logits[real], same_inputs[real])
        for i, s in enumerate(seqs()):
            assert_logits_close(logits[i, -len(s):], hf(s[None]).logits[0], f"row {i}")


def test_left_padding_default_positions_follow_hf_forward(hf):
    """Without position_ids, HF's forward numbers positions 0..S-1 in every row (padding included); so do we."""
    batch = pad_to_longest(seqs(), side="left")
    m = ours(hf, "sdpa")
    with torch.no_grad():
        logits = m(batch.input_ids, attention_mask=batch.attention_mask).logits
        ref = hf(batch.input_ids, attention_mask=batch.attention_mask).logits
    real = batch.attention_mask.bool()
    assert_logits_close(logits[real], ref[real])


def test_flex_padded_inference_equals_hf(hf):
    batch = pad_to_longest(seqs())
    m = ours(hf, "flex")
    real = batch.attention_mask.bool()
    with torch.no_grad():
        logits, ref = (model(batch.input_ids, attention_mask=batch.attention_mask).logits for model in (m, hf))
    assert_logits_close(logits[real], ref[real])


# -- packed and nested -----------------------------------------------------------------------
def hf_each_alone(hf, sequences):
    with torch.no_grad():
        return torch.cat([hf(s[None]).logits[0] for s in sequences])


@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=IDS)
def test_packed_logits_equal_hf_on_each_sequence_alone(hf, backend):
    m = ours(hf, backend[0], **backend[1])
    with torch.no_grad():
        logits = m(**pack(seqs()).model_inputs()).logits
    assert logits.shape == (1, 19, 128)
    assert_logits_close(logits[0], hf_each_alone(hf, seqs()))


@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=IDS)
def test_nested_input_equals_hf_on_each_sequence_alone(hf, backend):
    m = ours(hf, backend[0], **backend[1])
    with torch.no_grad():
        logits = m(nested(seqs())).logits
    assert logits.is_nested and logits.shape[0] == 3
    assert_logits_close(logits.values(), hf_each_alone(hf, seqs()))


@pytest.mark.parametrize("backend", TRAIN_BACKENDS, ids=IDS)
def test_packed_training_step_equals_padded_training_step(hf, backend):
    """The acceptance criterion: same data packed or padded -> same loss, same gradients
    (and both equal HF's padded loss and gradients)."""
    _, ref_loss, ref_grads = hf_loss_and_grads(hf, *(lambda b: (b.input_ids, b.attention_mask, None, b.labels))(pad_to_longest(seqs())))
    results = []
    for batch in (pad_to_longest(seqs()), pack(seqs())):
        m = ours(hf, backend[0], **backend[1]).train()  # dropout is 0: train() must not change the function
        loss = causal_lm_loss(m(**batch.model_inputs()).logits, batch.labels)
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in m.named_parameters()}))
    (padded_loss, padded_grads), (packed_loss, packed_grads) = results
    assert (packed_loss - padded_loss).abs() <= 1e-5 and (packed_loss - ref_loss).abs() <= 1e-5  # fp32 rounding of a mean CE
    for got, want in ((packed_grads, padded_grads), (padded_grads, ref_grads)):
        c = equivalence.compare_grads("grads", got, {k: g for k, g in want.items() if k in got})  # HF's tied head: once
        assert c.err <= GRAD_RTOL, f"grad of {c.worst}: relative error {c.err:.2e}"


@pytest.mark.parametrize("backend", [("nested", {}), ("varlen", {}), ("sdpa", {})], ids=IDS)
def test_nested_training_grads_equal_hf(hf, backend):
    m = ours(hf, backend[0], **backend[1])
    ids = nested(seqs())
    causal_lm_loss(m(ids).logits, ids).backward()
    # HF's reference: every sequence alone, losses weighted by their number of targets
    hf.zero_grad()
    n_targets = sum(len(s) - 1 for s in seqs())
    for s in seqs():
        (hf(s[None], labels=s[None]).loss * (len(s) - 1) / n_targets).backward()
    assert_grads_close(m, hf_grads(hf))


@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=IDS)
def test_packed_sequences_never_attend_across(hf, backend):
    m = ours(hf, backend[0], **backend[1])
    a, b, c = seqs()
    a2 = (a + 7) % 128  # a different first sequence
    with torch.no_grad():
        before = m(**pack([a, b, c]).model_inputs()).logits[0, len(a):]
        after = m(**pack([a2, b, c]).model_inputs()).logits[0, len(a):]
    assert torch.equal(before, after) or (before - after).abs().max() <= 1e-6  # kernels may reorder sums: float noise only


@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=IDS)
def test_padded_rows_with_all_ones_mask_stay_separate(hf, backend):
    """The known trap: a padded batch [B>1, S] must not become one long packed sequence."""
    m = ours(hf, backend[0], **backend[1])
    ids = torch.stack(seqs((8, 8)))
    ones = torch.ones_like(ids)
    changed = ids.clone()
    changed[0] = (changed[0] + 5) % 128
    with torch.no_grad():
        row1 = m(ids, attention_mask=ones).logits[1]
        row1_after = m(changed, attention_mask=ones).logits[1]
        alone = hf(ids[1:]).logits[0]
    assert (row1 - row1_after).abs().max() <= 1e-6  # row 0 does not leak into row 1
    assert_logits_close(row1, alone)


def test_restarting_position_ids_with_an_attention_mask_are_refused(hf):
    """A mask says "padded batch": restarting positions there would be several sequences
    attending to each other in one row (without a mask they are HF-flattened packing)."""
    m = ours(hf, "sdpa")
    b = pack(seqs())
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(b.input_ids, position_ids=b.position_ids, attention_mask=torch.ones_like(b.input_ids))


# -- bad input ---------------------------------------------------------------------------------
def _packed(**change):
    b = pack(seqs())
    kw = b.model_inputs()
    kw.update(change)
    return kw


@pytest.mark.parametrize("kwargs, argument", [
    (_packed(cu_seqlens=torch.tensor([0, 5, 3, 19], dtype=torch.int32)), "cu_seqlens"),  # not increasing
    (_packed(cu_seqlens=torch.tensor([1, 5, 16, 19], dtype=torch.int32)), "cu_seqlens"),  # not starting at 0
    (_packed(cu_seqlens=torch.tensor([0, 5, 16, 18], dtype=torch.int32)), "cu_seqlens"),  # not ending at T
    (_packed(cu_seqlens=torch.tensor([0, 5, 16, 19])), "cu_seqlens"),  # int64
    (_packed(cu_seqlens=torch.tensor([[0, 5, 16, 19]], dtype=torch.int32)), "cu_seqlens"),  # 2-D
    (_packed(max_seqlen=4), "max_seqlen"),  # shorter than the longest sequence
    (_packed(position_ids=torch.full((1, 19), 64)), "position_ids"),  # >= n_positions
    (_packed(input_ids=torch.full((1, 19), 128)), "input_ids"),  # >= vocab_size
    (_packed(input_ids=torch.zeros(2, 19, dtype=torch.long)), "cu_seqlens"),  # packed needs batch 1
    (dict(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)), "attention_mask"),
    (dict(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.full((2, 5), 2)), "attention_mask"),
    (dict(input_ids=torch.zeros(1, 65, dtype=torch.long)), "input_ids"),  # longer than n_positions
    (dict(input_ids=torch.zeros(5, dtype=torch.long)), "input_ids"),  # 1-D
    (dict(input_ids=torch.zeros(1, 5)), "input_ids"),  # float ids
    (dict(input_ids=torch.zeros(1, 5, dtype=torch.long), position_ids=torch.zeros(1, 4, dtype=torch.long)), "position_ids"),
])
def test_bad_inputs_name_the_argument(hf, kwargs, argument):
    m = ours(hf, "sdpa")
    with pytest.raises(ValueError, match=argument):
        m(**kwargs)


def test_float_position_ids_are_refused_naming_position_ids(hf):
    m = ours(hf, "sdpa")
    ids = torch.zeros(2, 5, dtype=torch.long)
    for bad in (torch.arange(5.0)[None], torch.ones(1, 5, dtype=torch.bool)):
        with pytest.raises(ValueError, match="position_ids must be an integer tensor"):
            m(ids, position_ids=bad)
    with pytest.raises(ValueError, match="position_ids must be an integer tensor"):
        m(**_packed(position_ids=torch.zeros(1, 19)))


# -- empty inputs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=IDS)
def test_inputs_without_tokens_give_empty_logits(hf, backend):
    m = ours(hf, backend[0], **backend[1])
    with torch.no_grad():
        for ids, mask in ((torch.zeros(2, 0, dtype=torch.long), None), (torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long))):
            assert m(ids, attention_mask=mask).logits.shape == (2, 0, 128)


@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=IDS)
def test_all_padding_rows_give_logits_of_the_batch_shape(hf, backend):
    """A batch whose every row is padding has no real token: every backend answers [B, S, V]
    (finite; the backends that unpad put zeros at padding, as for any padding position), and a
    padding-only row beside real rows leaves the real rows equal to HF's."""
    m = ours(hf, backend[0], **backend[1])
    ids = torch.stack(seqs((6, 6)))
    with torch.no_grad():
        logits = m(ids, attention_mask=torch.zeros(2, 6, dtype=torch.long)).logits
        assert logits.shape == (2, 6, 128) and torch.isfinite(logits).all()
        if not m.attention_backend.capabilities.padding_mask:
            assert (logits == 0).all()
        mask = torch.tensor([[1] * 6, [0] * 6])
        mixed = m(ids, attention_mask=mask).logits
        assert_logits_close(mixed[0], hf(ids[:1]).logits[0])


# -- cost of a forward: host reads, mask builds, graphs ----------------------------------------------
class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that copy a value to the host (a device sync on GPU): scalar reads
    (.item(), int(t), bool(t)) and data-dependent shapes (nonzero); tolist is counted by the test."""

    READS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::item"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.READS:
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def count_host_reads(monkeypatch, fn) -> list[str]:
    reads = HostReads()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (reads.ops.append("tolist"), tolist(t))[1])
    with torch.no_grad(), reads:
        fn()
    monkeypatch.undo()
    return reads.ops


@pytest.mark.parametrize("backend", TRAIN_BACKENDS, ids=IDS)
def test_one_host_read_per_forward(hf, backend, monkeypatch):
    """Validation of ids, mask, positions and offsets (and the sizes an unpadding backend
    needs) is one fused device computation read back once, whatever the number of layers."""
    m = ours(hf, backend[0], **backend[1])
    padded, packed = pad_to_longest(seqs()), pack(seqs())
    # the CPU packed kernel (varlen's cpu impl, nested on CPU) loops over the sequences: it reads
    # the offsets once per forward, from CPU memory (no device sync), not once per layer
    reads = 2 if backend[0] in ("varlen", "nested") else 1
    assert len(count_host_reads(monkeypatch, lambda: m(**padded.model_inputs()))) == reads
    assert len(count_host_reads(monkeypatch, lambda: m(padded.input_ids, attention_mask=padded.attention_mask))) == reads
    assert len(count_host_reads(monkeypatch, lambda: m(**packed.model_inputs()))) == reads


def _counting(monkeypatch, module, name):
    calls = []
    fn = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(name), fn(*a, **k))[1])
    return calls


@pytest.mark.parametrize("backend, module, builder", [
    ("eager", "fastzoo.attention.masks", "dense_mask"),
    ("sdpa", "fastzoo.attention.masks", "dense_mask"),
    ("flex", "fastzoo.attention.flex", "create_block_mask"),
    ("varlen", "fastzoo.attention.varlen", "sequence_bounds"),  # the CPU kernel's per-sequence loop
    ("nested", "fastzoo.attention.varlen", "sequence_bounds"),
])
def test_masks_are_built_once_per_forward_not_per_layer(hf, backend, module, builder, monkeypatch):
    """The model's layers share one AttnContext per forward; the first layer builds the
    batch's mask (dense mask, BlockMask, packed sequence bounds) and the others reuse it."""
    import importlib

    assert hf.config.n_layer >= 2
    m = ours(hf, backend)
    calls = _counting(monkeypatch, importlib.import_module(module), builder)
    padded, packed = pad_to_longest(seqs()), pack(seqs())
    with torch.no_grad():
        m(padded.input_ids, attention_mask=padded.attention_mask)
        assert len(calls) == 1  # varlen/nested: the padded batch is unpadded and runs packed
        calls.clear()
        out = m(**packed.model_inputs()).logits
    assert len(calls) == 1
    assert_logits_close(out[0], hf_each_alone(hf, seqs()))  # the shared mask is the right one


def test_layers_do_not_write_to_the_shared_context(monkeypatch):
    """scale_attn_by_inverse_layer_idx gives each layer its own scale: it reaches the backend
    per layer while the context the model built (and its mask cache) stays shared and unchanged."""
    import fastzoo.attention as registry
    from fastzoo.attention import Capabilities
    from fastzoo.attention.base import FLOATS

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the spy leaves the registry after the test

    seen = []

    def spy(q, k, v, ctx):
        seen.append((ctx, ctx.scale))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale)

    fastzoo.register_attention("ctx_spy", spy, capabilities=Capabilities(devices={"cpu": FLOATS}), overwrite=True)
    m = fastzoo.create("gpt2", attn="ctx_spy", scale_attn_by_inverse_layer_idx=True, **TINY).eval()
    with torch.no_grad():
        m(torch.zeros(1, 4, dtype=torch.long))
    d = TINY["n_embd"] // TINY["n_head"]
    assert [s for _, s in seen] == [d**-0.5, d**-0.5 / 2]
    (ctx0, _), (ctx1, _) = seen
    assert ctx0.scale == d**-0.5  # layer 1 did not overwrite what layer 0 was given
    assert ctx0._cache is ctx1._cache


@pytest.mark.parametrize("backend, form", [("sdpa", "padded"), ("sdpa", "packed"), ("varlen", "packed")])
def test_forward_compiles_to_one_graph(hf, backend, form):
    """No host read and no data-dependent shape under torch.compile: the value checks are
    skipped while compiling and packed document ids come from a search, so a forward is one
    graph (padded sdpa was 12 graphs with 11 breaks, packed 9 with 8). A padded batch through
    an unpadding backend (varlen, nested) still reads its sizes: those graphs break there."""
    m = ours(hf, backend)
    batch = pad_to_longest(seqs()) if form == "padded" else pack(seqs())
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(m)(**batch.model_inputs())
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


# -- requests refused at create ------------------------------------------------------------------
def test_backend_without_dropout_is_refused_for_a_model_with_attention_dropout():
    """GPT-2's default attn_pdrop is 0.1 (HF's): flex has no attention dropout, so create says
    which field to set instead of failing at the first training forward."""
    for attn, opts in (("flex", {}), ("varlen", {"impl": "flex"})):
        with pytest.raises(BackendUnavailableError, match=r"attn_pdrop=0\.1: build it with attn_pdrop=0\.0"):
            fastzoo.create("gpt2", attn=attn, attn_options=opts, **TINY)
        assert fastzoo.create("gpt2", attn=attn, attn_options=opts, attn_pdrop=0.0, **TINY).attn_name == attn
    m = fastzoo.create("gpt2", attn="sdpa", **TINY)  # sdpa/eager/varlen apply dropout
    with pytest.raises(BackendUnavailableError, match="attn_pdrop"):
        m.set_attention("flex")
    assert m.attn_name == "sdpa"


def test_neighborhood_mask_is_refused_at_set_attention_for_gpt2(hf):
    m = ours(hf, "sdpa")
    for name in ("flex", "eager"):
        with pytest.raises(BackendUnavailableError, match="mask_mod='neighborhood' needs a 2-D token grid"):
            m.set_attention(name, mask_mod="neighborhood")
    assert m.attn_name == "sdpa"


def test_flex_training_on_cpu_fails_before_running(hf):
    m = ours(hf, "flex").train()
    with pytest.raises(BackendUnavailableError, match="backward"):
        m(**pack(seqs()).model_inputs())


def test_varlen_gpu_kernels_are_refused_at_create_without_gpu(hf):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for impl in ("torch", "flash", "xformers"):
        with pytest.raises(BackendUnavailableError, match=impl):
            ours(hf, "varlen", impl=impl)
    with pytest.raises(ValueError, match="impl"):
        ours(hf, "varlen", impl="nope")


# -- real size -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_size_gpt2_equals_hf_at_short_length():
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    m = fastzoo.create("gpt2", attn="sdpa", pretrained=hf).eval()
    assert m.config.n_layer == 12 and m.config.n_embd == 768 and m.config.vocab_size == 50257
    sequences = seqs((16, 9), vocab=50257)
    batch = pad_to_longest(sequences)
    with torch.no_grad():
        ref = hf(batch.input_ids, attention_mask=batch.attention_mask).logits
        padded = m(batch.input_ids, attention_mask=batch.attention_mask).logits
        packed = m(**pack(sequences).model_inputs()).logits[0]
    real = batch.attention_mask.bool()
    assert_logits_close(padded[real], ref[real])
    assert_logits_close(packed, ref[real])
