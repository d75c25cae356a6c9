"""``fa4``: FlashAttention-4 (package ``flash-attn-4``): FlashAttention's CuTe-DSL kernels for
Hopper (sm90) and Blackwell (sm100/sm110), compiled at first use by ``nvidia-cutlass-dsl``; a
pure-Python wheel, so it installs against any torch (``pip install -e ".[gpu]"``).

Interface (``flash_attn.cute``, flash-attn-4 4.0.0b36)::

    flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                    softcap=0.0, ..., return_lse=False) -> (out, lse)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, softmax_scale=None, causal=False,
                           window_size=(None, None), softcap=0.0, ...) -> (out, lse)

on ``[B, S, H, D]`` / ``[T, H, D]``; both return a tuple (``lse`` is None unless asked for or
needed by the backward). What it takes, from its checks: q, k, v of one dtype, fp16/bf16
(fp8 forward only: not used); k/v with fewer heads than q (GQA, ``num_head % num_head_kv == 0``);
int32 contiguous ``cu_seqlens`` of ``[N+1]``; ``window_size=(left, right)`` with None (or
negative) for unbounded, ``causal=True`` setting ``right = 0``; causal with fewer queries than
keys is bottom-right aligned (its masks offset by ``seqlen_k - seqlen_q``); ``softcap`` a float
(0: none); no dropout. Head dims per compute capability (``_validate_head_dims``): sm90 8-256,
sm100/sm110 8-128 or exactly 256, each a multiple of 8 for 16-bit dtypes. It also runs on
sm80 / sm120, which fastzoo does not declare (not its target, not tried). The backward is
``FlashAttnFunc.backward`` (sm90, sm100). Not a torch.library op: ``torch.compile`` breaks the
graph around it (declared ``compile=False``).

Not verified on hardware here; ``tests/test_flash_contract.py`` checks fastzoo's side against a
stand-in that enforces these preconditions on CPU.
"""
from __future__ import annotations

import torch

from fastzoo.attention.base import HALF, Capabilities
from fastzoo.attention.library import LibraryBackend
from fastzoo.attention.masks import flash_window_size

# compute-capability major -> (head dims it takes, in words; the rule)
HEAD_DIMS = {
    9: ("8-256, a multiple of 8", lambda d: 8 <= d <= 256 and d % 8 == 0),
    10: ("8-128 or 256, a multiple of 8", lambda d: (8 <= d <= 128 or d == 256) and d % 8 == 0),
    11: ("8-128 or 256, a multiple of 8", lambda d: (8 <= d <= 128 or d == 256) and d % 8 == 0),
}


def device_major() -> int | None:
    """The compute-capability major of this machine's current GPU (None without one)."""
    return torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else None


def _no_dropout(dropout_p: float) -> None:
    if dropout_p > 0:
        raise ValueError("fa4: FlashAttention-4 has no attention dropout; set the model's attention dropout to 0")


class Fa4Backend(LibraryBackend):
    name = "fa4"
    description = "FlashAttention-4 (flash-attn-4, CuTe DSL) for Hopper/Blackwell: flash_attn.cute (softcap= option)"
    kernel_ops = r"FlashAttnFunc|FlashAttnVarlenFunc|FlashAttentionForwardSm\d+|FlashAttentionBackwardSm\d+|flash_attn\.cute"
    capabilities = Capabilities(
        devices={"cuda": HALF},
        padding_mask=False,
        varlen=True,
        kv_cache=True,  # bottom-right causal, dense and per packed sequence
        gqa=True,
        window=True,
        softcap=True,  # the model's (ctx.softcap) or the softcap= option
        dropout=False,
        backward=("cuda",),
        compile=False,
        max_head_dim=256,
        head_dim_multiple=8,
        min_cuda_capability=(9, 0),
        packages=("flash_attn.cute",),
        install="pip install 'flash-attn-4>=4.0.0b36' (or pip install -e \".[gpu]\"; with a CUDA 13 torch: 'flash-attn-4[cu13]')",
        verified="not verified on hardware",
    )
    options = {"softcap": None}  # Gemma-2 logit soft-capping: cap * tanh(score / cap)

    def __init__(self, **options):
        super().__init__(**options)
        cap = self.opts["softcap"]
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0):
            raise ValueError(f"softcap={cap!r}: a positive number (FlashAttention-4's logit soft-cap), or None")

    def problems(self, req):
        problems = super().problems(req)
        major = device_major() if req.device == "cuda" else None
        if major is not None:
            words, ok = HEAD_DIMS.get(major, (None, None))
            if ok is None:
                problems.append(f"is declared for Hopper (sm90) and Blackwell (sm100/sm110) only; this GPU is sm{major}x")
            elif not ok(req.head_dim):
                problems.append(f"takes head dims {words} on sm{major}x, the model has {req.head_dim}")
        return problems

    def _common(self, causal, scale, dropout_p, window, softcap):
        _no_dropout(dropout_p)
        option = self.opts["softcap"]
        if softcap is not None and option is not None and float(option) != float(softcap):
            raise ValueError(f"softcap={option}: the model soft-caps its scores at {softcap}; leave the option unset")
        # FA4's form: None for an unbounded side (flash-attn 2/3 use -1)
        window_size = (None, None) if window is None else flash_window_size(window)
        return dict(softmax_scale=scale, causal=causal, window_size=window_size,
                    softcap=float(softcap or option or 0.0))

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, dropout_p, window=None, softcap=None):
        from flash_attn.cute import flash_attn_func

        out, _lse = flash_attn_func(q_BSHD, k_BSHD, v_BSHD, **self._common(causal, scale, dropout_p, window, softcap))
        return out

    def varlen(self, q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p, ctx=None,
               cu_seqlens_k=None, max_seqlen_k=None, window=None, softcap=None):
        from flash_attn.cute import flash_attn_varlen_func

        if cu_seqlens_k is None:
            cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
        out, _lse = flash_attn_varlen_func(
            q_THD, k_THD, v_THD, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen_k, **self._common(causal, scale, dropout_p, window, softcap))
        return out
