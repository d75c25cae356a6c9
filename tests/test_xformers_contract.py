"""fastzoo's xFormers calls against the real ``xformers`` package, on CPU.

The package installs and imports on a CPU machine; its attention kernels need a GPU. So the
real bias classes fastzoo picks (``LowerTriangularMask``, ``LowerTriangularFromBottomRightMask``,
``BlockDiagonal(Causal)Mask``, ``BlockDiagonalCausalFromBottomRightMask``) are built by xFormers
itself and materialised by xFormers' own ``materialize``: only ``memory_efficient_attention``
is replaced, by a stand-in that checks the call's documented form (BMHK, one head count for
q/k/v, an ``AttentionBias`` or None) and computes ``softmax(q k^T * scale + bias) v`` in fp32.
fastzoo's output through it must equal eager's, values and gradients.
"""
import dataclasses

import pytest
import torch

from fastzoo.attention import AttnContext, backend_class, get_backend, register_attention
from fastzoo.attention.base import FLOATS

xformers_ops = pytest.importorskip("xformers.ops", reason="xformers is not installed (pip install -e '.[test]')")
from xformers.ops.fmha.attn_bias import AttentionBias  # noqa: E402

TOL = 1e-5  # fp32 CPU, same arithmetic up to summation order


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
    """Stands in for xformers.ops.memory_efficient_attention (no CPU kernel): checks the form
    fastzoo passes and computes the reference with xFormers' own bias materialisation."""
    assert query.ndim == 4 and key.ndim == 4 and value.ndim == 4, "BMHK"
    assert query.shape[2] == key.shape[2] == value.shape[2], "one head count (the BMHK form takes no GQA)"
    assert attn_bias is None or isinstance(attn_bias, AttentionBias), type(attn_bias)
    assert p == 0.0
    q, k, v = (x.float().transpose(1, 2) for x in (query, key, value))
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if attn_bias is not None:
        s = s + attn_bias.materialize(s.shape, dtype=torch.float32)
    return (s.softmax(-1) @ v).transpose(1, 2).to(query.dtype)


@pytest.fixture
def xformers_on_cpu(monkeypatch):
    monkeypatch.setattr(xformers_ops, "memory_efficient_attention", memory_efficient_attention)
    import fastzoo.attention as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    cls = backend_class("xformers")
    caps = dataclasses.replace(cls.capabilities, devices={"cpu": FLOATS}, backward=("cpu",), packages=(),
                               min_cuda_capability=None, kernels_loaded=None)  # the stand-in is the kernel
    register_attention("xformers_on_cpu", cls, capabilities=caps)
    return get_backend("xformers_on_cpu")


CASES = {
    "dense": ((2, 4, 7, 8), (2, 4, 7, 8), dict(causal=False)),
    "causal": ((2, 4, 7, 8), (2, 4, 7, 8), dict(causal=True)),
    "kv_cache": ((2, 4, 3, 8), (2, 4, 7, 8), dict(causal=True)),
    "gqa": ((2, 4, 7, 8), (2, 2, 7, 8), dict(causal=True)),
    "packed": ((1, 4, 9, 8), (1, 4, 9, 8), dict(causal=True, cu_seqlens=[0, 4, 9], max_seqlen=5)),
    "packed_noncausal": ((1, 4, 9, 8), (1, 4, 9, 8), dict(causal=False, cu_seqlens=[0, 4, 9], max_seqlen=5)),
    "packed_kv_cache": ((1, 4, 5, 8), (1, 4, 11, 8), dict(causal=True, cu_seqlens=[0, 2, 5], max_seqlen=3,
                                                          cu_seqlens_k=[0, 5, 11], max_seqlen_k=6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_xformers_bias_choice_equals_eager(xformers_on_cpu, case):
    q_shape, k_shape, spec = CASES[case]
    spec = {k: torch.tensor(v, dtype=torch.int32) if k.startswith("cu_") else v for k, v in spec.items()}
    ctx = AttnContext(**spec)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=g, requires_grad=True)
    k, v = (torch.randn(k_shape, generator=g, requires_grad=True) for _ in range(2))
    out = xformers_on_cpu(q, k, v, ctx)
    G = q.shape[1] // k.shape[1]
    ref = get_backend("eager")(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), ctx)
    assert (out - ref).abs().max() <= TOL
    w = torch.randn(ref.shape, generator=g)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        assert (a - b).abs().max() <= 1e-4  # fp32 backward: a few more roundings


def test_xformers_refuses_a_window_it_is_not_given(xformers_on_cpu):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(Exception, match="sliding-window"):
        xformers_on_cpu(q, q, q, AttnContext(causal=True, window=2))
