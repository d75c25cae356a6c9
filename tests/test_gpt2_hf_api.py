"""GPT-2 is a drop-in for transformers' GPT2LMHeadModel: the code around the model (outputs,
labels, KV cache, generate, Trainer with HF packing, save/load, pickling, training plumbing)
works unchanged, with HF's model on the same weights as the oracle (fp32 CPU)."""
import copy
import pickle
import tempfile

import conftest
import pytest
import torch
import transformers

import fastzoo
from fastzoo import equivalence
from fastzoo.equivalence import draw_
from fastzoo.data import pack, pad_to_longest
from fastzoo.models.decoder.convert import GPT2 as HF_CONVERTER

TINY = conftest.TINY["gpt2"]
TOL = 1e-4  # fastzoo.equivalence's rule: fp32 CPU, same weights
LOSS_TOL = 1e-5  # a mean cross-entropy in fp32, summed in another order
GRAD_RTOL = 1e-4  # relative to each gradient's largest entry


def hf_model(**kw):
    cfg = transformers.GPT2Config(**{**TINY, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                                     "bos_token_id": 5, "eos_token_id": 5, **kw})
    torch.manual_seed(0)
    return draw_(transformers.GPT2LMHeadModel(cfg)).eval()


@pytest.fixture(scope="module")
def hf():
    return hf_model()


def ours(hf, attn="sdpa"):
    return fastzoo.create("gpt2", attn=attn, pretrained=hf)


def batch(lengths=(5, 9, 3), side="right"):
    g = torch.Generator().manual_seed(2)
    return pad_to_longest([torch.randint(0, 128, (n,), generator=g) for n in lengths], side=side)


def grads_close(m, hf):
    ref = HF_CONVERTER.to_fastzoo({k: p.grad for k, p in hf.named_parameters()})
    for name, p in m.named_parameters():
        assert (p.grad - ref[name]).abs().max() <= GRAD_RTOL * ref[name].abs().max() + 1e-7, name


