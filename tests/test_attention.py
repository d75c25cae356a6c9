"""The attention contract: backends agree with the eager reference on every mask and
modifier they declare, the reference agrees with a hand-written loop, and impossible
requests fail before running.

Tolerance: fp32 CPU, max abs diff <= 1e-5 on unit-variance q/k/v (one attention op).
"""
import conftest
import pytest
import torch
import torch.nn.functional as F

import fastzoo
from fastzoo.attention import AttnContext, Capabilities, get_backend, masks
from fastzoo.attention.base import FP32
from fastzoo.errors import BackendUnavailableError, UnknownBackendError

TOL = 1e-5
TINY = conftest.TINY["vit"]


def qkv(B=2, H=3, S=11, D=16):
    return [torch.randn(B, H, S, D) for _ in range(3)]


def loop_reference(q, k, v, allowed_SS_per_batch, score_fn=None):
    """softmax attention one (batch, head, query) at a time: the plainest possible statement."""
    B, H, S, D = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                s = (k[b, h] @ q[b, h, i]) * D**-0.5
                if score_fn is not None:
                    s = score_fn(s)
                keep = allowed_SS_per_batch[b][i]
                if keep.any():
                    s = s.masked_fill(~keep, float("-inf"))
                    out[b, h, i] = s.softmax(-1) @ v[b, h]
    return out


def test_eager_matches_loop_with_padding_and_causal():
    q, k, v = qkv(S=7)
    q, k, v = (t.repeat(2, 1, 1, 1)[:4] for t in (q, k, v))
    valid = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1, 0]],
                         dtype=torch.bool)
    ctx = AttnContext(causal=True, key_padding_mask=valid)
    out = get_backend("eager")(q, k, v, ctx)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    # every query sees the real keys its causal row allows, padding queries too (transformers'
    # values at padding positions); a padding query before the first real token (left padding)
    # sees every key of its row instead: its output is unused, but finite
    before_first_real = torch.arange(7)[None, :] < valid.int().argmax(1)[:, None]
    allowed = [causal & (valid[b][None, :] | before_first_real[b][:, None]) for b in range(4)]
    ref = loop_reference(q, k, v, allowed)
    assert (out - ref).abs().max() <= TOL


