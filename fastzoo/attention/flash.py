"""``fa2`` and ``fa3``: FlashAttention called through its own Python interface.

- ``fa2``: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
  Parallelism and Work Partitioning"), package ``flash-attn``:
  ``flash_attn.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal)`` on ``[B, S, H, D]``
  and ``flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, dropout_p, softmax_scale, causal)`` on ``[T, H, D]``. Ampere or newer, fp16/bf16,
  head dim <= 256 (the interface pads it to a multiple of 8 itself), dropout supported.
- ``fa3``: FlashAttention-3 (Shah et al. 2024, "FlashAttention-3: Fast and Accurate Attention
  with Asynchrony and Low-precision"), the ``flash_attn_interface`` module built from
  flash-attention's ``hopper/`` directory: the same two functions, without dropout. Hopper
  (compute capability 9.0), fp16/bf16, head dim <= 256 and a multiple of 8. Older builds return
  ``(out, softmax_lse)`` and newer ones ``out``; both are accepted.

Why ``fa3`` calls ``flash_attn_interface`` directly rather than PyTorch's
``torch.nn.attention.activate_flash_attention_impl("FA3")``: that switch needs the very same
module (it registers ``torch.ops.flash_attn_3`` into SDPA's dispatcher), it changes every
SDPA call in the process rather than the model that asked, and SDPA has no packed-sequence
entry. A user who wants that route can activate it and pick ``attn="sdpa",
attn_options={"sdpa_backend": "flash"}``.

Packed batches go to the varlen kernel; a model unpads a padded batch into a packed one
first (:mod:`fastzoo.attention.library`). The libraries are imported inside the calls only.
"""
from __future__ import annotations

import torch

from fastzoo.attention.base import HALF, Capabilities
from fastzoo.attention.library import LibraryBackend
from fastzoo.attention.masks import flash_window_size


def _out(result):
    """FA3 builds differ: some return ``(out, softmax_lse)``, others ``out``."""
    return result[0] if isinstance(result, tuple) else result


FLASH_ATTN_BOTTOM_RIGHT = (2, 1)  # flash-attn 2.1 moved causal with seqlen_q != seqlen_k to bottom-right


def _check_bottom_right(module_name: str, q_BSHD, k_BSHD, causal: bool) -> None:
    """flash-attn 2.0 aligned causal top-left: refuse it where the two answers differ."""
    if q_BSHD.shape[1] != k_BSHD.shape[1]:
        _check_bottom_right_version(module_name, causal)


def _check_bottom_right_version(module_name: str, causal: bool) -> None:
    if not causal:
        return
    import importlib

    version = getattr(importlib.import_module(module_name), "__version__", "0")
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < FLASH_ATTN_BOTTOM_RIGHT:
        raise ValueError(f"{module_name} {version} aligns causal attention with fewer queries than keys top-left; "
                         "fastzoo's contract (KV cache) is bottom-right, as flash-attn >= 2.1 does: upgrade flash-attn")


def fa2_varlen(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p, ctx=None,
               cu_seqlens_k=None, max_seqlen_k=None, window=None, softcap=None) -> torch.Tensor:
    """FlashAttention-2 on packed sequences: ``[T, H, D]`` tokens, ``cu_seqlens`` [N+1] int32 (the
    keys' own ``cu_seqlens_k`` with a KV cache: causal is then bottom-right per sequence)."""
    from flash_attn import flash_attn_varlen_func

    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    else:
        _check_bottom_right_version("flash_attn", causal)
    return flash_attn_varlen_func(
        q_THD, k_THD, v_THD, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
        dropout_p=dropout_p, softmax_scale=scale, causal=causal, window_size=flash_window_size(window),
        softcap=softcap or 0.0,
    )


def _no_dropout(dropout_p: float) -> None:
    if dropout_p > 0:
        raise ValueError("fa3: FlashAttention-3 has no attention dropout; set the model's attention dropout to 0 or use fa2")


