"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, optionally pinned to one kernel.

``sdpa_backend=None`` lets PyTorch pick; ``flash`` | ``efficient`` | ``cudnn`` | ``math``
pins it with ``torch.nn.attention.sdpa_kernel`` so that a benchmark measures the kernel it
names and a request the kernel cannot serve fails instead of quietly running another one.
Those flags are process-wide, so every SDPA call fastzoo makes goes through :func:`sdpa`: a pinned
call sets them and runs while no other SDPA call does, unpinned calls run side by side and
never see another thread's pin.
Causal-only attention uses ``is_causal=True`` (top-left aligned, so only when there are
as many queries as keys; decoding with a KV cache gets an explicit bottom-right mask); padding and packed sequences use a boolean
mask built from the same ``mask_mod`` as the reference, so their meaning cannot drift.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fastzoo.attention import masks
from fastzoo.attention.base import FLOATS, HALF, AttentionBackend, Capabilities, KernelProfile
from fastzoo.errors import BackendUnavailableError
from fastzoo.tracing import tracing

_H100 = "H100 (torch 2.11): ViT-B/16 and GPT-2"  # benchmarks/results/NVIDIA-H100-80GB-HBM3
_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_BASE = Capabilities(devices={"cpu": FLOATS, "cuda": FLOATS}, varlen=True, kv_cache=True, gqa=True, window=True,
                     verified=f"CPU fp32 (torch 2.14.1); {_H100} bf16/fp16/fp32")
# What each pinned kernel takes, from PyTorch's sdp_utils checks. On CPU "flash" is
# PyTorch's C++ flash kernel (fp32 too, masks allowed); on CUDA it is FlashAttention-2.
# enable_gqa: flash and math take grouped k/v; the memory-efficient kernel's dense check is
# check_batch_size_and_num_heads_dense<false> (no GQA), so it gets them repeated, as does cuDNN
# (not shown on hardware). The sliding window is a materialised mask (a flash-on-CUDA call cannot take one).
_KERNEL_CAPS = {
    None: _BASE,
    # the pinned kernels' H100 check ran ViT-B/16 in bf16 and fp16 only (its GPT-2 step ran out of the stage's time)
    "math": dataclasses.replace(_BASE, verified="CPU fp32 (torch 2.14.1); H100 (torch 2.11): ViT-B/16 bf16/fp16"),
    "flash": dataclasses.replace(
        _BASE, devices={"cpu": FLOATS, "cuda": HALF}, max_head_dim=256, min_cuda_capability=(8, 0),
        verified=("CPU fp32 (torch 2.14.1); H100 (torch 2.11): ViT-B/16 bf16/fp16; on CUDA it takes no attn_mask: padding, packed, KV cache and window "
                  "refused (at create given the model's device, else per call)"),
    ),
    "efficient": dataclasses.replace(_BASE, devices={"cuda": FLOATS}, gqa=False,
                                     verified="H100 (torch 2.11): ViT-B/16 bf16/fp16"),
    "cudnn": dataclasses.replace(
        _BASE, devices={"cuda": HALF}, max_head_dim=128, min_cuda_capability=(8, 0), gqa=False,
        verified="H100 (torch 2.11): ViT-B/16 bf16/fp16; dropout in multiples of 1/16 only, >= 2 keys",
    ),
}


# The op each pinned kernel runs, as the profiler names it
KERNEL_OPS = {
    ("flash", "cpu"): "aten::_scaled_dot_product_flash_attention_for_cpu",
    ("flash", "cuda"): "aten::_scaled_dot_product_flash_attention",
    ("efficient", "cuda"): "aten::_scaled_dot_product_efficient_attention",
    ("cudnn", "cuda"): "aten::_scaled_dot_product_cudnn_attention",
    ("math", "cpu"): "aten::_scaled_dot_product_attention_math",
    ("math", "cuda"): "aten::_scaled_dot_product_attention_math",
}
SDPA_OPS = r"::_scaled_dot_product_\w+|::_flash_attention_\w+|::_efficient_attention_\w+|::_cudnn_attention\w*"


