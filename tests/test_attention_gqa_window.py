"""Grouped-query and sliding-window attention through the contract.

A layer passes k/v with fewer heads than q and never repeats them: a backend declaring
``gqa`` takes them as they are, any other gets them repeated by the contract. A sliding
window (``ctx.window``) means transformers' ``sliding_window_causal_mask_function``: query i
sees keys j with i - j < window; it composes with padding, packed sequences and a KV cache
(bottom-right). Every CPU backend either equals the reference on a context, values and
gradients, or refuses it before running, naming what it lacks.
"""
import pytest
import torch

import fastzoo
from fastzoo.attention import AttnContext, AttnRequest, Capabilities, get_backend, masks, register_attention
from fastzoo.attention.base import FLOATS
from fastzoo.equivalence import tiny_overrides
from fastzoo.errors import BackendUnavailableError
from fastzoo.layers.attention import UsesAttention

TOL = 1e-5  # fp32 CPU, one attention op on unit-variance inputs: summation order only
HQ, HKV, D = 4, 2, 8
CU_Q, CU_K = [0, 3, 7], [0, 5, 11]  # packed: two sequences; with a KV cache the keys have their own offsets


def _t(cu):
    return torch.tensor(cu, dtype=torch.int32)


def _longest(cu):
    return max(b - a for a, b in zip(cu[:-1], cu[1:]))


# name -> (q shape, k shape, context) ; window None or an int joins each
def case(kind, window):
    if kind == "dense":
        return (2, HQ, 7, D), (2, HKV, 7, D), AttnContext(causal=True, window=window)
    if kind == "padding":  # one left-padded, one right-padded row
        valid = torch.tensor([[False, False, True, True, True, True, True], [True, True, True, True, True, False, False]])
        return (2, HQ, 7, D), (2, HKV, 7, D), AttnContext(causal=True, key_padding_mask=valid, window=window)
    if kind == "packed":
        return (1, HQ, 7, D), (1, HKV, 7, D), AttnContext(causal=True, cu_seqlens=_t(CU_Q), max_seqlen=4, window=window)
    if kind == "kv_cache":
        return (2, HQ, 3, D), (2, HKV, 8, D), AttnContext(causal=True, window=window)
    if kind == "packed_kv_cache":
        return (1, HQ, 7, D), (1, HKV, 11, D), AttnContext(
            causal=True, cu_seqlens=_t(CU_Q), max_seqlen=_longest(CU_Q), cu_seqlens_k=_t(CU_K),
            max_seqlen_k=_longest(CU_K), window=window)
    raise AssertionError(kind)


KINDS = ["dense", "padding", "packed", "kv_cache", "packed_kv_cache"]
BACKENDS = [("eager", {}), ("sdpa", {}), ("sdpa", {"sdpa_backend": "math"}), ("sdpa", {"sdpa_backend": "flash"}),
            ("flex", {}), ("varlen", {}), ("varlen", {"impl": "flex"}), ("nested", {})]
# what each must serve (a backend refusing everything would pass the "equal or refused" rule)
SERVES = {
    "eager": set(KINDS), "sdpa": set(KINDS), "flex": set(KINDS),
    "varlen": {"dense", "packed", "kv_cache", "packed_kv_cache"}, "nested": {"dense", "packed", "kv_cache", "packed_kv_cache"},
}


def inputs(kind, window, grads=True, seed=0):
    q_shape, k_shape, ctx = case(kind, window)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=g, requires_grad=grads)
    k, v = (torch.randn(k_shape, generator=g, requires_grad=grads) for _ in range(2))
    return q, k, v, ctx


def reference(q, k, v, ctx):
    """eager with k/v repeated by torch's own repeat_interleave (not fastzoo's helper)."""
    G = q.shape[1] // k.shape[1]
    return get_backend("eager")(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), ctx)


def _label(p):
    name, opts = p
    return name + "".join(f"-{v}" for v in opts.values())


