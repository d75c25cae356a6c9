"""Third-party attention adapters: fa2, fa3, te, xformers.

On a CPU machine these backends must refuse at ``create`` with the missing piece and the
install command; their declarations must refuse impossible requests; the library-independent
parts (padding <-> packing, routing, a padded GPT-2 batch unpadded by the model) are checked
against eager on CPU. Their numerical parity
runs only where the library and a GPU are present (skipped here, with the reason).
"""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fastzoo
from fastzoo.attention import _REGISTRY, AttnContext, AttnRequest, backend_class, get_backend
from fastzoo.attention.base import FP32, Capabilities
from fastzoo.attention.library import LibraryBackend
from fastzoo.attention.packing import repad, unpad
from fastzoo.errors import BackendUnavailableError
from conftest import TINY
from fastzoo.equivalence import check as check_parity

THIRD_PARTY = {  # backend -> (import name, words its install command contains)
    "fa2": ("flash_attn", "pip install flash-attn"),
    "fa3": ("flash_attn_interface", "flash-attention/hopper"),
    "te": ("transformer_engine", "transformer_engine[pytorch]"),
    "xformers": ("xformers", "pip install xformers"),
}
LIBRARY_MODULES = ("flash_attn", "flash_attn_interface", "transformer_engine", "xformers")


def _available(name):
    return backend_class(name).is_available()


# -- refusal on a machine that cannot run them ------------------------------------------------
@pytest.mark.parametrize("name", sorted(THIRD_PARTY))
def test_unavailable_backend_refuses_at_create_naming_package_and_install(name):
    if _available(name):
        pytest.skip(f"{name} is available here: the refusal cannot be shown")
    package, install = THIRD_PARTY[name]
    with pytest.raises(BackendUnavailableError) as e:
        fastzoo.create("vit_s16", attn=name, **TINY["vit"])
    msg = str(e.value)
    assert repr(name) in msg
    if not _package_installed(package):
        assert package in msg and install in msg
    elif not torch.cuda.is_available():
        assert "cuda" in msg
    assert "Available on this machine: " in msg and "eager" in msg


def test_xformers_without_its_compiled_kernels_is_unavailable_by_name():
    """xFormers imports when its wheel was built for another torch, then every call fails ("No operator
    found"): the backend is refused at create, naming the cause, not at the first forward."""
    from dataclasses import replace

    from fastzoo.attention.availability import unavailable
    from fastzoo.attention.xformers import XformersBackend

    xformers = pytest.importorskip("xformers", reason="xformers is not installed: its load check cannot be shown")
    on_cpu = replace(XformersBackend.capabilities, devices={"cpu": (torch.float32,)})  # past the device check
    reason = unavailable(on_cpu)
    if xformers._has_cpp_library:
        assert reason is None
    else:
        assert "xformers._has_cpp_library is false" in reason and torch.__version__ in reason


def _package_installed(package):
    from fastzoo.attention.base import package_available

    return package_available(package)


@pytest.mark.parametrize("name", sorted(THIRD_PARTY))
def test_capability_matrix_names_every_missing_piece(name):
    if _available(name):
        pytest.skip(f"{name} is available here")
    reason = backend_class(name).unavailable_reason()
    package, install = THIRD_PARTY[name]
    if not _package_installed(package):
        assert package in reason and install in reason
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in reason


def test_refusal_happens_before_any_forward():
    """create() fails in set_attention, so a model is never half-built with an unusable kernel."""
    if _available("fa2"):
        pytest.skip("fa2 is available here")
    model = fastzoo.create("vit_s16", attn="eager", **TINY["vit"])
    with pytest.raises(BackendUnavailableError):
        model.set_attention("fa2")
    assert model.attn_name == "eager"  # nothing changed


# -- declarations ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fa2", "fa3", "te"])
def test_half_precision_only_kernels_refuse_fp32(name):
    with pytest.raises(BackendUnavailableError, match="does not take fp32 on cuda"):
        get_backend(name).check(AttnRequest(head_dim=64, device="cuda", dtype=torch.float32))


def test_xformers_declares_fp32_on_cuda():
    caps = backend_class("xformers").capabilities
    assert FP32 in caps.devices["cuda"] and "cpu" not in caps.devices