def test_eager_matches_loop_for_packed_sequences():
    q, k, v = qkv(B=1, S=9)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    out = get_backend("eager")(q, k, v, AttnContext(causal=True, cu_seqlens=cu, max_seqlen=4))
    doc = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 2])
    allowed = [(doc[:, None] == doc[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()]
    assert (out - loop_reference(q, k, v, allowed)).abs().max() <= TOL


def test_softcap_reference_matches_loop():
    q, k, v = [t * 4 for t in qkv(S=5)]  # large scores so the cap matters
    out = get_backend("eager", score_mod="softcap", softcap=2.0)(q, k, v, AttnContext())
    allowed = [torch.ones(5, 5, dtype=torch.bool)] * 2
    ref = loop_reference(q, k, v, allowed, score_fn=lambda s: 2.0 * torch.tanh(s / 2.0))
    assert (out - ref).abs().max() <= TOL


CONTEXTS = {
    "plain": lambda: AttnContext(),
    "causal": lambda: AttnContext(causal=True),
    "padding": lambda: AttnContext(key_padding_mask=torch.tensor([[1] * 11, [1] * 6 + [0] * 5], dtype=torch.bool)),
    "causal_padding": lambda: AttnContext(
        causal=True, key_padding_mask=torch.tensor([[1] * 11, [1] * 3 + [0] * 8], dtype=torch.bool)),
    "scale": lambda: AttnContext(scale=0.3),
}
BACKENDS = [("sdpa", {}), ("sdpa", {"sdpa_backend": "math"}), ("sdpa", {"sdpa_backend": "flash"}), ("flex", {})]


@pytest.mark.parametrize("ctx_name", sorted(CONTEXTS))
@pytest.mark.parametrize("name,opts", BACKENDS, ids=lambda v: str(v) if v else "")
def test_backends_match_eager(name, opts, ctx_name):
    q, k, v = qkv()
    ref = get_backend("eager")(q, k, v, CONTEXTS[ctx_name]())
    with torch.no_grad():
        out = get_backend(name, **opts)(q, k, v, CONTEXTS[ctx_name]())
    assert (out - ref).abs().max() <= TOL


@pytest.mark.parametrize("name,opts", BACKENDS[:3], ids=lambda v: str(v) if v else "")
def test_backends_packed_gradients_match_eager(name, opts):
    q, k, v = [t.requires_grad_() for t in qkv(B=1, S=10)]
    ctx = lambda: AttnContext(causal=True, cu_seqlens=torch.tensor([0, 3, 10], dtype=torch.int32), max_seqlen=7)
    grads = []
    for backend in (get_backend("eager"), get_backend(name, **opts)):
        out = backend(q, k, v, ctx())
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for g_ref, g in zip(*grads):
        assert (g - g_ref).abs().max() <= 1e-4


PRESETS = [
    dict(score_mod="softcap", softcap=5.0),
    dict(mask_mod="sliding_window", window=3),
    dict(mask_mod="neighborhood", radius=1),
    dict(mask_mod="causal"),
    dict(score_mod="softcap", mask_mod="neighborhood", radius=1, softcap=5.0),
]


@pytest.mark.parametrize("opts", PRESETS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_flex_presets_match_eager_in_a_vit(opts):
    """The same preset gives the same model output through flex and through the dense reference."""
    model = fastzoo.create("vit_b16", attn="eager", attn_options=opts, **TINY).eval()
    with torch.no_grad():  # sharpen attention so that masks and caps visibly change the output
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(8.0)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        model.set_attention("flex", **opts)
        out = model(x)
        model.set_attention("sdpa")
        plain = model(x)
    assert (out - ref).abs().max() <= 1e-4
    assert (plain - ref).abs().max() > 1e-3, "the preset must change the function, or this test proves nothing"


def test_neighborhood_mask_is_a_2d_window():
    mm = masks.neighborhood((3, 4), radius=1, num_prefix_tokens=1)
    allowed = masks.dense_mask(mm, 1, 1, 13, 13, "cpu")[0, 0]
    assert allowed[0].all() and allowed[:, 0].all()  # class token sees and is seen by all
    # patch (row 1, col 1) = token 1 + 4 + 1 = 6 sees rows 0..2, cols 0..2: 9 patches + cls
    assert allowed[6].sum() == 10
    # patch (0, 0) = token 1 sees (0,0) (0,1) (1,0) (1,1) + cls
    assert allowed[1].nonzero().flatten().tolist() == [0, 1, 2, 5, 6]


def test_flex_user_score_mod_and_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = qkv(S=16)

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (q_idx - kv_idx)

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 2

    with torch.no_grad():
        out = get_backend("flex", score_mod=bias, block_mask=create_block_mask(band, None, None, 16, 16, device="cpu"))(
            q, k, v, AttnContext())
    ref = get_backend("eager", score_mod=bias, mask_mod=band)(q, k, v, AttnContext())
    assert (out - ref).abs().max() <= TOL


def test_flex_backward_on_cpu_fails_before_running():
    model = fastzoo.create("vit_b16", attn="flex", **TINY)
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(BackendUnavailableError, match="no backward on cpu"):
        model(x)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()  # inference is served


def test_unknown_backend_suggests_names():
    with pytest.raises(UnknownBackendError, match="Did you mean 'flex'") as e:
        fastzoo.create("vit_b16", attn="flexx", **TINY)
    assert isinstance(e.value, KeyError)


def test_unknown_backend_option_is_named():
    with pytest.raises(TypeError, match="sdpa_kernel"):
        fastzoo.create("vit_b16", attn="sdpa", attn_options={"sdpa_kernel": "flash"}, **TINY)
    with pytest.raises(ValueError, match="sdpa_backend='fast'"):
        get_backend("sdpa", sdpa_backend="fast")
    with pytest.raises(ValueError, match="score_mod='tanh'"):
        get_backend("flex", score_mod="tanh")


def test_kernel_that_cannot_run_here_fails_at_create():
    # the memory-efficient SDPA kernel exists on CUDA only
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the check under test is the CPU refusal")
    with pytest.raises(BackendUnavailableError, match="runs on cuda only") as e:
        fastzoo.create("vit_b16", attn="sdpa", attn_options={"sdpa_backend": "efficient"}, **TINY)
    assert "Available on this machine: eager" in str(e.value)


def test_head_dim_and_feature_limits_fail_at_set_attention():
    caps = Capabilities(devices={"cpu": (FP32,)}, causal=False, max_head_dim=8)
    fastzoo.register_attention("tiny_kernel", lambda q, k, v, ctx: F.scaled_dot_product_attention(q, k, v),
                               capabilities=caps, overwrite=True)
    model = fastzoo.create("vit_b16", **TINY)  # head dim 16
    with pytest.raises(BackendUnavailableError, match="head dim <= 8, the model has 16"):
        model.set_attention("tiny_kernel")
    assert model.attn_name == "sdpa"  # nothing changed


def test_dtype_refused_at_create_when_named():
    caps = Capabilities(devices={"cpu": (torch.bfloat16,)})
    fastzoo.register_attention("bf16_only", lambda q, k, v, ctx: F.scaled_dot_product_attention(q, k, v),
                               capabilities=caps, overwrite=True)
    with pytest.raises(BackendUnavailableError, match="does not take fp32 on cpu"):
        fastzoo.create("vit_b16", attn="bf16_only", device="cpu", dtype=torch.float32, **TINY)
    model = fastzoo.create("vit_b16", attn="bf16_only", device="cpu", dtype=torch.bfloat16, **TINY)
    with pytest.raises(BackendUnavailableError, match="got fp32 on cpu"):
        model.float()(torch.randn(1, 3, 32, 32))


def test_user_function_backend_runs_in_the_model():
    calls = []

    def my_attention(q, k, v, ctx):
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q, k, v, scale=ctx.scale)

    fastzoo.register_attention("mine", my_attention, capabilities=Capabilities(devices={"cpu": (FP32,)}), overwrite=True)
    model = fastzoo.create("vit_b16", attn="mine", **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        ref = model.set_attention("eager")(x)
    assert calls == [(2, 4, 17, 16)] * 2
    assert (out - ref).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="already registered"):
        fastzoo.register_attention("mine", my_attention, capabilities=Capabilities(devices={"cpu": (FP32,)}))
    assert "mine" in fastzoo.list_attention(available_only=True)


def test_list_attention_and_matrix():
    names = fastzoo.list_attention()
    assert {"eager", "sdpa", "flex"} <= set(names)
    assert {"eager", "sdpa", "flex"} <= set(fastzoo.list_attention(available_only=True))
    from fastzoo.cli import main

    assert main(["list"]) == 0


def test_function_backend_without_capabilities_gets_the_conservative_default():
    """``register_attention``'s function form (fastzoo/attention/__init__.py): a plain function that may ignore ctx serves what needs
    no mask (ViT) and is refused at create where it would silently drop one (GPT-2 is causal)."""
    def plain(q, k, v, ctx):
        return F.scaled_dot_product_attention(q, k, v, scale=ctx.scale)

    fastzoo.register_attention("plain_fn", plain, overwrite=True)
    caps = fastzoo.attention.backend_class("plain_fn").capabilities
    assert not (caps.causal or caps.padding_mask or caps.varlen or caps.score_mod or caps.dropout)
    model = fastzoo.create("vit_b16", attn="plain_fn", **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        ref = model.set_attention("eager")(x)
    assert (out - ref).abs().max() <= 1e-4  # fp32 CPU, same weights
    with pytest.raises(BackendUnavailableError, match="has no causal masking"):
        fastzoo.create("gpt2", attn="plain_fn", **conftest.TINY["gpt2"])
    with pytest.raises(BackendUnavailableError, match="attn_drop_rate=0.1: build it with attn_drop_rate=0.0"):
        fastzoo.create("vit_b16", attn="plain_fn", attn_drop_rate=0.1, **TINY)


def test_flex_refuses_a_vit_with_attention_dropout_at_create():
    with pytest.raises(BackendUnavailableError, match="attn_drop_rate=0.1: build it with attn_drop_rate=0.0"):
        fastzoo.create("vit_b16", attn="flex", attn_drop_rate=0.1, **TINY)
    model = fastzoo.create("vit_b16", attn="sdpa", attn_drop_rate=0.1, **TINY)  # sdpa has dropout
    with pytest.raises(BackendUnavailableError, match="attn_drop_rate"):
        model.set_attention("flex")
    assert model.attn_name == "sdpa"
    q, k, v = qkv()
    with pytest.raises(BackendUnavailableError, match="no attention dropout"):  # direct calls: per call
        get_backend("flex")(q, k, v, AttnContext(dropout_p=0.1))


def test_vit_attention_dropout_reaches_the_backend_in_training_only():
    seen = []

    def spy(q, k, v, ctx):
        seen.append(ctx.dropout_p)
        return F.scaled_dot_product_attention(q, k, v)

    fastzoo.register_attention("dropout_spy", spy, capabilities=Capabilities(devices={"cpu": (FP32,)}), overwrite=True)
    model = fastzoo.create("vit_b16", attn="dropout_spy", attn_drop_rate=0.25, **TINY)
    x = torch.randn(1, 3, 32, 32)
    model.train()(x)
    model.eval()(x)
    assert seen == [0.25, 0.25, 0.0, 0.0]  # 2 layers, train then eval


@pytest.mark.parametrize("name", ["eager", "sdpa", "flex", "varlen", "nested"])
def test_no_queries_give_an_empty_output(name):
    q, k, v = qkv(S=0)
    with torch.no_grad():
        out = get_backend(name)(q, k, v, AttnContext(causal=name != "flex"))
    assert out.shape == (2, 3, 0, 16)


def test_a_shared_context_builds_the_mask_once(monkeypatch):
    """Layers share one AttnContext per forward: later calls with it (or a copy made by
    ctx.replace for a layer's own scale) reuse the first call's mask."""
    q, k, v = qkv()
    valid = CONTEXTS["causal_padding"]().key_padding_mask
    refs = {s: get_backend("eager")(q, k, v, AttnContext(causal=True, key_padding_mask=valid, scale=s)) for s in (None, 0.5)}
    built = []
    dense = masks.dense_mask
    monkeypatch.setattr(masks, "dense_mask", lambda *a: (built.append(1), dense(*a))[1])
    for name in ("sdpa", "eager"):
        built.clear()
        backend, ctx = get_backend(name), AttnContext(causal=True, key_padding_mask=valid)
        first, second = backend(q, k, v, ctx), backend(q, k, v, ctx.replace(scale=0.5))
        assert len(built) == 1
        assert (first - refs[None]).abs().max() <= TOL
        assert (second - refs[0.5]).abs().max() <= TOL  # the copy keeps its own scale with the shared mask
        assert ctx.scale is None  # the shared context is unchanged


def test_vit_forward_compiles_to_one_graph():
    """Nothing in the attention path breaks a torch.compile graph. (Flex on CPU is refused
    under compile: see test_backend_contract.py; on CUDA it is covered by the GPU tests.)"""
    model = fastzoo.create("vit_b16", attn="sdpa", **TINY).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(torch.randn(2, 3, 32, 32))
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex with automatic dynamic shapes: CUDA (Triton) only")
def test_compiled_flex_does_not_recompile_per_packed_length():
    from torch._dynamo.utils import counters

    backend = get_backend("flex", compile=True)
    torch._dynamo.reset()
    counters.clear()
    for T in (128, 200, 256, 320):
        q, k, v = (torch.randn(1, 4, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, T // 3, T], dtype=torch.int32, device="cuda")
        with torch.no_grad():
            out = backend(q, k, v, AttnContext(causal=True, cu_seqlens=cu, max_seqlen=T - T // 3))
        ref = get_backend("eager")(q.float(), k.float(), v.float(), AttnContext(causal=True, cu_seqlens=cu))
        assert (out.float() - ref).abs().max() <= 2e-2  # bf16 attention of O(1) values
    assert counters["stats"]["unique_graphs"] <= 2  # the first length static, then one symbolic-length graph


@pytest.mark.parametrize("backend,options", [("nested", {}), ("varlen", {}), ("sdpa", {}), ("flex", {})])
def test_attentions_whose_outputs_are_concatenated_get_the_eager_gradients(backend, options):
    """Two attentions over slices of one q / k / v, their outputs concatenated (RT-DETR's denoising groups beside
    its matching queries): ``torch.cat``'s backward hands each a view into its gradient. torch's jagged
    NestedTensor SDPA backward read such a view at the wrong place (q / k / v gradients 1.5-2.9 off, forwards
    exact), found by the detection property on an RT-DETR in training."""
    g = torch.Generator().manual_seed(0)
    # one head: each output's gradient is a compact slice at an offset into the concatenation's
    base = [torch.randn(1, 1, 26, 16, generator=g) for _ in range(3)]
    weight = torch.randn(1, 1, 26, 16, generator=g)

    def run(be):
        if "cpu" not in be.capabilities.backward:
            pytest.skip(f"{be.name} has no backward on cpu (its capabilities say so)")
        q, k, v = (t.clone().requires_grad_() for t in base)
        first = be(q[:, :, 18:], k[:, :, 18:], v[:, :, 18:], AttnContext())
        second = be(q[:, :, :18], k, v, AttnContext())
        (torch.cat([second, first], 2) * weight).sum().backward()
        return [q.grad, k.grad, v.grad]

    want = run(get_backend("eager"))
    try:
        got = run(get_backend(backend, **options))
    except BackendUnavailableError as e:
        pytest.skip(f"{backend} refuses this call here: {e}")
    for name, a, b in zip("qkv", got, want):
        assert (a - b).abs().max() <= 1e-5, name  # fp32 rounding: observed <= 5e-7