# -- part 1: call and output conventions ---------------------------------------------------------
def test_output_is_transformers_output_with_loss_first(hf):
    m = ours(hf)
    b = batch()
    out = m(b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
    ref = hf(b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
    assert type(out) is type(ref)  # CausalLMOutputWithCrossAttentions, transformers' own class
    assert out[0] is out.loss and out["logits"] is out.logits
    assert (out.loss - ref.loss).abs() <= LOSS_TOL
    real = b.attention_mask.bool()
    assert (out.logits - ref.logits)[real].abs().max() <= TOL


def test_labels_loss_and_grads_equal_hf_in_train_mode_without_logits(hf):
    """Training with labels fuses the loss with the LM head: same loss and gradients as HF,
    and .logits is None (never something else)."""
    m = ours(hf).train()
    b = batch()
    out = m(b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
    hf.zero_grad()
    ref = hf(b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
    ref.loss.backward()
    out.loss.backward()
    assert out.logits is None and out.past_key_values is None
    assert (out.loss - ref.loss).abs() <= LOSS_TOL
    grads_close(m, hf)


@pytest.mark.parametrize("train", [False, True])
def test_shift_labels_are_used_as_given_like_hf(hf, train):
    """transformers' shift_labels (context parallel shifts before sharding): the loss uses them
    as given, equal to HF's on the same weights, in eval mode and with the fused train loss."""
    m = ours(hf).train(train)
    b = batch()
    shifted = torch.roll(b.labels, -3, dims=1)  # any aligned targets, not labels shifted by one
    shifted[:, -1] = -100
    out = m(b.input_ids, attention_mask=b.attention_mask, labels=b.labels, shift_labels=shifted)
    ref = hf(b.input_ids, attention_mask=b.attention_mask, labels=b.labels, shift_labels=shifted)
    assert (out.loss - ref.loss).abs() <= LOSS_TOL
    plain = m(b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
    assert (out.loss - plain.loss).abs() > 1e-3


def test_return_dict_false_gives_hf_tuple(hf):
    m = ours(hf)
    ids = batch().input_ids
    out, ref = m(ids, labels=ids, return_dict=False), hf(ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(ref) == 3  # loss, logits, past_key_values
    assert (out[0] - ref[0]).abs() <= LOSS_TOL and (out[1] - ref[1]).abs().max() <= TOL


def test_hidden_states_equal_hf(hf):
    m = ours(hf)
    ids = batch().input_ids
    out, ref = m(ids, output_hidden_states=True), hf(ids, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == TINY["n_layer"] + 1
    for a, r in zip(out.hidden_states, ref.hidden_states):
        assert (a - r).abs().max() <= TOL


def test_config_output_hidden_states_is_the_default_like_hf():
    """HF's own test_hidden_states_output sets config.output_hidden_states=True and calls the
    model without the keyword: the config's value is the default."""
    ref_model = hf_model(output_hidden_states=True)
    m = ours(ref_model)
    assert m.config.output_hidden_states
    ids = batch().input_ids
    out, ref = m(ids), ref_model(ids)
    assert len(out.hidden_states) == len(ref.hidden_states) == TINY["n_layer"] + 1
    for a, r in zip(out.hidden_states, ref.hidden_states):
        assert (a - r).abs().max() <= TOL
    assert m(ids, output_hidden_states=False).hidden_states is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_position_equals_hf_with_holes_in_the_mask(hf, attn):
    """A mask with holes (HF's tests draw random masks) and right padding: HF's value at every
    position, padding ones included (a padding query sees the real keys before it). HF's own
    test_left_padding_compatibility reads the last position, which its random mask may pad."""
    m = ours(hf, attn)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (3, 7), generator=g)
    mask = torch.tensor([[1, 0, 0, 1, 0, 0, 0], [1, 1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0, 0]])
    assert (m(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits).abs().max() <= TOL
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # what HF's test passes
    left = torch.cat([torch.zeros(3, 4, dtype=ids.dtype), ids], 1), torch.cat([torch.zeros(3, 4, dtype=mask.dtype), mask], 1)
    left_pos = (left[1].cumsum(-1) - 1).masked_fill(left[1] == 0, 1)
    unpadded = m(ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    padded = m(left[0], attention_mask=left[1], position_ids=left_pos).logits[:, -1]
    assert (unpadded - padded).abs().max() <= 1e-5
    assert (padded - hf(left[0], attention_mask=left[1], position_ids=left_pos).logits[:, -1]).abs().max() <= TOL


def test_inputs_embeds_and_token_type_ids_equal_hf(hf):
    m = ours(hf)
    ids = batch().input_ids
    types = torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(3))
    emb = hf.transformer.wte(ids).detach()
    assert (m(inputs_embeds=emb).logits - hf(inputs_embeds=emb).logits).abs().max() <= TOL
    assert (m(ids, token_type_ids=types).logits - hf(ids, token_type_ids=types).logits).abs().max() <= TOL


def test_output_attentions_is_refused_by_name(hf):
    with pytest.raises(ValueError, match="output_attentions"):
        ours(hf)(batch().input_ids, output_attentions=True)


def test_unknown_keyword_is_a_type_error(hf):
    with pytest.raises(TypeError, match="attention_maks"):
        ours(hf)(batch().input_ids, attention_maks=None)


# -- part 2: KV cache and generate ---------------------------------------------------------------
CACHED = ["sdpa", "eager", "varlen", "nested"]  # varlen / nested: packed kernels, keys with their own offsets


@pytest.mark.parametrize("attn", CACHED)
def test_past_key_values_continuation_equals_full_forward(hf, attn):
    m = ours(hf, attn)
    b = batch(side="left")
    ids, mask = b.input_ids, b.attention_mask
    pos = b.position_ids
    first = m(ids[:, :-2], attention_mask=mask[:, :-2], position_ids=pos[:, :-2], use_cache=True)
    step = m(ids[:, -2:], attention_mask=mask, position_ids=pos[:, -2:], past_key_values=first.past_key_values)
    full = m(ids, attention_mask=mask, position_ids=pos).logits
    assert (step.logits - full[:, -2:]).abs().max() <= TOL
    assert step.past_key_values.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("attn", ["varlen", "nested"])
def test_each_cached_decoding_step_gives_the_full_forwards_logits(hf, attn):
    """Prefill a left-padded batch, then feed one token per row at a time through the cache:
    every step's logits are the full forward's at that position (HF's model as the oracle)."""
    m = ours(hf, attn)
    b = batch(side="left")
    ids, mask = b.input_ids, b.attention_mask
    steps = torch.randint(0, 128, (ids.shape[0], 4), generator=torch.Generator().manual_seed(9))
    full_ids = torch.cat([ids, steps], 1)
    full_mask = torch.cat([mask, torch.ones_like(steps)], 1)
    full_pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    want = hf(full_ids, attention_mask=full_mask, position_ids=full_pos).logits
    out = m(ids, attention_mask=mask, position_ids=full_pos[:, :ids.shape[1]], use_cache=True)
    for t in range(steps.shape[1]):
        end = ids.shape[1] + t + 1
        out = m(steps[:, t:t + 1], attention_mask=full_mask[:, :end], position_ids=full_pos[:, end - 1:end],
                past_key_values=out.past_key_values)
        assert (out.logits[:, 0] - want[:, end - 1]).abs().max() <= TOL, f"step {t}"
    assert out.past_key_values.get_seq_length() == full_ids.shape[1]


@pytest.mark.parametrize("attn", ["varlen", "nested"])
def test_cached_continuation_without_attention_mask_on_packed_backends(hf, attn):
    """No mask: the packed kernels read the batch as B sequences of S new queries and past + S keys."""
    m = ours(hf, attn)
    ids = batch((9, 9, 9)).input_ids
    first = m(ids[:, :6], use_cache=True)
    step = m(ids[:, 6:], past_key_values=first.past_key_values)
    assert (step.logits - hf(ids).logits[:, 6:]).abs().max() <= TOL


def test_generate_snippet_gives_hf_tokens_on_packed_backends(hf, tmp_path):
    """The user's lines, verbatim but for the directory: generate with the (default) KV cache
    on attn="varlen" and "nested" equals HF's generate token for token, left padding included."""
    hf_dir = str(tmp_path / "hf_dir")
    hf.save_pretrained(hf_dir)
    b = batch(side="left")
    input_ids, mask = b.input_ids, b.attention_mask
    want = hf.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    for attn in ("varlen", "nested"):
        m = fastzoo.create("gpt2", attn=attn, pretrained=hf_dir)
        got = m.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False)   # == HF token for token, left padding too
        assert torch.equal(got, want), attn


@pytest.mark.parametrize("attn", ["sdpa", "varlen", "nested"])
@pytest.mark.parametrize("kind", conftest.GENERATE)
def test_generate_equals_hf_token_for_token_left_padded(hf, kind, attn):
    conftest.assert_generate_equals_original(ours(hf, attn), hf, batch(side="left"), kind)


@pytest.mark.parametrize("attn", ["sdpa", "varlen", "nested"])
def test_generate_stops_at_eos_and_pads_like_hf(attn):
    hf = hf_model()
    m = ours(hf, attn)
    ids = batch((4, 6), side="left")
    greedy = hf.generate(ids.input_ids, attention_mask=ids.attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    eos = int(greedy[0, ids.input_ids.shape[1] + 1])  # row 0's second new token: it stops there
    kw = dict(attention_mask=ids.attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=eos)
    got, want = m.generate(ids.input_ids, **kw), hf.generate(ids.input_ids, **kw)
    assert torch.equal(got, want)
    assert (got[0, ids.input_ids.shape[1] + 2:] == 0).all()  # padded after eos


def test_generate_refuses_a_backend_without_kv_cache_before_running(hf, monkeypatch):
    import fastzoo.attention as registry
    from fastzoo.attention import Capabilities, get_backend, register_attention
    from fastzoo.attention.base import FLOATS

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the test's backend goes away after it
    eager = get_backend("eager")
    register_attention("no_kv_cache_test", lambda q, k, v, ctx: eager(q, k, v, ctx),
                       capabilities=Capabilities(devices={"cpu": FLOATS}, causal=True, padding_mask=True))
    m = ours(hf, "no_kv_cache_test")
    with pytest.raises(fastzoo.errors.BackendUnavailableError, match="KV cache"):
        m.generate(batch().input_ids, max_new_tokens=2)
    b = batch(side="left")
    got = m.generate(b.input_ids, attention_mask=b.attention_mask, max_new_tokens=4, do_sample=False, use_cache=False, pad_token_id=0)
    want = hf.generate(b.input_ids, attention_mask=b.attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


# -- part 3: HF packing conventions --------------------------------------------------------------
def _flattened(lengths=(5, 9, 3), **kw):
    g = torch.Generator().manual_seed(4)
    features = [{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in lengths]
    return transformers.DataCollatorWithFlattening(return_tensors="pt", **kw)(features), features


@pytest.mark.parametrize("flash_kwargs", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager", "varlen"])
def test_data_collator_with_flattening_is_packed_on_every_backend(hf, attn, flash_kwargs):
    b, features = _flattened(return_flash_attn_kwargs=flash_kwargs)
    assert "attention_mask" not in b
    out = ours(hf, attn)(**b)
    start = 0
    for f in features:  # each sequence equals HF on it alone: nothing attends across
        n = len(f["input_ids"])
        alone = hf(torch.tensor([f["input_ids"]])).logits[0]
        assert (out.logits[0, start:start + n] - alone).abs().max() <= TOL
        start += n
    # the loss never scores a token of one sequence as the continuation of another
    each = [hf(torch.tensor([f["input_ids"]]), labels=torch.tensor([f["input_ids"]])).loss for f in features]
    counts = [len(f["input_ids"]) - 1 for f in features]
    ref = sum(loss * c for loss, c in zip(each, counts)) / sum(counts)
    assert (out.loss - ref).abs() <= LOSS_TOL


def test_flattened_rows_of_a_batch_stay_separate(hf):
    """[B, S] rows whose positions restart, no mask: per-sequence attention in every row."""
    m = ours(hf)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (2, 8), generator=g)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    out = m(ids, position_ids=pos).logits
    assert (out[0, 3:] - hf(ids[:1, 3:]).logits[0]).abs().max() <= TOL
    assert (out[1, 6:] - hf(ids[1:, 6:]).logits[0]).abs().max() <= TOL


def test_trainer_with_flattening_collator_matches_hf_losses(hf):
    g = torch.Generator().manual_seed(1)
    ds = [{"input_ids": torch.randint(0, 128, (int(n),), generator=g).tolist()} for n in torch.randint(4, 20, (12,), generator=g)]

    def losses(model):
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3, logging_steps=1, report_to=[],
            learning_rate=1e-3, seed=0, use_cpu=True, save_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                       data_collator=transformers.DataCollatorWithFlattening())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ref = losses(copy.deepcopy(hf).train())
    got = losses(ours(hf).train())
    assert len(got) == len(ref) == 3
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4  # fp32, 3 AdamW steps apart from rounding


def test_trainer_saves_checkpoints_and_resumes_to_the_same_weights(hf, tmp_path):
    """Trainer's own checkpoint saves (a model that is not a PreTrainedModel: its state dict goes
    to safetensors) work with the tied head, and resuming from one ends at the uninterrupted run's
    weights."""
    g = torch.Generator().manual_seed(3)
    ds = [{"input_ids": torch.randint(0, 128, (int(n),), generator=g).tolist()} for n in torch.randint(4, 20, (16,), generator=g)]

    def run(model, out, resume=None):
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, max_steps=4, save_steps=2, report_to=[],
            learning_rate=1e-3, seed=0, use_cpu=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                       data_collator=transformers.DataCollatorWithFlattening())
        trainer.train(resume_from_checkpoint=resume)
        return trainer.model

    full = run(ours(hf).train(), tmp_path / "full")
    assert (tmp_path / "full" / "checkpoint-2" / "model.safetensors").is_file()
    resumed = run(ours(hf).train(), tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.lm_head.weight is resumed.transformer.wte.weight  # still tied after loading
    for (k, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters()):
        assert (a - b).abs().max() <= 1e-6, k  # fp32: the same 2 AdamW steps after the same state


def test_state_dict_stores_the_tied_head_once(hf):
    """As HF's files: one key for the tied tensor, so safetensors (Trainer's checkpoints) can
    store it; loading such a state dict ties the head to the loaded embedding."""
    m = ours(hf)
    state = m.state_dict()
    assert "lm_head.weight" not in state and "transformer.wte.weight" in state
    fresh = fastzoo.create("gpt2", **TINY)
    fresh.load_state_dict(state)  # strict: no missing key
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, m.transformer.wte.weight)


# -- part 4: training plumbing -------------------------------------------------------------------
def test_dropout_zero_idiom_makes_padded_and_packed_training_steps_equal():
    """Attention dropout is an nn.Dropout module: setting every nn.Dropout's p to 0 turns it
    off, and padded and packed training steps then agree in loss and gradients."""
    hf = hf_model(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    m = fastzoo.create("gpt2", attn="sdpa", pretrained=hf).train()
    drops = [mod for mod in m.modules() if isinstance(mod, torch.nn.Dropout)]
    assert len(drops) == 1 + 3 * TINY["n_layer"]  # embeddings; per block: attention, residual, MLP
    for mod in drops:
        mod.p = 0.0
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (5, 9, 3)]
    results = []
    for b in (pad_to_longest(seqs), pack(seqs)):
        mm = copy.deepcopy(m)
        loss = mm(**b.model_inputs(), labels=b.labels).loss
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in mm.named_parameters()}))
    (lp, gp), (lk, gk) = results
    assert (lp - lk).abs() <= LOSS_TOL
    for k in gp:
        assert (gp[k] - gk[k]).abs().max() <= GRAD_RTOL * gp[k].abs().max() + 1e-7, k


def test_attention_dropout_reaches_the_kernel_in_train_mode(hf):
    m = ours(hf)
    seen = []
    backend = m.attention_backend
    orig = type(backend).forward

    def spy(self, q, k, v, ctx):
        seen.append(ctx.dropout_p)
        return orig(self, q, k, v, ctx)

    for mod in m.modules():
        if type(mod).__name__ == "CausalSelfAttention":
            mod.attn_dropout.p = 0.25
    type(backend).forward = spy
    try:
        m.train()(batch().input_ids)
        m.eval()(batch().input_ids)
    finally:
        type(backend).forward = orig
    assert seen == [0.25] * TINY["n_layer"] + [0.0] * TINY["n_layer"]


def test_gradient_checkpointing_gives_the_same_grads(hf):
    m = ours(hf).train()
    ids = batch().input_ids
    m(ids, labels=ids).loss.backward()
    ref = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    m.gradient_checkpointing_enable()
    assert m.is_gradient_checkpointing
    m(ids, labels=ids).loss.backward()
    for k, p in m.named_parameters():
        assert (p.grad - ref[k]).abs().max() <= 1e-6, k  # the same arithmetic, recomputed
    m.gradient_checkpointing_disable()
    assert not m.is_gradient_checkpointing


def test_enable_input_require_grads_gives_frozen_embeddings_hfs_gradients(hf):
    """PEFT's idiom: embeddings frozen, gradient checkpointing on, enable_input_require_grads:
    the blocks get HF's gradients in the same set-up (without it, reentrant checkpointing
    would give them none); disable removes the hook; the model still pickles."""
    import copy as _copy

    ref_model = _copy.deepcopy(hf).train()
    m = ours(hf).train()
    ids = batch().input_ids
    for model in (m, ref_model):
        model.get_input_embeddings().weight.requires_grad_(False)
        model.transformer.wpe.weight.requires_grad_(False)
        model.gradient_checkpointing_enable({"use_reentrant": True})
        model.enable_input_require_grads()
    ref_model(ids, labels=ids).loss.backward()
    m(ids, labels=ids).loss.backward()
    ref = HF_CONVERTER.to_fastzoo({k: p.grad for k, p in ref_model.named_parameters() if p.grad is not None})
    block_grads = {k: p.grad for k, p in m.named_parameters() if k.startswith("transformer.h.")}
    assert block_grads and all(g is not None for g in block_grads.values())
    for k, g in block_grads.items():
        assert (g - ref[k]).abs().max() <= GRAD_RTOL * ref[k].abs().max() + 1e-7, k
    pickle.loads(pickle.dumps(m))
    m.disable_input_require_grads()
    assert not m.get_input_embeddings()._forward_hooks
    m.zero_grad(set_to_none=True)
    m(ids, labels=ids).loss.backward()  # without the hook: reentrant checkpointing gives the blocks nothing
    assert all(p.grad is None for k, p in m.named_parameters() if k.startswith("transformer.h."))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_peft_lora_trains_only_the_adapters_as_on_hf(hf, layout):
    """peft's LoRA on c_attn and c_fc (HF's Conv1D there, fastzoo's Linear here: the adapters have
    the same shapes either way): HF's adapters, the base frozen, HF's loss and adapter gradients."""
    b = batch()
    packed = pack([row[:n] for row, n in zip(b.input_ids, b.attention_mask.sum(1))])  # right padding
    inputs = dict(**packed.model_inputs(), labels=packed.labels) if layout == "packed" else {}
    conftest.assert_lora_equals_original(ours(hf, "varlen"), copy.deepcopy(hf), ["c_attn", "c_fc"], b, **inputs)


def test_prepare_inputs_for_generation_is_transformers_and_generate_from_embeddings_equals_hf(hf):
    """HF's generation tests read prepare_inputs_for_generation's signature (inputs_embeds) and
    generate from inputs_embeds; model.config answers what they read of a config."""
    m = ours(hf)
    import inspect

    assert "inputs_embeds" in inspect.signature(m.prepare_inputs_for_generation).parameters
    assert m.config.is_encoder_decoder is False and m.config.get_text_config() is m.config
    ids = batch(lengths=(4, 4)).input_ids
    emb = hf.transformer.wte(ids).detach()
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(inputs_embeds=emb, **kw), hf.generate(inputs_embeds=emb, **kw))


def test_embedding_accessors_and_resize_keep_the_head_tied(hf):
    m = ours(hf)
    assert m.get_input_embeddings() is m.transformer.wte and m.get_output_embeddings() is m.lm_head
    old = m.transformer.wte.weight.detach().clone()
    m.resize_token_embeddings(133, pad_to_multiple_of=8)
    assert m.config.vocab_size == 136 and m.lm_head.weight is m.transformer.wte.weight
    assert torch.equal(m.transformer.wte.weight[:128], old)
    assert m(torch.tensor([[135, 1]])).logits.shape == (1, 2, 136)
    for bad in ({"pad_to_multiple_of": 1.3}, {"new_num_tokens": 130.5}, {"pad_to_multiple_of": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):  # HF's test_resize_tokens_embeddings passes 1.3
            m.resize_token_embeddings(**{"new_num_tokens": 136, **bad})
    assert m.config.vocab_size == 136


def test_num_parameters_equals_hf(hf):
    m = ours(hf)
    assert m.num_parameters() == hf.num_parameters()
    assert m.num_parameters(exclude_embeddings=True) == hf.num_parameters(exclude_embeddings=True)


def test_pickle_and_deepcopy_compute_the_same_function(hf):
    m = ours(hf)
    ids = batch().input_ids
    ref = m(ids).logits
    for twin in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert torch.equal(twin(ids).logits, ref)
        assert twin.lm_head.weight is twin.transformer.wte.weight


# -- part 5: save / load both ways ---------------------------------------------------------------
def test_pretrained_model_is_in_eval_mode_like_from_pretrained(hf):
    assert not ours(hf).training
    assert fastzoo.create("gpt2", **TINY).training  # a fresh model trains, as HF's constructor


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", torch.bfloat16, "auto"])
def test_dtype_by_name_and_auto_like_from_pretrained(hf, tmp_path, dtype):
    """HF's test_bc_torch_dtype loads with dtype names and "auto" (the checkpoint's dtype)."""
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path)
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype="bfloat16" if dtype == "bf16" else dtype)
    m = fastzoo.create("gpt2", pretrained=tmp_path, dtype=dtype)
    assert {p.dtype for p in m.parameters()} == {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    ids = batch().input_ids
    # bf16 arithmetic on both sides: the rule's bf16 bound, against the same bf16 weights run in fp32
    want = copy.deepcopy(ref).float()(ids).logits
    with torch.no_grad():
        c = equivalence.compare_outputs("logits", m(ids).logits.float(), want, ref(ids).logits.float())
    assert c.passed, c
    with pytest.raises(ValueError, match="dtype="):
        fastzoo.create("gpt2", dtype="float13", **TINY)
    assert next(fastzoo.create("gpt2", dtype="auto", **TINY).parameters()).dtype == torch.float32  # nothing to follow


def test_pretrained_inside_a_meta_device_context_is_a_named_error(hf, tmp_path):
    ours(hf).save_pretrained(tmp_path)
    with torch.device("meta"), pytest.raises(ValueError, match="pretrained= inside a torch.device"):
        fastzoo.create("gpt2", pretrained=tmp_path)
    m = ours(hf)
    m.resize_token_embeddings(140)
    assert m.vocab_size == m.config.vocab_size == 140


def test_save_pretrained_is_read_by_transformers_and_fastzoo(hf, tmp_path):
    m = ours(hf)
    m.save_pretrained(tmp_path)
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = batch().input_ids
    assert (loaded(ids).logits - m(ids).logits).abs().max() <= TOL
    again = fastzoo.create("gpt2", pretrained=tmp_path)
    assert torch.equal(again(ids).logits, m(ids).logits)


# -- inputs ----------------------------------------------------------------------------------------
def test_packed_sequence_longer_than_n_positions_is_a_named_error(hf):
    ids = torch.zeros(1, 70, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens.*n_positions=64"):
        ours(hf)(ids, cu_seqlens=torch.tensor([0, 70], dtype=torch.int32))


def test_cu_seqlens_as_a_list_is_a_named_error(hf):
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32 tensor.*list"):
        ours(hf)(torch.zeros(1, 6, dtype=torch.long), cu_seqlens=[0, 3, 6])


@pytest.mark.parametrize("cu", [
    [0, 3, 6],  # a list
    torch.tensor([0, 4, 3, 6]),  # not increasing
    torch.tensor([1, 3, 6]),  # not starting at 0
    torch.tensor([0, 3, 5]),  # not ending at T
    torch.tensor([[0, 3, 6]]),  # 2-D
    torch.tensor([0.0, 3.0, 6.0]),  # float
])
def test_causal_lm_loss_validates_cu_seqlens(cu):
    from fastzoo.losses import causal_lm_loss

    logits, labels = torch.zeros(1, 6, 10), torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_lm_loss(logits, labels, cu_seqlens=cu)


def test_bench_generate_rows_time_hf_and_fastzoo_with_equal_tokens():
    from fastzoo.bench.causal_lm import causal_lm_suite
    from fastzoo.bench.harness import run_suite
    from fastzoo.models.spec import Workload
    from fastzoo.registry import get_entry

    workload = Workload("tiny", dict(TINY), batch=3, max_len=12)
    suite = causal_lm_suite(get_entry("gpt2"), workload, backends=["sdpa", "varlen", "nested"], modes=("eval",))
    suite.groups = [g for g in suite.groups if "generate" in g.name]
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    rows = [r for r in report.rows if "generate" in r.group]
    assert [r.label for r in rows] == ["HF generate, KV cache (sdpa)"] + [
        f"fastzoo generate, KV cache ({b})" for b in ("sdpa", "varlen", "nested")]
    assert all(r.status == "ok" and r.max_err == 0 and r.median_s > 0 for r in rows)  # same tokens, both timed


# -- compiler paths --------------------------------------------------------------------------------
def test_export_with_dynamic_batch_and_sequence_length(hf):
    m = ours(hf)
    ids = batch().input_ids
    B, S = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=TINY["n_positions"])
    with torch.no_grad():
        ep = torch.export.export(m, (ids,), dynamic_shapes=({0: B, 1: S},))
        masked = torch.export.export(m, (ids,), {"attention_mask": torch.ones_like(ids)},
                                     dynamic_shapes={"input_ids": {0: B, 1: S}, "attention_mask": {0: B, 1: S}})
        x = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(8))
        mask = torch.ones_like(x)
        mask[0, :5] = 0
        assert (ep.module()(x).logits - hf(x).logits).abs().max() <= TOL
        got = masked.module()(x, attention_mask=mask).logits
        assert (got - hf(x, attention_mask=mask).logits)[mask.bool()].abs().max() <= TOL


def test_compiles_with_fullgraph(hf):
    m = ours(hf)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="eager")  # graph capture is what is tested
    b = batch()
    with torch.no_grad():
        got = compiled(b.input_ids, attention_mask=b.attention_mask).logits
        assert (got - hf(b.input_ids, attention_mask=b.attention_mask).logits)[b.attention_mask.bool()].abs().max() <= TOL