@pytest.mark.parametrize("name,head_dim,words", [
    ("fa2", 512, "head dim <= 256"),
    ("fa3", 320, "head dim <= 256"),
    ("te", 12, "divisible by 8"),
])
def test_head_dim_limits(name, head_dim, words):
    with pytest.raises(BackendUnavailableError, match=words):
        get_backend(name).check(AttnRequest(head_dim=head_dim, device="cuda", dtype=torch.bfloat16))


def test_no_backend_runs_on_cpu_or_claims_more_than_its_library():
    for name in THIRD_PARTY:
        caps = backend_class(name).capabilities
        assert set(caps.devices) == {"cuda"} and caps.backward == ("cuda",)
        # no key-padding mask: the model unpads a padded batch once per forward (tested below)
        assert caps.varlen and not caps.padding_mask and caps.causal and not caps.score_mod
        assert caps.install and caps.packages
        assert caps.verified == "not verified on hardware" or "GPU" in caps.verified
    assert backend_class("fa3").capabilities.min_cuda_capability == (9, 0)  # Hopper
    assert backend_class("fa2").capabilities.min_cuda_capability == (8, 0)  # Ampere


def test_importing_fastzoo_and_the_adapters_imports_no_kernel_library():
    names = ", ".join(repr(n) for n in THIRD_PARTY)
    code = (
        "import sys, fastzoo\n"
        "from fastzoo.attention import backend_class\n"
        f"[backend_class(n) for n in ({names},)]\n"
        f"loaded = [m for m in {LIBRARY_MODULES!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_repo_root()))


def _repo_root():
    from pathlib import Path

    return Path(__file__).resolve().parents[1]


def test_fa3_refuses_dropout_before_calling_the_library():
    q_BSHD = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="no attention dropout"):
        get_backend("fa3").dense(q_BSHD, q_BSHD, q_BSHD, causal=False, scale=None, dropout_p=0.1)


# -- the library-independent parts, on CPU -----------------------------------------------------
def test_unpad_repad_round_trip_any_padding_pattern():
    mask_BS = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 0, 1, 0, 1]], dtype=torch.bool)
    x_BSHD = torch.randn(3, 5, 2, 4, requires_grad=True)
    info, (x_THD,) = unpad(mask_BS, x_BSHD)
    assert info.cu_seqlens.tolist() == [0, 3, 6, 9] and info.max_seqlen == 3
    assert info.cu_seqlens.dtype == torch.int32
    torch.testing.assert_close(x_THD, x_BSHD[mask_BS], rtol=0, atol=0)  # a gather: exact
    back = repad(x_THD, info)
    torch.testing.assert_close(back[mask_BS], x_BSHD[mask_BS], rtol=0, atol=0)
    assert (back[~mask_BS] == 0).all()
    back.sum().backward()
    assert torch.equal(x_BSHD.grad, mask_BS[:, :, None, None].expand_as(x_BSHD).float())


def test_unpad_rejects_a_non_bool_mask():
    with pytest.raises(ValueError, match="key_padding_mask"):
        unpad(torch.ones(2, 3), torch.randn(2, 3, 1, 4))


class _TorchKernel(LibraryBackend):
    """The two entry points a kernel library provides, written in plain PyTorch, to check the
    routing (packed, dense; padded batches unpadded by the model) that fa2/fa3/te/xformers
    share. It stands in for no library: the libraries' own parity is the GPU tests below."""

    name = "torch_kernel"
    capabilities = Capabilities(devices={"cpu": (FP32,)}, padding_mask=False, varlen=True)

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, dropout_p):
        q, k, v = (x.transpose(1, 2) for x in (q_BSHD, k_BSHD, v_BSHD))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(1, 2)

    def varlen(self, q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p, ctx=None,
               cu_seqlens_k=None, max_seqlen_k=None):
        # no kv_cache declared: the contract never hands this backend the keys' own offsets
        assert cu_seqlens_k is None and max_seqlen_k is None
        bounds = cu_seqlens.tolist()
        outs = [self.dense(*(x[a:b][None] for x in (q_THD, k_THD, v_THD)), causal=causal, scale=scale, dropout_p=0)[0]
                for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs)


@pytest.fixture
def torch_kernel():
    fastzoo.register_attention("torch_kernel", _TorchKernel)
    yield "torch_kernel"
    _REGISTRY.pop("torch_kernel", None)


