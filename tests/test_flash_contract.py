"""fastzoo's calls into FlashAttention 2, 3 and 4, checked on CPU against stand-ins.

Each stand-in takes the place of one library's compiled entry points (``flash_attn``,
``flash_attn_interface``, ``flash_attn.cute``) and is no FlashAttention: it enforces the
preconditions that library's Python interface documents and checks (dtypes, head dims per GPU
generation, layouts, int32 contiguous ``cu_seqlens``, ``max_seqlen``, the ``window_size`` form,
what it returns) and computes the reference in fp32 on CPU, written out here independently of
fastzoo's masks (bottom-right causal, sliding window, softcap, GQA). fastzoo's output through it
must equal eager's, values and gradients. The kernels themselves run only on a GPU.
"""
import dataclasses
import sys
import types

import pytest
import torch

from fastzoo.attention import AttnContext, AttnRequest, backend_class, get_backend, register_attention
from fastzoo.attention import fa4 as fa4_module
from fastzoo.attention.base import HALF

TOL = 2e-3  # fp16 inputs and output, fp32 arithmetic inside: the output's rounding (2^-11 relative) on O(1) values


def reference(q, k, v, *, scale, causal, left, right, softcap):
    """[B, S, H, D] attention in fp32: causal bottom-right (query i is key position i + Sk - Sq),
    a window of ``left`` keys behind and ``right`` ahead (None: unbounded), GQA by head groups."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    Sq, Sk = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(Sq)[:, None] + (Sk - Sq)
    j = torch.arange(Sk)[None, :]
    allowed = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        right = 0
    if left is not None:
        allowed &= j >= pos - left
    if right is not None:
        allowed &= j <= pos + right
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


@dataclasses.dataclass
class Flavor:
    """What one library's interface takes and returns."""

    module: str
    head_dim_ok: object  # head_dim -> bool
    unbounded: object  # the window_size entry meaning "no bound": -1 (flash-attn 2/3) or None (FA4)
    dropout: bool
    returns_tuple: bool
    varlen_keywords: bool  # FA4: cu_seqlens_q=... by keyword; FA2/3: positional
    version: str | None = None


