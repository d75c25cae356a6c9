"""Backend declarations against what the kernels really take.

Each test states one rule a backend must follow so that an impossible request is refused
when the model is built, not deep inside a forward, and so that what a backend declares is
what the kernel it runs can do. Everything here runs on CPU: where a kernel needs a GPU,
the test exercises fastzoo's side of the documented library API (the arguments it passes,
the mode it sets), with a stand-in that follows the library's documented signature.
"""
import sys
import types

import pytest
import torch

import fastzoo
from fastzoo.attention import AttnContext, AttnRequest, get_backend, masks, varlen
from fastzoo.attention.varlen import packed_sdpa
from fastzoo.errors import BackendUnavailableError
from conftest import TINY

TOL = 1e-5  # fp32 CPU, one attention op on unit-variance inputs


def gpt2():
    return fastzoo.create("gpt2", attn="eager", **TINY["gpt2"])


def vit():
    return fastzoo.create("vit_s16", attn="eager", **TINY["vit"])


# -- the model's real needs are in its request ------------------------------------------------
def test_gpt2_request_says_it_takes_padding_masks():
    req = gpt2().attention_request()
    assert req.causal and req.padding_mask and req.unpads


def test_sdpa_flash_on_cuda_refuses_gpt2_at_build_naming_the_masks():
    """FlashAttention-2 inside SDPA takes no attn_mask: GPT-2's attention_mask / cu_seqlens
    would fail at the first padded forward with "No available kernel"."""
    req = gpt2().attention_request(device="cuda", dtype=torch.bfloat16)
    problems = get_backend("sdpa", sdpa_backend="flash").problems(req)
    assert any("key-padding masks" in p and "sdpa_backend='efficient'" in p for p in problems)


def test_sdpa_flash_on_cuda_refuses_a_kv_cache_request():
    req = AttnRequest(head_dim=64, causal=True, kv_cache=True, device="cuda", dtype=torch.bfloat16)
    assert any("KV cache" in p for p in get_backend("sdpa", sdpa_backend="flash").problems(req))
    assert not get_backend("sdpa").problems(req)  # automatic SDPA takes the explicit mask


def test_sdpa_flash_on_cuda_serves_vit_and_on_cpu_serves_gpt2():
    flash = get_backend("sdpa", sdpa_backend="flash")
    vit_req = vit().attention_request(device="cuda", dtype=torch.bfloat16)
    assert not [p for p in flash.problems(vit_req) if "attn_mask" in p]
    flash.check(gpt2().attention_request(device="cpu"))  # PyTorch's CPU flash kernel takes masks


def test_a_backend_without_padding_masks_or_varlen_refuses_gpt2():
    """neuron has neither, so GPT-2's padded batches have no path there."""
    problems = get_backend("neuron").problems(gpt2().attention_request(device="xla", dtype=torch.bfloat16))
    assert any("no key-padding mask" in p for p in problems)


@pytest.mark.parametrize("name", ["fa2", "te", "xformers", "varlen"])
def test_varlen_backends_serve_gpt2_padding_by_unpadding(name):
    req = gpt2().attention_request(device="cuda", dtype=torch.bfloat16)
    assert not [p for p in get_backend(name).problems(req) if "padding" in p or "packed" in p]


# -- FA3 ----------------------------------------------------------------------------------------
def test_fa3_needs_a_head_dim_multiple_of_8():
    fa3 = get_backend("fa3")
    assert any("divisible by 8" in p for p in fa3.problems(AttnRequest(head_dim=72 + 4, device="cuda", dtype=torch.bfloat16)))
    assert not any("divisible" in p for p in fa3.problems(AttnRequest(head_dim=72, device="cuda", dtype=torch.bfloat16)))