def test_padded_gpt2_batch_is_unpadded_by_the_model_for_library_backends(torch_kernel):
    """fa2/fa3/te/xformers take no padding mask: GPT-2 packs the real tokens once per forward,
    so real tokens equal eager's and padding positions are zeros (left, right and no padding)."""
    torch.manual_seed(0)
    ref = fastzoo.create("gpt2", attn="eager", **TINY["gpt2"]).eval()
    ours = fastzoo.create("gpt2", attn=torch_kernel, **TINY["gpt2"]).eval()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 128, (3, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [0, 0] + [1] * 4], dtype=torch.bool)
    with torch.no_grad():
        out, expected = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    # fp32 CPU, same math in another order: fastzoo.equivalence's 1e-4 is ample (observed ~1e-6).
    assert (out - expected)[mask].abs().max() <= 1e-4
    assert (out[~mask] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_library_routing_packed_matches_eager(causal):
    H, D = 2, 8
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    q, k, v = (torch.randn(1, H, 12, D) for _ in range(3))
    ctx = AttnContext(causal=causal, cu_seqlens=cu, max_seqlen=5)
    ours = _TorchKernel()(q, k, v, ctx)
    ref = get_backend("eager")(q, k, v, ctx)
    assert (ours - ref).abs().max() <= 1e-4  # fp32 CPU, fastzoo.equivalence's tolerance


def test_library_backends_refuse_a_padding_mask_per_call():
    """A key-padding mask (alone or with packed sequences) never reaches the kernels."""
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(1, 4, dtype=torch.bool)
    for ctx in (AttnContext(key_padding_mask=mask),
                AttnContext(key_padding_mask=mask, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))):
        with pytest.raises(BackendUnavailableError, match="padding"):
            _TorchKernel()(q, q, q, ctx)


# -- numerical parity on a GPU -----------------------------------------------------------------
GPU_CASES = [(n, dt) for n in sorted(THIRD_PARTY) for dt in (torch.bfloat16, torch.float16)] + [("xformers", torch.float32)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", GPU_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in GPU_CASES])
def test_gpu_vit_parity(name, dtype):
    if backend_class(name).unavailable_reason() is not None:
        pytest.skip(f"{name} unavailable here: {backend_class(name).unavailable_reason()}")
    res = check_parity("vit_s16", name, device="cuda", dtype=dtype, overrides=TINY["vit"])
    assert res.passed, res.rows()  # rule: fastzoo.equivalence (fp32 1e-4 / 3x the eager error in this dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(THIRD_PARTY))
def test_gpu_gpt2_parity_padded_and_packed(name):
    if backend_class(name).unavailable_reason() is not None:
        pytest.skip(f"{name} unavailable here: {backend_class(name).unavailable_reason()}")
    res = check_parity("gpt2", name, device="cuda", dtype=torch.bfloat16, overrides=TINY["gpt2"])
    assert {c.name for c in res.comparisons} >= {"logits (padded)", "logits (packed)", "grads (padded)", "grads (packed)"}
    assert res.passed, res.rows()


@pytest.mark.gpu
@pytest.mark.parametrize("fn_name", ["fa2_varlen", "xformers_varlen"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_entry_points_match_eager(fn_name, causal):
    backend = "fa2" if fn_name == "fa2_varlen" else "xformers"
    if backend_class(backend).unavailable_reason() is not None:
        pytest.skip(f"{backend} unavailable here: {backend_class(backend).unavailable_reason()}")
    import importlib

    fn = getattr(importlib.import_module("fastzoo.attention.flash" if backend == "fa2" else "fastzoo.attention.xformers"), fn_name)
    cu = torch.tensor([0, 5, 17, 40], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(40, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = dict(causal=causal, scale=None, dropout_p=0.0)
    out = fn(q, k, v, cu, 23, **kw)
    ctx = AttnContext(causal=causal, cu_seqlens=cu, max_seqlen=23)
    ref = get_backend("eager")(*(x.float().transpose(0, 1)[None] for x in (q, k, v)), ctx)[0].transpose(0, 1)
    peer = get_backend("eager")(*(x.transpose(0, 1)[None] for x in (q, k, v)), ctx)[0].transpose(0, 1)
    # flash-attn's rule: within 3x the eager bf16 error (+ a small floor).
    assert (out.float() - ref).abs().max() <= 3 * (peer.float() - ref).abs().max() + 1e-5