class StandIn:
    """Stands in for the compiled FlashAttention entry points of one ``Flavor`` (see module doc)."""

    def __init__(self, flavor: Flavor):
        self.flavor, self.calls = flavor, []

    def _check(self, q, k, v, window_size, dropout_p, softcap):
        f = self.flavor
        assert q.dtype in HALF and k.dtype == q.dtype == v.dtype, "q, k, v: fp16 or bf16, one dtype"
        assert f.head_dim_ok(q.shape[-1]), f"head dim {q.shape[-1]} is not supported"
        assert k.shape[-2] == v.shape[-2] and q.shape[-2] % k.shape[-2] == 0, "num_head divisible by num_head_kv"
        assert all(x.stride(-1) == 1 for x in (q, k, v)), "last dimension contiguous"
        assert isinstance(window_size, tuple) and len(window_size) == 2, "window_size=(left, right)"
        for w in window_size:
            assert w is f.unbounded or (isinstance(w, int) and w >= 0), f"window_size entries: int >= 0 or {f.unbounded!r}"
        assert f.dropout or dropout_p == 0, "no dropout"
        assert isinstance(softcap, float)
        bound = lambda w: None if w is f.unbounded else w  # noqa: E731
        return bound(window_size[0]), bound(window_size[1])

    def _out(self, out, q):
        out = out.to(q.dtype)
        return (out, None) if self.flavor.returns_tuple else out

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                        **unused):
        assert not unused, f"arguments fastzoo does not pass: {sorted(unused)}"
        window_size = window_size if window_size is not None else (self.flavor.unbounded,) * 2
        left, right = self._check(q, k, v, window_size, dropout_p, softcap)
        assert q.ndim == 4, "q: [B, S, H, D]"
        self.calls.append("dense")
        return self._out(reference(q, k, v, scale=softmax_scale, causal=causal, left=left, right=right, softcap=softcap), q)

    def flash_attn_varlen_func(self, q, k, v, *args, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None,
                               softcap=0.0, **kw):
        if self.flavor.varlen_keywords:
            assert not args, "FA4: cu_seqlens_q/k and max_seqlen_q/k by keyword"
            cu_q, cu_k, max_q, max_k = (kw.pop(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"))
        else:
            cu_q, cu_k, max_q, max_k = args
        assert not kw, f"arguments fastzoo does not pass: {sorted(kw)}"
        window_size = window_size if window_size is not None else (self.flavor.unbounded,) * 2
        left, right = self._check(q, k, v, window_size, dropout_p, softcap)
        assert q.ndim == 3, "q: [T, H, D]"
        for cu, total in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
            assert cu.dtype == torch.int32 and cu.ndim == 1 and cu.stride(0) == 1, "cu_seqlens: int32, contiguous, [N+1]"
            assert int(cu[0]) == 0 and int(cu[-1]) == total
        assert cu_q.numel() == cu_k.numel()
        assert isinstance(max_q, int) and isinstance(max_k, int), "max_seqlen: Python ints"
        assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
        self.calls.append("varlen")
        outs = [reference(q[a:b][None], k[c:d][None], v[c:d][None], scale=softmax_scale, causal=causal, left=left,
                          right=right, softcap=softcap)[0]
                for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())]
        return self._out(torch.cat(outs), q)


def fa4_head_dims(major):
    """flash_attn.cute.interface._validate_head_dims (4.0.0b36), 16-bit dtypes."""
    if major == 9:
        return lambda d: 8 <= d <= 256 and d % 8 == 0
    return lambda d: (8 <= d <= 128 or d == 256) and d % 8 == 0


FLAVORS = {
    "fa2": Flavor("flash_attn", lambda d: d <= 256, -1, dropout=True, returns_tuple=False, varlen_keywords=False,
                  version="2.7.4"),
    "fa3": Flavor("flash_attn_interface", lambda d: d <= 256 and d % 8 == 0, -1, dropout=False, returns_tuple=True,
                  varlen_keywords=False),
    "fa4": Flavor("flash_attn.cute", fa4_head_dims(10), None, dropout=False, returns_tuple=True, varlen_keywords=True),
}


@pytest.fixture(params=sorted(FLAVORS))
def on_stand_in(request, monkeypatch):
    """The backend, allowed on CPU, with its library replaced by the stand-in."""
    name = request.param
    flavor = FLAVORS[name]
    stand_in = StandIn(flavor)
    module = types.ModuleType(flavor.module)
    module.flash_attn_func, module.flash_attn_varlen_func = stand_in.flash_attn_func, stand_in.flash_attn_varlen_func
    module.__version__ = flavor.version or "0"
    parent = flavor.module.split(".")[0]
    if parent != flavor.module:
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, flavor.module, module)
    import fastzoo.attention as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    cls = backend_class(name)
    caps = dataclasses.replace(cls.capabilities, devices={"cpu": HALF}, backward=("cpu",), packages=(),
                               min_cuda_capability=None)
    register_attention(f"{name}_on_cpu", cls, capabilities=caps)
    return name, get_backend(f"{name}_on_cpu"), stand_in


CASES = {  # q/k shapes and context: the contract's forms the flash backends declare
    "dense": ((2, 4, 9, 16), (2, 4, 9, 16), dict(causal=False)),
    "causal": ((2, 4, 9, 16), (2, 4, 9, 16), dict(causal=True)),
    "kv_cache": ((2, 4, 3, 16), (2, 4, 9, 16), dict(causal=True)),
    "gqa": ((2, 4, 9, 16), (2, 2, 9, 16), dict(causal=True)),
    "window": ((2, 4, 9, 16), (2, 2, 9, 16), dict(causal=True, window=3)),
    "kv_cache_window": ((1, 4, 3, 16), (1, 4, 9, 16), dict(causal=True, window=4)),
    "packed": ((1, 4, 9, 16), (1, 2, 9, 16), dict(causal=True, cu_seqlens=[0, 4, 9], max_seqlen=5)),
    "packed_window": ((1, 4, 9, 16), (1, 4, 9, 16), dict(causal=True, cu_seqlens=[0, 4, 9], max_seqlen=5, window=2)),
    "packed_kv_cache": ((1, 4, 5, 16), (1, 4, 11, 16), dict(causal=True, cu_seqlens=[0, 2, 5], max_seqlen=3,
                                                             cu_seqlens_k=[0, 5, 11], max_seqlen_k=6)),
}