@pytest.mark.parametrize("window", [None, 3], ids=["gqa", "gqa-window3"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS, ids=_label)
def test_backend_equals_reference_or_refuses(backend, kind, window):
    name, opts = backend
    attn = get_backend(name, **opts)
    grads = name != "flex" and not opts.get("impl") == "flex"  # flex has no backward on CPU (declared)
    q, k, v, ctx = inputs(kind, window, grads)
    refused = attn.problems(attn.call_request(q, k, ctx))
    must_serve = kind in SERVES[name] and not (window and name == "nested")
    if refused:
        assert not must_serve, f"{name} {opts} refuses {kind}: {refused}"
        with pytest.raises(BackendUnavailableError):
            attn(q, k, v, ctx)
        return
    out = attn(q, k, v, ctx)
    ref = reference(q, k, v, ctx)
    real = _real_rows(ctx, q)
    assert ((out - ref) * real).abs().max() <= TOL
    if grads:
        w = torch.randn_like(ref) * real  # padding queries' outputs are unused: no gradient from them
        for g, g_ref in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
            assert (g - g_ref).abs().max() <= 1e-4  # fp32 backward: a few more roundings than the forward


def _real_rows(ctx, q):
    """[B, 1, Sq, 1]: the queries whose outputs a model reads (a padding query's is not)."""
    if ctx.key_padding_mask is None:
        return torch.ones(q.shape[0], 1, q.shape[2], 1, dtype=torch.bool)
    return ctx.key_padding_mask[:, None, -q.shape[2]:, None]


@pytest.mark.parametrize("offset", [0, 5])
def test_window_is_transformers_sliding_window(offset):
    """The window's off-by-one is transformers': with cache positions (queries after ``offset``
    cached keys), ``sliding_window_causal_mask_function(3)`` at absolute positions."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    Sq, W = 6, 3
    Sk = Sq + offset
    ours = masks.dense_mask(masks.context_mask_mod(AttnContext(causal=True, window=W), Sq, total_k=Sk), 1, 1, Sq, Sk, "cpu")
    hf_fn = sliding_window_causal_mask_function(W)
    zero = torch.tensor(0)
    hf = torch.tensor([[bool(hf_fn(zero, zero, torch.tensor(i + offset), torch.tensor(j))) for j in range(Sk)]
                       for i in range(Sq)])
    assert torch.equal(ours[0, 0], hf)
    assert ours[0, 0].sum(-1).max() == W  # and the window bites: no row sees more than W keys


def test_flash_window_size_is_the_same_window():
    """FlashAttention's inclusive window_size=(left, 0) with causal sees window keys: left = window - 1."""
    left, right = masks.flash_window_size(3)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    flash = (j <= i + right) & (j >= i - left)
    ours = masks.dense_mask(masks.causal_window(0, 3), 1, 1, 8, 8, "cpu")[0, 0]
    assert torch.equal(flash, ours) and masks.flash_window_size(None) == (-1, -1)


def test_window_kv_cache_equals_the_full_windowed_rows():
    """Decoding: the last Sq queries over all Sk keys give the full sequence's last Sq rows."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8, D, generator=g) for _ in range(3))
    eager = get_backend("eager")
    full = eager(q, k, v, AttnContext(causal=True, window=3))
    assert (eager(q[:, :, -2:], k, v, AttnContext(causal=True, window=3)) - full[:, :, -2:]).abs().max() <= TOL
    assert (full - eager(q, k, v, AttnContext(causal=True))).abs().max() > 1e-3, "the window must change the output"


def test_window_packed_equals_each_sequence_alone():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 7, D, generator=g) for _ in range(3))
    ctx = AttnContext(causal=True, cu_seqlens=_t(CU_Q), max_seqlen=4, window=2)
    out = get_backend("eager")(q, k, v, ctx)
    for a, b in zip(CU_Q[:-1], CU_Q[1:]):
        alone = get_backend("eager")(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], AttnContext(causal=True, window=2))
        assert (out[:, :, a:b] - alone).abs().max() <= TOL


@pytest.mark.parametrize("name,opts", [("nested", {}), ("xformers", {}), ("te", {}), ("neuron", {}),
                                       ("varlen", {"impl": "xformers"})])
def test_backends_without_window_refuse_it_naming_it(name, opts):
    req = AttnRequest(head_dim=64, causal=True, window=True, device="cuda", dtype=torch.bfloat16)
    assert any("sliding-window" in p for p in get_backend(name, **opts).problems(req))


@pytest.mark.parametrize("name,opts", [("fa2", {}), ("fa3", {}), ("varlen", {"impl": "flash"}),
                                       ("sdpa", {"sdpa_backend": "efficient"})])
def test_window_declared_by_kernels_that_take_it(name, opts):
    req = AttnRequest(head_dim=64, causal=True, window=True, device="cuda", dtype=torch.bfloat16)
    assert not any("sliding-window" in p for p in get_backend(name, **opts).problems(req))


def test_sdpa_flash_on_cuda_refuses_a_window_it_could_only_take_as_a_mask():
    req = AttnRequest(head_dim=64, causal=True, window=True, device="cuda", dtype=torch.bfloat16)
    assert any("sliding window" in p for p in get_backend("sdpa", sdpa_backend="flash").problems(req))


def test_window_needs_a_causal_context():
    q = torch.randn(1, 2, 4, D)
    with pytest.raises(ValueError, match="window"):
        get_backend("eager")(q, q, q, AttnContext(causal=False, window=2))
    with pytest.raises(ValueError, match="window"):
        get_backend("eager")(q, q, q, AttnContext(causal=True, window=0))


def test_kv_heads_must_divide_query_heads():
    q, k = torch.randn(1, 4, 3, D), torch.randn(1, 3, 3, D)
    with pytest.raises(ValueError, match="num_kv_heads divides num_heads"):
        get_backend("eager")(q, k, k, AttnContext())


@pytest.fixture
def scratch_registry(monkeypatch):
    import fastzoo.attention as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.mark.parametrize("native", [False, True])
def test_the_contract_repeats_kv_only_for_backends_without_gqa(scratch_registry, native):
    seen = []

    def fn(q, k, v, ctx):
        seen.append(k.shape[1])
        G = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1))

    register_attention("gqa_probe", fn, capabilities=Capabilities(devices={"cpu": FLOATS}, causal=False, gqa=native))
    q, k = torch.randn(1, HQ, 3, D), torch.randn(1, HKV, 3, D)
    out = get_backend("gqa_probe")(q, k, k, AttnContext())
    assert seen == [HKV if native else HQ]
    assert (out - reference(q, k, k, AttnContext())).abs().max() <= TOL


def test_a_layer_window_reaches_the_request_and_the_kernel():
    """A decoder layer sets sliding_window; create-time checks see it, and every backend
    serving it computes the same windowed model."""
    model = fastzoo.create("gpt2", attn="eager", **{**tiny_overrides("gpt2"), "attn_pdrop": 0.0}).eval()  # flex has no dropout
    for m in model.modules():
        if isinstance(m, UsesAttention):
            m.sliding_window = 2
    assert model.attention_request().window
    with pytest.raises(BackendUnavailableError, match="sliding-window"):
        model.set_attention("nested")
    assert model.attn_name == "eager"  # nothing changed
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        outs = {name: model.set_attention(name)(ids).logits for name in ("sdpa", "varlen", "flex")}
        for m in model.modules():
            if isinstance(m, UsesAttention):
                m.sliding_window = None
        plain = model.set_attention("eager")(ids).logits
    for name, out in outs.items():
        assert (out - ref).abs().max() <= 1e-4, name  # whole tiny model fp32: a few layers of rounding
    assert (plain - ref).abs().max() > 1e-3, "the window must change the model, or this test proves nothing"