def math_reason(q, ctx) -> str:
    """Why SDPA's dispatcher took math: PyTorch's own checks, restated (CPU) or asked (CUDA)."""
    if q.device.type == "cpu":
        if ctx.dropout_p > 0:
            return f"PyTorch's CPU flash kernel takes no dropout (dropout_p={ctx.dropout_p:g} in training mode)"
        return "PyTorch's dispatcher chose math (torch._fused_sdp_choice)"
    known = "flash and cuDNN take fp16/bf16 only; " if q.dtype == torch.float32 else ""
    return (f"PyTorch's dispatcher chose math ({known}torch.backends.cuda.can_use_flash_attention / "
            "can_use_efficient_attention(SDPAParams(q, k, v, mask, dropout, is_causal, enable_gqa), debug=True) "
            "print each kernel's reason)")


class _SharedFlags:
    """Who may read or set torch's SDPA kernel flags (``sdpa_kernel`` sets them for the whole process,
    not per thread): any number of unpinned calls read them at once (``with flags.read():``); a pinned
    call sets them, runs and restores them alone (``with flags.pin(kernel):``). A waiting pinned call
    goes first, so a stream of unpinned calls cannot starve it. The read path is a plain lock taken
    twice (about 1 us a call on CPU), not a generator-based context manager."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = self._pins_waiting = 0
        self._pinned = False

    def read(self) -> "_SharedFlags":
        return self

    def __enter__(self):
        with self._cond:
            while self._pinned or self._pins_waiting:
                self._cond.wait()
            self._readers += 1

    def __exit__(self, *exc):
        with self._cond:
            self._readers -= 1
            if not self._readers and self._pins_waiting:
                self._cond.notify_all()

    @contextlib.contextmanager
    def pin(self, kernel: SDPBackend):
        with self._cond:
            self._pins_waiting += 1
            while self._pinned or self._readers:
                self._cond.wait()
            self._pins_waiting -= 1
            self._pinned = True
        try:
            with sdpa_kernel(kernel):  # restores the flags on the way out, an exception included
                yield
        finally:
            with self._cond:
                self._pinned = False
                self._cond.notify_all()


_FLAGS = _SharedFlags()


def on_math_kernel():
    """A block in which a peer library's SDPA calls (transformers' SDPA attention) run on SDPA's math kernel:
    the one its users get where flash does not serve (fp32 on CUDA, attention dropout). Not for fastzoo's
    own calls inside it: they name their kernel themselves."""
    return _FLAGS.pin(SDPBackend.MATH)
_TINY = torch.finfo(torch.float32).tiny


def sdpa(q, k, v, *, kernel: SDPBackend | None = None, **kwargs):
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)``, on ``kernel`` only if given, safe from
    threads (see :class:`_SharedFlags`). Under ``torch.compile`` the flags are read at trace time
    and the graph keeps the kernel chosen: no lock there."""
    scale = kwargs.get("scale")
    if scale is not None and abs(scale) < _TINY:
        # a scale that is 0 in fp32 (Granite's attention_multiplier=5e-324, or 0) makes every score 0: torch's CPU
        # flash kernel then masks causally with -inf x 0 = NaN. fp32's smallest normal number gives the same
        # probabilities (exp of scores below 1e-8 is 1 in fp32) without the NaN
        kwargs["scale"] = math.copysign(_TINY, scale)
    if kernel is None:
        guard = contextlib.nullcontext() if tracing() else _FLAGS.read()
    else:
        guard = sdpa_kernel(kernel) if tracing() else _FLAGS.pin(kernel)
    with guard:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _dense_mask(ctx, B, Sq, Sk, device):
    mask_mod = masks.context_mask_mod(ctx, Sq, total_k=Sk, device=device)
    return None if mask_mod is None else masks.dense_mask(mask_mod, B, 1, Sq, Sk, device)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    description = "torch scaled_dot_product_attention (sdpa_backend= flash|efficient|cudnn|math)"
    capabilities = _BASE
    options = {"sdpa_backend": None}
    variants = tuple({"sdpa_backend": k} for k in _KERNELS)
    kernel_ops = SDPA_OPS

    def __init__(self, **options):
        super().__init__(**options)
        kernel = self.opts["sdpa_backend"]
        if kernel not in _KERNEL_CAPS:
            raise ValueError(f"sdpa_backend={kernel!r}: choose one of {', '.join(_KERNELS)} (or None to let PyTorch pick)")
        self.capabilities = _KERNEL_CAPS[kernel]
        self.kernel = _KERNELS.get(kernel)

    def problems(self, req):
        problems = super().problems(req)
        if self.opts["sdpa_backend"] == "cudnn" and req.attn_dropout > 0 and not (req.attn_dropout * 16).is_integer():
            problems.append(f"sdpa_backend='cudnn' takes attention dropout only in multiples of 1/16 (cuDNN's dropout), and "
                            f"{req.attn_dropout_field}={req.attn_dropout:g}: use a multiple of 1/16 (e.g. 0.125), "
                            "sdpa_backend='efficient' or None")
        needs = (("key-padding masks", req.padding_mask), ("packed sequences", req.varlen),
                 ("a bottom-right causal mask with a KV cache", req.kv_cache), ("a sliding window", req.window))
        if self._mask_free and req.device == "cuda" and any(need for _, need in needs):
            takes = " and ".join(w for w, need in needs if need)
            problems.append(f"sdpa_backend='flash' on CUDA (FlashAttention-2) takes no attn_mask, and this model's forward "
                            f"takes {takes}: use sdpa_backend='efficient' or None, or the fa2 / varlen backends")
        return problems

    def kernel_profile(self, q, k, ctx):
        kernel = self.opts["sdpa_backend"]
        if kernel is None:
            math = KERNEL_OPS[("math", "cpu")]
            return KernelProfile(f"{self.label()}: a fused SDPA kernel (PyTorch picks; math is its fallback)",
                                 r"^aten::_scaled_dot_product_(?!attention_math)", ((re.escape(math), math_reason(q, ctx)),),
                                 missing="no SDPA kernel seen")
        op = KERNEL_OPS.get((kernel, q.device.type), f"SDPA's {kernel} kernel")
        return KernelProfile(f"{self.label()}: {op}", f"^{re.escape(op)}$")

    def check_call(self, q, k, ctx):
        if self.opts["sdpa_backend"] == "cudnn" and k.shape[-2] == 1:
            raise BackendUnavailableError(self._message([
                "sdpa_backend='cudnn' refuses a key length of 1 (cuDNN attention needs >= 2 keys): use "
                "sdpa_backend='efficient' or None for this call"] + self.problems(self.call_request(q, k, ctx))))
        super().check_call(q, k, ctx)

    @property
    def _mask_free(self) -> bool:
        """FlashAttention-2 inside SDPA on CUDA takes no ``attn_mask`` (on CPU PyTorch's flash kernel does)."""
        return self.opts["sdpa_backend"] == "flash"

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        B, H, Sq, _ = q_BHSD.shape
        Sk = k_BHSD.shape[-2]
        # is_causal is top-left aligned: with a KV cache (Sq < Sk) the bottom-right mask is explicit
        only_causal = bool(ctx.causal and ctx.key_padding_mask is None and ctx.cu_seqlens is None and ctx.window is None
                           and Sq == Sk)  # bool: Sq == Sk is symbolic under export
        attn_mask = None
        if not only_causal:  # built by the first layer of a forward, reused by the others (check_call refused flash on CUDA)
            attn_mask = ctx.cached((self.uid, "dense_mask", B, Sq, Sk, ctx.window),
                                   lambda: _dense_mask(ctx, B, Sq, Sk, q_BHSD.device))
        kwargs = dict(attn_mask=attn_mask, dropout_p=ctx.dropout_p, is_causal=only_causal, scale=ctx.scale,
                      enable_gqa=k_BHSD.shape[1] != q_BHSD.shape[1])
        return sdpa(q_BHSD, k_BHSD, v_BHSD, kernel=self.kernel, **kwargs)