def _ctx(spec):
    spec = dict(spec)
    for key in ("cu_seqlens", "cu_seqlens_k"):
        if key in spec:
            spec[key] = torch.tensor(spec[key], dtype=torch.int32)
    return AttnContext(**spec)


@pytest.mark.parametrize("case", sorted(CASES))
def test_through_the_stand_in_equals_eager(on_stand_in, case):
    name, backend, stand_in = on_stand_in
    q_shape, k_shape, spec = CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=g).half().requires_grad_()
    k, v = (torch.randn(k_shape, generator=g).half().requires_grad_() for _ in range(2))
    ctx = _ctx(spec)
    out = backend(q, k, v, ctx)
    assert stand_in.calls == ["varlen" if "cu_seqlens" in spec else "dense"]  # the entry point the form needs
    G = q.shape[1] // k.shape[1]
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = get_backend("eager")(qf, kf.repeat_interleave(G, 1), vf.repeat_interleave(G, 1), ctx)
    assert out.dtype == q.dtype and (out.float() - ref).abs().max() <= TOL
    w = torch.randn(ref.shape, generator=g)
    got = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (qf, kf, vf))
    for a, b in zip(got, want):
        assert (a.float() - b).abs().max() <= 4 * TOL  # fp16 gradients: a few more roundings than the output


def test_fa4_softcap_reaches_the_kernel(monkeypatch):
    stand_in = StandIn(FLAVORS["fa4"])
    module = types.SimpleNamespace(flash_attn_func=stand_in.flash_attn_func, flash_attn_varlen_func=stand_in.flash_attn_varlen_func)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    g = torch.Generator().manual_seed(1)
    q_BSHD = (4 * torch.randn(1, 6, 2, 16, generator=g)).half()  # large scores: the cap bites
    out = get_backend("fa4", softcap=2.0).dense(q_BSHD, q_BSHD, q_BSHD, causal=True, scale=None, dropout_p=0.0)
    q_BHSD = q_BSHD.float().transpose(1, 2)
    ref = get_backend("eager", score_mod="softcap", softcap=2.0)(q_BHSD, q_BHSD, q_BHSD, AttnContext(causal=True))
    assert (out.float().transpose(1, 2) - ref).abs().max() <= TOL
    with pytest.raises(ValueError, match="softcap"):
        get_backend("fa4", softcap=-1.0)


@pytest.mark.parametrize("major", [9, 10])
def test_fa4_head_dims_declared_per_compute_capability(monkeypatch, major):
    """What fastzoo accepts at create is what FA4 takes on that GPU generation: every head dim
    from 1 to 300, on Hopper (sm90) and Blackwell (sm100)."""
    monkeypatch.setattr(fa4_module, "device_major", lambda: major)
    backend = get_backend("fa4")
    takes = fa4_head_dims(major)
    for d in range(1, 301):
        problems = [p for p in backend.problems(AttnRequest(head_dim=d, device="cuda", dtype=torch.bfloat16)) if "head dim" in p]
        assert (not problems) == takes(d), (d, problems)


def test_fa4_refuses_a_gpu_it_does_not_declare(monkeypatch):
    monkeypatch.setattr(fa4_module, "device_major", lambda: 8)
    problems = get_backend("fa4").problems(AttnRequest(head_dim=64, device="cuda", dtype=torch.bfloat16))
    assert any("Hopper (sm90) and Blackwell" in p for p in problems)


@pytest.mark.parametrize("name", ["fa3", "fa4"])
def test_no_dropout_reaches_kernels_without_it(name):
    req = AttnRequest(head_dim=64, device="cuda", dtype=torch.bfloat16, attn_dropout=0.1)
    assert any("no attention dropout" in p for p in get_backend(name).problems(req))