# -- Transformer Engine: training mode whenever a backward will run -----------------------------
@pytest.fixture
def te_stand_in(monkeypatch):
    """``transformer_engine.pytorch.DotProductAttention`` as documented: an nn.Module called
    with (q, k, v, qkv_format=..., attn_mask_type=..., ...) returning [B, S, H*D]. It records
    the module's mode at each call: TE's fused attention keeps the softmax statistics its
    backward needs only when ``self.training``."""
    modes = []

    class DotProductAttention(torch.nn.Module):
        def __init__(self, heads, head_dim, attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal", **kw):
            super().__init__()

        def forward(self, q, k, v, qkv_format, attn_mask_type, **kw):
            modes.append(self.training)
            return q.flatten(-2)  # the output has the queries' length

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.DotProductAttention = DotProductAttention
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    return modes


def test_te_runs_in_training_mode_when_a_backward_will_run_even_without_dropout(te_stand_in):
    backend = get_backend("te")
    q, k, v = (torch.randn(2, 5, 4, 8, requires_grad=True) for _ in range(3))
    backend.dense(q, k, v, causal=True, scale=None, dropout_p=0.0)
    with torch.no_grad():
        backend.dense(q, k, v, causal=True, scale=None, dropout_p=0.0)
    backend.dense(q.detach(), k.detach(), v.detach(), causal=True, scale=None, dropout_p=0.1)
    assert te_stand_in == [True, False, True]  # grad: train; inference: eval; dropout: train


# -- torch varlen_attn: the signature of each torch version --------------------------------------
def _varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's documented signature: no scale (1/sqrt(D)), causal by flag."""
    return packed_sdpa(query, key, value, cu_seq_q, max_q, causal=is_causal)


def _varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), **later):
    """torch >= 2.11: keyword-only scale and window_size ((-1, 0) is causal)."""
    assert window_size in ((-1, -1), (-1, 0))
    return packed_sdpa(query, key, value, cu_seq_q, max_q, causal=window_size == (-1, 0), scale=scale)


