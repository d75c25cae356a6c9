"""fastzoo's calls into Transformer Engine and SDPA's cuDNN kernel, checked on CPU.

Neither runs without a GPU, so each is replaced by a stand-in that is no kernel: it enforces
the documented form of the call (TE's ``DotProductAttention``: ``qkv_format`` bshd / thd, the
``attn_mask_type`` names and their alignment, int32 ``cu_seqlens_q/kv`` with ``max_seqlen``,
fp16/bf16, head dims, contiguous inputs, one head count without ``num_gqa_groups``; cuDNN
SDPA: fp16/bf16, head dim <= 128, dropout in multiples of 1/16, at least two keys, no
``enable_gqa``) and computes the reference in fp32 on CPU. fastzoo's output through it must
equal eager's, values and gradients.
"""
import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from fastzoo.attention import AttnContext, backend_class, get_backend, register_attention
from fastzoo.attention.base import HALF

TOL = 2e-3  # fp16 inputs and output, fp32 arithmetic inside: the output's rounding on O(1) values
TE_MASKS = {"no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"}


def attend(q, k, v, scale, causal, bottom_right):
    """[S, H, D] one sequence in fp32; causal top-left or bottom-right."""
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))
    s = (q @ k.transpose(-2, -1)) * scale
    Sq, Sk = s.shape[-2:]
    if causal:
        offset = Sk - Sq if bottom_right else 0
        s = s.masked_fill(torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + offset, float("-inf"))
    return (s.softmax(-1).nan_to_num(0.0) @ v).transpose(0, 1)


class DotProductAttention(torch.nn.Module):
    """Stands in for transformer_engine.pytorch.DotProductAttention (see module doc)."""

    def __init__(self, num_attention_heads, kv_channels, attention_dropout=0.0, qkv_format="bshd",
                 attn_mask_type="causal", softmax_scale=None, num_gqa_groups=None):
        super().__init__()
        assert qkv_format in ("bshd", "sbhd", "thd") and attn_mask_type in TE_MASKS
        assert num_gqa_groups is None
        self.heads, self.head_dim = num_attention_heads, kv_channels
        self.scale = softmax_scale if softmax_scale is not None else kv_channels ** -0.5

    def forward(self, q, k, v, qkv_format, attn_mask_type, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                max_seqlen_kv=None):
        assert attn_mask_type in TE_MASKS, attn_mask_type
        assert q.dtype in HALF and k.dtype == v.dtype == q.dtype
        assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and q.shape[-1] == self.head_dim
        assert q.shape[-2] == k.shape[-2] == v.shape[-2] == self.heads, "one head count (no num_gqa_groups)"
        assert all(x.is_contiguous() for x in (q, k, v)), "TE infers the layout from strides: contiguous"
        causal = "causal" in attn_mask_type
        bottom_right = attn_mask_type.endswith("bottom_right")
        if qkv_format == "bshd":
            assert attn_mask_type in ("no_mask", "causal", "causal_bottom_right") and cu_seqlens_q is None
            out = torch.stack([attend(q[b], k[b], v[b], self.scale, causal, bottom_right) for b in range(q.shape[0])])
        else:
            assert qkv_format == "thd" and attn_mask_type.startswith("padding")
            for cu, total in ((cu_seqlens_q, q.shape[0]), (cu_seqlens_kv, k.shape[0])):
                assert cu.dtype == torch.int32 and cu.ndim == 1 and cu.is_contiguous() and int(cu[-1]) == total
            assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_kv, int)
            bq, bk = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
            out = torch.cat([attend(q[a:b], k[c:d], v[c:d], self.scale, causal, bottom_right)
                             for a, b, c, d in zip(bq[:-1], bq[1:], bk[:-1], bk[1:])])
        return out.to(q.dtype).flatten(-2)  # TE returns the heads flattened


@pytest.fixture
def te_on_cpu(monkeypatch):
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.DotProductAttention = DotProductAttention
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    import fastzoo.attention as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    cls = backend_class("te")
    register_attention("te_on_cpu", cls, capabilities=dataclasses.replace(
        cls.capabilities, devices={"cpu": HALF}, backward=("cpu",), packages=(), min_cuda_capability=None))
    return get_backend("te_on_cpu")


CASES = {
    "dense": ((2, 4, 7, 16), (2, 4, 7, 16), dict(causal=False)),
    "causal": ((2, 4, 7, 16), (2, 4, 7, 16), dict(causal=True)),
    "kv_cache": ((2, 4, 3, 16), (2, 4, 7, 16), dict(causal=True)),
    "gqa": ((2, 4, 7, 16), (2, 2, 7, 16), dict(causal=True)),
    "packed": ((1, 4, 9, 16), (1, 4, 9, 16), dict(causal=True, cu_seqlens=[0, 4, 9], max_seqlen=5)),
    "packed_noncausal": ((1, 4, 9, 16), (1, 4, 9, 16), dict(causal=False, cu_seqlens=[0, 4, 9], max_seqlen=5)),
    "packed_kv_cache": ((1, 4, 5, 16), (1, 4, 11, 16), dict(causal=True, cu_seqlens=[0, 2, 5], max_seqlen=3,
                                                            cu_seqlens_k=[0, 5, 11], max_seqlen_k=6)),
}


def _run_against_eager(backend, case, seed=0):
    q_shape, k_shape, spec = CASES[case]
    spec = {k: torch.tensor(v, dtype=torch.int32) if k.startswith("cu_") else v for k, v in spec.items()}
    ctx = AttnContext(**spec)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=g).half().requires_grad_()
    k, v = (torch.randn(k_shape, generator=g).half().requires_grad_() for _ in range(2))
    out = backend(q, k, v, ctx)
    G = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = get_backend("eager")(qf, kf.repeat_interleave(G, 1), vf.repeat_interleave(G, 1), ctx)
    assert out.dtype == q.dtype and (out.float() - ref).abs().max() <= TOL
    w = torch.randn(ref.shape, generator=g)
    for a, b in zip(torch.autograd.grad((out.float() * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (qf, kf, vf))):
        assert (a.float() - b).abs().max() <= 4 * TOL  # fp16 gradients: a few more roundings


@pytest.mark.parametrize("case", sorted(CASES))
def test_te_through_the_stand_in_equals_eager(te_on_cpu, case):
    _run_against_eager(te_on_cpu, case)


# -- SDPA's cuDNN kernel ----------------------------------------------------------------------------
def cudnn_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stands in for F.scaled_dot_product_attention pinned to cuDNN (see module doc)."""
    assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled(), "pinned to cuDNN"
    assert query.dtype in HALF and query.shape[-1] <= 128
    assert (dropout_p * 16).is_integer(), "cuDNN dropout: multiples of 1/16"
    assert key.shape[-2] >= 2, "cuDNN attention needs at least two keys"
    assert not enable_gqa and key.shape[1] == query.shape[1], "no enable_gqa"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return REAL_SDPA(query.float(), key.float(), value.float(), attn_mask=attn_mask, is_causal=is_causal,
                         scale=scale).to(query.dtype)


REAL_SDPA = F.scaled_dot_product_attention


@pytest.fixture
def cudnn_on_cpu(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", cudnn_sdpa)
    backend = get_backend("sdpa", sdpa_backend="cudnn")
    backend.capabilities = dataclasses.replace(backend.capabilities, devices={"cpu": HALF}, min_cuda_capability=None)
    return backend


@pytest.mark.parametrize("case", ["dense", "causal", "kv_cache", "gqa"])
def test_sdpa_cudnn_through_the_stand_in_equals_eager(cudnn_on_cpu, case):
    _run_against_eager(cudnn_on_cpu, case)