class Fa2Backend(LibraryBackend):
    name = "fa2"
    description = "FlashAttention-2 (flash-attn): flash_attn_func / flash_attn_varlen_func"
    kernel_ops = r"flash_attn::|flash_fwd|flash_bwd"  # its torch.library ops (flash_attn::_flash_attn_forward) and CUDA kernels
    capabilities = Capabilities(
        devices={"cuda": HALF},
        padding_mask=False,
        varlen=True,
        backward=("cuda",),
        compile=True,  # flash-attn >= 2.7 registers its kernels as torch.library custom ops (flash_attn::_flash_attn_forward)
        max_head_dim=256,
        kv_cache=True,  # causal with seqlen_q < seqlen_k is bottom-right aligned (flash-attn >= 2.1)
        gqa=True,  # k/v with fewer heads than q, as they are
        window=True,  # window_size=(left, right), flash-attn >= 2.3
        softcap=True,  # flash_attn_func(softcap=), from flash-attn 2.6
        min_cuda_capability=(8, 0),
        # the module called; flash-attn-4 installs a bare flash_attn/cute/ namespace, so `flash_attn` alone imports without FA2
        packages=("flash_attn.flash_attn_interface",),
        install=("pip install flash-attn --no-build-isolation (a source build against the installed torch: torch 2.14's headers "
                 "need C++20, which flash-attn's -std=c++17 build lacks, flash-attention#2863; on Hopper/Blackwell use attn='fa4')"),
        verified="not verified on hardware",
    )

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, dropout_p, window=None, softcap=None):
        from flash_attn import flash_attn_func

        _check_bottom_right("flash_attn", q_BSHD, k_BSHD, causal)
        return flash_attn_func(q_BSHD, k_BSHD, v_BSHD, dropout_p=dropout_p, softmax_scale=scale, causal=causal,
                               window_size=flash_window_size(window), softcap=softcap or 0.0)

    varlen = staticmethod(fa2_varlen)


class Fa3Backend(LibraryBackend):
    name = "fa3"
    description = "FlashAttention-3 for Hopper (flash_attn_interface); no dropout"
    kernel_ops = r"flash_attn_3::|flash_attn_interface|flash_fwd|flash_bwd|FlashAttnFwd|FlashAttnBwd"
    capabilities = Capabilities(
        devices={"cuda": HALF},
        padding_mask=False,
        varlen=True,
        backward=("cuda",),
        dropout=False,
        compile=True,  # registered as torch.library custom ops (flash_attn_3::_flash_attn_forward)
        max_head_dim=256,
        head_dim_multiple=8,  # FA3 takes head dims that are multiples of 8 only (it does not pad them, unlike fa2)
        kv_cache=True,  # causal with seqlen_q < seqlen_k is bottom-right aligned, as in FlashAttention-2 >= 2.1
        gqa=True,
        window=True,
        softcap=True,
        min_cuda_capability=(9, 0),
        packages=("flash_attn_interface",),
        # no PyPI distribution: flash-attn's sdist ships hopper/ without its CUDA sources
        install=("git clone https://github.com/Dao-AILab/flash-attention && cd flash-attention/hopper && "
                 "pip install --no-build-isolation . (a source build; FA3 has no PyPI distribution)"),
        verified="not verified on hardware",
    )

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, dropout_p, window=None, softcap=None):
        _no_dropout(dropout_p)
        from flash_attn_interface import flash_attn_func

        return _out(flash_attn_func(q_BSHD, k_BSHD, v_BSHD, softmax_scale=scale, causal=causal,
                                    window_size=flash_window_size(window), softcap=softcap or 0.0))

    def varlen(self, q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p, ctx=None,
               cu_seqlens_k=None, max_seqlen_k=None, window=None, softcap=None):
        _no_dropout(dropout_p)
        from flash_attn_interface import flash_attn_varlen_func

        if cu_seqlens_k is None:
            cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
        return _out(flash_attn_varlen_func(q_THD, k_THD, v_THD, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                           softmax_scale=scale, causal=causal, window_size=flash_window_size(window),
                                           softcap=softcap or 0.0))