@pytest.mark.parametrize("takes_scale,stand_in", [(False, _varlen_attn_2_10), (True, _varlen_attn_2_11)])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_varlen_call_fits_each_versions_signature_with_a_custom_scale(monkeypatch, takes_scale, stand_in, causal):
    import torch.nn.attention.varlen as torch_varlen

    monkeypatch.setattr(torch_varlen, "varlen_attn", stand_in)
    monkeypatch.setattr(varlen, "VARLEN_TAKES_SCALE", takes_scale)
    q, k, v = (torch.randn(9, 3, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = varlen._torch_varlen(q, k, v, cu, 5, causal=causal, scale=0.3, dropout_p=0.0)
    ref = packed_sdpa(q, k, v, cu, 5, causal=causal, scale=0.3)
    assert (out - ref).abs().max() <= TOL


def test_installed_torch_takes_the_branch_its_signature_has():
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    assert ("scale" in inspect.signature(varlen_attn).parameters) == varlen.VARLEN_TAKES_SCALE


# -- varlen impl=None declares what its impls serve here, and one impl must serve it all -------
def test_automatic_varlen_declares_only_the_devices_this_machine_has_impls_for():
    caps = get_backend("varlen").capabilities
    if not torch.cuda.is_available():
        assert set(caps.devices) == {"cpu"}
    assert "cpu" in caps.devices and caps.dropout  # the cpu impl: exact SDPA per sequence, with dropout


@pytest.fixture
def gpu_machine_without_flash_or_xformers(monkeypatch):
    """The automatic choice on a CUDA machine where only torch's varlen_attn and flex exist."""
    monkeypatch.setattr(varlen, "device_present", lambda device: device in ("cpu", "cuda"))
    present = {"cpu": ["cpu"], "cuda": ["torch", "flex"]}
    monkeypatch.setattr(varlen, "_present_impls", lambda device: present.get(device, []))
    monkeypatch.setattr(varlen, "unavailable", lambda caps: None)
    varlen._auto_capabilities.cache_clear()
    yield
    varlen._auto_capabilities.cache_clear()


def test_automatic_varlen_refuses_cuda_fp32_with_dropout_no_single_impl_serves(gpu_machine_without_flash_or_xformers):
    backend = get_backend("varlen")
    assert backend.capabilities.dropout  # the cpu impl has dropout: the union alone would accept
    req = AttnRequest(head_dim=64, device="cuda", dtype=torch.float32, attn_dropout=0.1)
    problems = backend.problems(req)
    assert any("no single kernel on cuda" in p and "impl='torch'" in p and "impl='flex'" in p for p in problems)
    assert not backend.problems(AttnRequest(head_dim=64, device="cuda", dtype=torch.bfloat16))  # torch's kernel


# -- masks built on q's device ------------------------------------------------------------------
def test_document_mask_is_built_on_the_device_it_is_evaluated_on():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)  # offsets on the CPU, q elsewhere
    mod = masks.document(cu, 5, device="meta")
    assert masks.dense_mask(mod, 1, 1, 5, 5, "meta").device.type == "meta"
    ctx = AttnContext(causal=True, cu_seqlens=cu, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    assert masks.dense_mask(masks.context_mask_mod(ctx, 5, device="meta"), 1, 1, 5, 5, "meta").device.type == "meta"


# -- FlexAttention compiled on CPU ----------------------------------------------------------------
def test_flex_compile_true_on_cpu_is_refused_at_create():
    with pytest.raises(BackendUnavailableError, match="compiled FlexAttention on CPU is refused"):
        fastzoo.create("vit_s16", attn="flex", attn_options={"compile": True}, **TINY["vit"])


def test_a_model_with_flex_under_torch_compile_on_cpu_is_refused_at_the_forward():
    model = fastzoo.create("vit_s16", attn="flex", **TINY["vit"]).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")  # dynamo alone decides: no C++ compile needed to refuse
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), pytest.raises(BackendUnavailableError, match="compiled FlexAttention on CPU is refused"):
        compiled(x)
    with torch.no_grad():  # uncompiled flex on CPU stays available and exact
        ref = fastzoo.create("vit_s16", attn="eager", **TINY["vit"]).eval()
        ref.load_state_dict(model.state_dict())
        assert (model(x) - ref(x)).abs().max() <= 1e-4  # fp32 CPU, whole tiny ViT


def test_capability_matrix_says_compiled_flex_on_cpu_is_refused():
    from fastzoo.attention import capability_matrix

    row = next(r for r in capability_matrix() if r["backend"] == "flex")
    assert "compiled on CPU refused" in row["verified"]


# -- causal alignment: bottom-right with fewer queries than keys (KV cache) ----------------------
@pytest.mark.parametrize("name,kv_cache", [("fa2", True), ("fa3", True), ("te", True), ("xformers", True),
                                           ("nested", True), ("varlen", True), ("neuron", False)])
def test_kv_cache_is_declared_where_the_library_has_a_bottom_right_causal(name, kv_cache):
    assert get_backend(name).capabilities.kv_cache is kv_cache


def test_te_asks_for_its_bottom_right_causal_mask_with_a_kv_cache(te_stand_in, monkeypatch):
    from fastzoo.attention import te

    types_seen = []
    original = te._dense_mask_type
    monkeypatch.setattr(te, "_dense_mask_type", lambda *a: types_seen.append(original(*a)) or types_seen[-1])
    backend = get_backend("te")
    q, kv = torch.randn(2, 1, 4, 8), torch.randn(2, 6, 4, 8)
    backend.dense(q, kv, kv, causal=True, scale=None, dropout_p=0.0)
    backend.dense(kv, kv, kv, causal=True, scale=None, dropout_p=0.0)
    backend.dense(q, kv, kv, causal=False, scale=None, dropout_p=0.0)
    assert types_seen == ["causal_bottom_right", "causal", "no_mask"]


def test_xformers_gets_its_bottom_right_mask_with_a_kv_cache(monkeypatch):
    """xFormers' documented bias classes (xformers.ops.fmha.attn_bias): LowerTriangularMask is
    top-left; LowerTriangularFromBottomRightMask is the KV-cache form."""
    from fastzoo.attention.xformers import causal_bias

    attn_bias = types.ModuleType("xformers.ops.fmha.attn_bias")
    attn_bias.LowerTriangularMask = type("LowerTriangularMask", (), {})
    attn_bias.LowerTriangularFromBottomRightMask = type("LowerTriangularFromBottomRightMask", (), {})
    fmha = types.ModuleType("xformers.ops.fmha")
    fmha.attn_bias = attn_bias
    for name, mod in (("xformers", types.ModuleType("xformers")), ("xformers.ops", types.ModuleType("xformers.ops")),
                      ("xformers.ops.fmha", fmha), ("xformers.ops.fmha.attn_bias", attn_bias)):
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["xformers.ops"].fmha = fmha
    assert type(causal_bias(True, 1, 6)).__name__ == "LowerTriangularFromBottomRightMask"
    assert type(causal_bias(True, 6, 6)).__name__ == "LowerTriangularMask"
    assert causal_bias(False, 1, 6) is None


def test_flash_attn_before_2_1_is_refused_for_a_kv_cache(monkeypatch):
    """flash-attn 2.0 aligned causal top-left: fastzoo refuses it rather than answer differently."""
    from fastzoo.attention.flash import _check_bottom_right

    old = types.ModuleType("flash_attn")
    old.__version__ = "2.0.9"
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    q, kv = torch.randn(2, 1, 4, 8), torch.randn(2, 6, 4, 8)
    with pytest.raises(ValueError, match="bottom-right"):
        _check_bottom_right("flash_attn", q, kv, causal=True)
    _check_bottom_right("flash_attn", kv, kv, causal=True)  # equal lengths: both alignments agree
    old.__version__ = "2.6.3"
    _check_bottom_right("flash_attn", q, kv, causal=True)


def test_capability_matrix_has_a_row_per_pinned_kernel_and_varlen_impl():
    from fastzoo.attention import capability_matrix

    rows = {r["backend"]: r for r in capability_matrix()}
    assert rows["sdpa (sdpa_backend=cudnn)"]["devices: dtypes"] == "cuda: bf16/fp16"
    assert rows["varlen (impl=torch)"]["dropout"] == "no"
    # every varlen kernel takes the keys' own offsets (cu_seqlens_k), causal bottom-right per sequence
    assert all(rows[f"varlen (impl={i})"]["kv cache"] == "yes" for i in ("torch", "flash", "xformers", "flex", "cpu"))
    assert "no attn_mask" in rows["sdpa (sdpa_backend=flash)"]["verified"]


# -- on a GPU (skipped here with the reason; run by benchmarks/gpu_suite.sh tests) -------------------
def _cuda_backend(name, **options):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; this machine has none")
    backend = get_backend(name, **options)
    reason = backend.unavailable_reason() if not options else None
    if reason:
        pytest.skip(f"{name} unavailable here: {reason}")
    return backend


def _within_flash_rule(out, q, k, v, ctx):
    """flash-attn's rule: within 3x the eager model's own error in the same dtype (+ a floor)."""
    eager = get_backend("eager")
    ref = eager(q.float(), k.float(), v.float(), ctx)
    peer = eager(q, k, v, ctx).float()
    return (out.float() - ref).abs().max() <= 3 * (peer - ref).abs().max() + 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fa2", "fa3", "te", "xformers"])
@pytest.mark.parametrize("Sq", [1, 3])
def test_gpu_kv_cache_is_bottom_right_like_eager(name, Sq):
    backend = _cuda_backend(name)
    q = torch.randn(2, 4, Sq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 9, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        out = backend(q, k, v, AttnContext(causal=True))
    assert _within_flash_rule(out, q, k, v, AttnContext(causal=True))


@pytest.mark.gpu
def test_gpu_te_backward_runs_without_dropout():
    backend = _cuda_backend("te")
    q, k, v = (torch.randn(2, 4, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    backend(q, k, v, AttnContext(causal=True)).float().square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.gpu
def test_gpu_sdpa_flash_refuses_a_padding_mask_per_call():
    backend = _cuda_backend("sdpa", sdpa_backend="flash")
    q = torch.randn(2, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
    ctx = AttnContext(causal=True, key_padding_mask=torch.ones(2, 8, dtype=torch.bool, device="cuda"))
    with pytest.raises(BackendUnavailableError, match="takes no attn_mask"):
        backend(q, q, q, ctx)
    with pytest.raises(BackendUnavailableError, match="KV cache"):  # Sq < Sk causal: a bottom-right mask
        backend(q[:, :, :1], q, q, AttnContext(causal=True))


@pytest.mark.gpu
def test_gpu_varlen_torch_impl_takes_a_custom_scale():
    backend = _cuda_backend("varlen", impl="torch")
    if varlen.unavailable(backend.capabilities):
        pytest.skip(f"varlen impl='torch' unavailable here: {varlen.unavailable(backend.capabilities)}")
    q, k, v = (torch.randn(1, 4, 20, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ctx = AttnContext(causal=True, cu_seqlens=torch.tensor([0, 7, 20], dtype=torch.int32, device="cuda"), max_seqlen=13,
                      scale=0.05)
    with torch.no_grad():
        assert _within_flash_rule(backend(q, k, v, ctx), q, k, v, ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sdpa", "flex", "eager"])
def test_gpu_packed_offsets_on_the_cpu_with_queries_on_the_gpu(name):
    backend = _cuda_backend(name)
    q, k, v = (torch.randn(1, 4, 20, 64, device="cuda") for _ in range(3))
    cu_cpu = torch.tensor([0, 7, 20], dtype=torch.int32)
    with torch.no_grad():
        out = backend(q, k, v, AttnContext(causal=True, cu_seqlens=cu_cpu, max_seqlen=13))
        ref = get_backend("eager")(q.cpu(), k.cpu(), v.cpu(), AttnContext(causal=True, cu_seqlens=cu_cpu, max_seqlen=13))
    assert (out.cpu() - ref).abs().max() <= 1e-4  # fp32, TF32 off by default for SDPA math/flex


@pytest.mark.gpu
def test_gpu_explain_names_the_cuda_flash_kernel():
    from fastzoo.kernel_report import explain

    _cuda_backend("sdpa")
    model = fastzoo.create("vit_s16", attn="sdpa", attn_options={"sdpa_backend": "flash"}, device="cuda",
                           dtype=torch.bfloat16, **TINY["vit"]).eval()
    report = explain(model, torch.randn(2, 3, 32, 32, device="cuda", dtype=torch.bfloat16))
    assert all(r.executed == ["aten::_scaled_dot_product_flash_attention"] for r in report.rows)
    assert all(r.device_kernels for r in report.rows)  # the CUDA kernels those ops launched
