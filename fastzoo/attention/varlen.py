"""``varlen``: packed sequences (``ctx.cu_seqlens``) attended without a [T, T] mask.

The queries of a packed row ``[1, H, T, D]`` are handed to a kernel as ``q_THD`` with the
int32 offsets ``cu_seqlens``; each sequence attends only inside its own span. ``impl=``
picks the kernel, or ``None`` picks per call the first that fits the tensors:

- ``"torch"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16, torch >= 2.10); no
  dropout. Its signature changed: torch 2.10 takes ``is_causal`` and no ``scale``; from 2.11
  it takes keyword-only ``scale`` and ``window_size`` (causal is ``(-1, 0)``). Chosen once by
  the torch version, not by inspecting the signature per call.
- ``"flash"``: FlashAttention-2 ``flash_attn_varlen_func`` (through ``fastzoo.attention.flash``).
- ``"xformers"``: xFormers with a block-diagonal (causal) mask (through ``fastzoo.attention.xformers``).
- ``"flex"``: FlexAttention with a document mask (the ``flex`` backend); no dropout, and
  on CPU no backward. One attention over the whole packed row: a non-finite value (a NaN
  pixel, an overflow) in one sequence's keys or values reaches the others as 0 x NaN, where
  every other impl reads each sequence alone (``fastzoo.attention.packing``).
- ``"cpu"``: :func:`packed_sdpa`: exact, trains on CPU (soft-capped scores too).

Order tried on CUDA: torch, flash, xformers, flex. On CPU: cpu. With ``impl=None`` the
backend declares what the impls present on this machine serve, and a model's request is
checked against each impl in turn: it is accepted only if one single impl serves all of it
(CUDA fp32 with dropout needs xformers, for instance). A plain ``[B, S]`` call
without ``cu_seqlens`` is treated as B sequences of S tokens (of Sq queries and Sk keys with
a KV cache). Padding masks are not taken: a model unpads a padded batch into a packed one
before calling this backend.

KV cache: with ``ctx.cu_seqlens_k`` the keys have their own offsets, and every impl takes
them (``varlen_attn``'s ``cu_seq_k``, ``flash_attn_varlen_func``'s ``cu_seqlens_k``, xFormers'
``BlockDiagonalCausalFromBottomRightMask``, flex's document mask, the cpu impl's per-sequence
bottom-right mask); causal is bottom-right aligned per sequence. Only the cpu and flex impls
have been run here (CPU fp32); the CUDA ones are not verified on hardware.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import torch
import torch.nn.functional as F

from fastzoo.attention import masks, packing
from fastzoo.attention.availability import device_present, unavailable
from fastzoo.attention.base import FLOATS, HALF, AttentionBackend, Capabilities, KernelProfile, capability_problems, repeat_kv
from fastzoo.attention.flash import Fa2Backend, fa2_varlen
from fastzoo.attention.sdpa import sdpa
from fastzoo.attention.xformers import XformersBackend, xformers_varlen
from fastzoo.errors import BackendUnavailableError
from fastzoo.tracing import tracing

TORCH_VERSION = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
# torch 2.10: varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
# torch >= 2.11: varlen_attn(..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1), ...)
VARLEN_TAKES_SCALE = TORCH_VERSION >= (2, 11)

_BASE = Capabilities(
    devices={"cpu": FLOATS, "cuda": FLOATS}, padding_mask=False, varlen=True, kv_cache=True, gqa=True, window=True,
    verified="CPU fp32: cpu impl (torch 2.14.1)",
)
_CAPS = {
    None: _BASE,  # an instance with impl=None declares _auto_capabilities(): what this machine's impls serve
    "torch": dataclasses.replace(
        _BASE, devices={"cuda": HALF}, dropout=False, backward=("cuda",), max_head_dim=256, min_cuda_capability=(8, 0),
        head_dim_multiple=8,  # aten's FlashAttention-2 varlen entry: head dim a multiple of 8 (it does not pad)
        gqa=False, window=VARLEN_TAKES_SCALE,  # window_size from torch 2.11
        packages=("torch.nn.attention.varlen",), install="pip install 'torch>=2.11'",
        verified="H100 (torch 2.11): GPT-2 and ViT-B/16 bf16/fp16",
        # kv_cache: causal runs aten's FlashAttention-2 kernel (never cuDNN: torch routes window_size != (-1, -1)
        # away from it), which aligns causal bottom-right per sequence when cu_seq_k holds more keys
    ),
    # the same kernels as the fa2 / xformers backends: one declaration
    "flash": Fa2Backend.capabilities,
    "xformers": XformersBackend.capabilities,
    "flex": dataclasses.replace(_BASE, dropout=False, backward=("cuda",), softcap=True,
                                verified="CPU fp32 inference (torch 2.14.1)"),
    "cpu": dataclasses.replace(_BASE, devices={"cpu": FLOATS}, backward=("cpu",), softcap=True),
}
_ORDER = {"cpu": ("cpu",), "cuda": ("torch", "flash", "xformers", "flex")}  # impl=None: first that fits


def _present_impls(device: str) -> list[str]:
    """The impls tried on ``device`` that can run on this machine."""
    if not device_present(device):
        return []
    return [i for i in _ORDER[device] if device in _CAPS[i].devices and unavailable(_CAPS[i]) is None]


@functools.lru_cache(maxsize=None)
def _auto_capabilities() -> Capabilities:
    """What ``impl=None`` serves here: per device, the dtypes of the impls present; a feature
    (dropout, backward on a device) if one of them has it. A request is then checked against
    the impls one by one (:meth:`VarlenBackend.problems`), since no single impl may have all."""
    present = {dev: _present_impls(dev) for dev in _ORDER}
    caps = [_CAPS[i] for impls in present.values() for i in impls]
    devices = {dev: tuple(d for d in FLOATS if any(d in _CAPS[i].devices[dev] for i in impls))
               for dev, impls in present.items() if impls}
    heads = [c.max_head_dim for c in caps]
    return dataclasses.replace(
        _BASE,
        devices=devices,
        dropout=any(c.dropout for c in caps),
        kv_cache=any(c.kv_cache for c in caps),
        window=any(c.window for c in caps),
        softcap=any(c.softcap for c in caps),
        backward=tuple(dev for dev, impls in present.items() if any(dev in _CAPS[i].backward for i in impls)),
        compile=all(c.compile for c in caps),
        max_head_dim=None if None in heads else max(heads),
        verified="; ".join(f"{dev}: {'/'.join(impls)}" for dev, impls in present.items() if impls) + " (impls present here); "
                 + _BASE.verified,
    )


def _slots(cu_seqlens, T: int, L: int):
    """Where each packed token goes in ``[N, L]`` slots, and each sequence's length."""
    doc_T = masks.document_ids(cu_seqlens, T)
    slot_T = doc_T * L + torch.arange(T, device=cu_seqlens.device) - cu_seqlens.long()[doc_T]
    return slot_T, (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def packed_sdpa(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen: int, *, causal: bool, scale=None, dropout_p=0.0, ctx=None,
                cu_seqlens_k=None, max_seqlen_k=None, window=None, softcap=None):
    """Exact varlen attention with dense SDPA, the CPU kernel.

    ``cu_seqlens_k`` / ``max_seqlen_k``: the keys' offsets when they differ from the queries'
    (a KV cache; causal is then bottom-right aligned per sequence, see
    ``fastzoo.attention.base``); None: the queries'. ``window``: the sliding window (causal).
    Grouped-query k/v (fewer heads) go to SDPA as they are (``enable_gqa``). ``softcap``: the
    scores are soft-capped, which SDPA cannot do: SDPA's math written out (:func:`_sdpa`).

    Eager: one SDPA call per sequence, costing sum(len^2) (on CPU reading the offsets costs
    no device sync). While compiling, the per-sequence loop cannot be traced into one graph,
    so the sequences are scattered into ``[N, max_seqlen]`` slots for one SDPA call
    (N * max_seqlen^2) with a mask of each sequence's keys; padding queries are dropped.
    """
    kv = (cu_seqlens, max_seqlen) if cu_seqlens_k is None else (cu_seqlens_k, max_seqlen_k)
    gqa = k_THD.shape[1] != q_THD.shape[1]
    if tracing():
        return _slot_sdpa(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *kv, causal=causal, scale=scale,
                          dropout_p=dropout_p, ctx=ctx, window=window, softcap=softcap)
    def build():
        bounds_q = sequence_bounds(cu_seqlens)
        return bounds_q, bounds_q if kv[0] is cu_seqlens else sequence_bounds(kv[0])

    key = ("packed_sdpa_bounds", cu_seqlens.data_ptr(), kv[0].data_ptr())
    bounds_q, bounds_k = build() if ctx is None else ctx.cached(key, build)
    outs = []
    for qs, qe, ks, ke in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        q_HLD = q_THD[qs:qe].transpose(0, 1)
        k_HLD, v_HLD = (x[ks:ke].transpose(0, 1) for x in (k_THD, v_THD))
        Lq, Lk = qe - qs, ke - ks
        # SDPA's is_causal is top-left: with fewer queries than keys, or a window, the mask is explicit
        # (one query, the last position, sees every key: no mask)
        explicit = causal and (window is not None and Lk > 1 or Lq != Lk and Lq > 1 or softcap is not None)
        mask = masks.dense_mask(masks.causal_window(Lk - Lq, window), 1, 1, Lq, Lk, q_THD.device)[0] if explicit else None
        o_HLD = _sdpa(q_HLD, k_HLD, v_HLD, attn_mask=mask, dropout_p=dropout_p,
                      is_causal=causal and not explicit and Lq == Lk, scale=scale, enable_gqa=gqa, softcap=softcap)
        outs.append(o_HLD.transpose(0, 1))
    return torch.cat(outs) if outs else q_THD.new_zeros(q_THD.shape[:-1] + v_THD.shape[-1:])


def _sdpa(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap):
    """:func:`fastzoo.attention.sdpa.sdpa`, or with ``softcap`` its math written out with the scores
    capped (``softcap * tanh(score / softcap)``) before the mask, as the eager reference does."""
    if softcap is None:
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
    if enable_gqa:
        groups = q.shape[-3] // k.shape[-3]
        k, v = (x.repeat_interleave(groups, dim=-3) for x in (k, v))
    scores = masks.cap_scores((q * (scale if scale is not None else q.shape[-1] ** -0.5)) @ k.transpose(-2, -1), softcap)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    probs = scores.softmax(-1)
    probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return probs @ v


def sequence_bounds(cu_seqlens) -> list[int]:
    """The offsets as Python ints; on CPU memory, so no device sync (read once per forward)."""
    return cu_seqlens.tolist()


def _slot_sdpa(q_THD, k_THD, v_THD, cu_q, max_q: int, cu_k, max_k: int, *, causal: bool, scale, dropout_p, ctx, window,
               softcap=None):
    Tq, H, _ = q_THD.shape
    Tk = k_THD.shape[0]
    N, Lq, Lk = cu_q.numel() - 1, int(max_q), int(max_k)

    def build():
        slot_q, len_q = _slots(cu_q, Tq, Lq)
        slot_k, len_k = (slot_q, len_q) if cu_k is cu_q else _slots(cu_k, Tk, Lk)
        # key j of sequence n is real below len_k[n]; causal: query i is key position i + len_k - len_q
        real = lambda b, h, q_idx, kv_idx: kv_idx < len_k.view(N, 1, 1, 1)  # noqa: E731
        seen = masks.and_masks(real, masks.causal_window((len_k - len_q).view(N, 1, 1, 1), window) if causal else None)
        return slot_q, slot_k, masks.dense_mask(seen, N, 1, Lq, Lk, cu_q.device)

    slot_q, slot_k, allowed = build() if ctx is None else ctx.cached(
        ("packed_sdpa_slots", Tq, Tk, Lq, Lk, causal, window), build)

    def to_slots(x_THD, slot_T, L):
        return x_THD.new_zeros(N * L, x_THD.shape[1], x_THD.shape[-1]).index_copy(0, slot_T, x_THD).view(
            N, L, x_THD.shape[1], -1).transpose(1, 2)

    o_NHLD = _sdpa(
        to_slots(q_THD, slot_q, Lq), to_slots(k_THD, slot_k, Lk), to_slots(v_THD, slot_k, Lk),
        attn_mask=allowed.to(q_THD.device), dropout_p=dropout_p, is_causal=False, scale=scale,
        enable_gqa=k_THD.shape[1] != H, softcap=softcap,
    )
    return o_NHLD.transpose(1, 2).reshape(N * Lq, H, -1)[slot_q]


def _torch_varlen(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p, ctx=None,
                  cu_seqlens_k=None, max_seqlen_k=None, window=None):
    from torch.nn.attention.varlen import varlen_attn

    kv = (cu_seqlens, max_seqlen) if cu_seqlens_k is None else (cu_seqlens_k, max_seqlen_k)
    args = (cu_seqlens, kv[0], max_seqlen, kv[1])
    if VARLEN_TAKES_SCALE:
        window_size = masks.flash_window_size(window) if window is not None else (-1, 0) if causal else (-1, -1)
        return varlen_attn(q_THD, k_THD, v_THD, *args, scale=scale, window_size=window_size)
    if scale is not None:  # 2.10 applies 1/sqrt(D): fold the ratio into q (exact up to one rounding)
        q_THD = q_THD * (scale * q_THD.shape[-1] ** 0.5)
    return varlen_attn(q_THD, k_THD, v_THD, *args, is_causal=causal)


# [T, H, D] kernels with one signature (``ctx``: the call's context, for per-forward caches;
# ``cu_seqlens_k``/``max_seqlen_k``: the keys' offsets, None for self-attention); flash and
# xformers import their library inside the call
_KERNELS = {"torch": _torch_varlen, "flash": fa2_varlen, "xformers": xformers_varlen, "cpu": packed_sdpa}


# how each impl shows in a profiler trace
_IMPL_OPS = {
    "torch": r"::_flash_attention_\w+|varlen_attn",
    "flash": Fa2Backend.kernel_ops,
    "xformers": XformersBackend.kernel_ops,
    "flex": r"FlexAttention|flex_attention|triton_tem",  # FlexBackend.kernel_ops (flex is imported on first use)
    "cpu": r"^aten::_scaled_dot_product",
}


class VarlenBackend(AttentionBackend):
    name = "varlen"
    description = "packed sequences via cu_seqlens (impl= torch|flash|xformers|flex|cpu; default: best here)"
    capabilities = _BASE
    options = {"impl": None}
    variants = tuple({"impl": k} for k in _CAPS if k)
    kernel_ops = "|".join(_IMPL_OPS.values())

    def kernel_profile(self, q, k, ctx):
        asked = self.opts["impl"]
        impl = self.pick(q, k, ctx)
        words = f"{self.label()}: impl={asked or f'best here -> {impl}'}"
        if impl == "cpu" and ctx.softcap is not None:  # SDPA cannot cap the scores: its math in plain ops
            return KernelProfile(words + ": soft-capped matmul-softmax-matmul per sequence", None,
                                 missing="a fused SDPA kernel ran instead")
        return KernelProfile(words + (": dense SDPA per sequence" if impl == "cpu" else ""), _IMPL_OPS[impl])

    def __init__(self, **options):
        super().__init__(**options)
        impl = self.opts["impl"]
        if impl not in _CAPS:
            raise ValueError(f"impl={impl!r}: choose one of {', '.join(k for k in _CAPS if k)} (or None for the best available)")
        self.capabilities = _CAPS[impl] if impl is not None else _auto_capabilities()
        self._flex = None

    def check(self, req):
        impl = self.opts["impl"]
        reason = unavailable(self.capabilities) if impl else None
        if reason:  # named with the impl: "impl='flash' needs flash_attn" says more than "needs flash_attn"
            raise BackendUnavailableError(self._message([f"impl={impl!r} {reason}"]))
        super().check(req)

    def problems(self, req):
        problems = super().problems(req)
        if self.opts["impl"] is not None or problems or req.device not in self.capabilities.devices:
            return problems
        # impl=None: the request must fit one impl whole, not a feature from each
        why = {i: capability_problems(_CAPS[i], req) for i in _present_impls(req.device)}
        if all(why.values()):
            reasons = "; ".join(f"impl={i!r} {' and '.join(p)}" for i, p in why.items())
            problems.append(f"has no single kernel on {req.device} serving this model ({reasons})")
        return problems

    def pick(self, q, k, ctx) -> str:
        """The impl this call runs: the forced one, else the first present that serves the call
        (the capability rule on the call's request; check_call has refused a call none serves)."""
        impl = self.opts["impl"]
        if impl is not None:
            return impl
        req = self.call_request(q, k, ctx)
        for impl in _present_impls(q.device.type):
            if not capability_problems(_CAPS[impl], req):
                return impl
        raise BackendUnavailableError(self._message([f"no varlen kernel here fits {q.dtype} on {q.device.type}"]))

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        impl = self.pick(q_BHSD, k_BHSD, ctx)
        if impl == "flex":
            if self._flex is None:
                from fastzoo.attention.flex import FlexBackend

                self._flex = FlexBackend()
            return self._flex(q_BHSD, k_BHSD, v_BHSD, ctx)  # with flex's own per-call checks
        if k_BHSD.shape[1] != q_BHSD.shape[1] and not _CAPS[impl].gqa:  # impl=None declares gqa: this kernel may not
            k_BHSD, v_BHSD = (repeat_kv(x, q_BHSD.shape[1] // k_BHSD.shape[1]) for x in (k_BHSD, v_BHSD))
        q_THD, k_THD, v_THD = (packing.to_THD(x) for x in (q_BHSD, k_BHSD, v_BHSD))
        o_THD = _KERNELS[impl](q_THD, k_THD, v_THD, **packing.seqlens(ctx, q_BHSD, k_BHSD).kwargs(),
                               causal=ctx.causal, scale=ctx.scale, dropout_p=ctx.dropout_p, ctx=ctx,
                               **({"window": ctx.window} if ctx.window is not None else {}),  # impls with window only
                               **({"softcap": ctx.softcap} if ctx.softcap is not None else {}))  # ... softcap only
        return packing.from_THD(o_THD, q_BHSD.shape[0])
