"""``te``: NVIDIA Transformer Engine's ``DotProductAttention``.

``transformer_engine.pytorch.DotProductAttention(num_attention_heads, kv_channels,
attention_dropout=..., qkv_format=..., attn_mask_type=...)`` picks among its own backends
(cuDNN fused attention, FlashAttention, unfused) per call. Equal-length batches use
``qkv_format="bshd"`` with ``attn_mask_type`` ``"no_mask"`` or ``"causal"``; packed sequences,
and padded batches once the model has packed them (:mod:`fastzoo.attention.packing`; TE's bshd padding
path assumes right padding), use ``qkv_format="thd"`` with ``cu_seqlens_q/kv``,
``max_seqlen_q/kv`` and ``attn_mask_type`` ``"padding"`` or ``"padding_causal"``, as TE's
documentation prescribes. TE returns the heads flattened (``[B, S, H*D]`` / ``[T, H*D]``);
they are unflattened here. FP8 attention is out of scope.

One ``DotProductAttention`` module is built per (heads, head dim, dropout, scale) and kept;
it holds no weights, so the model's state dict is untouched.
"""
from __future__ import annotations

import torch

from fastzoo.attention.base import HALF, Capabilities
from fastzoo.attention.library import LibraryBackend


def _dense_mask_type(causal: bool, Sq: int, Sk: int) -> str:
    """TE's "causal" is top-left aligned; fastzoo's causal is bottom-right when Sq < Sk (KV cache)."""
    if not causal:
        return "no_mask"
    return "causal" if Sq == Sk else "causal_bottom_right"


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


class TeBackend(LibraryBackend):
    name = "te"
    description = "Transformer Engine DotProductAttention (bshd; thd with cu_seqlens)"
    kernel_ops = r"FusedAttn|fused_attn|flash_attn::|flash_fwd|flash_bwd|UnfusedDotProductAttention"  # its cuDNN, flash and unfused paths
    capabilities = Capabilities(
        devices={"cuda": HALF},
        padding_mask=False,
        varlen=True,
        backward=("cuda",),
        compile=False,  # TE wraps its attention in no_torch_dynamo: torch.compile runs it eagerly
        max_head_dim=256,
        head_dim_multiple=8,  # cuDNN fused attention's requirement
        kv_cache=True,  # dense calls with fewer queries than keys use attn_mask_type="causal_bottom_right"
        min_cuda_capability=(8, 0),
        packages=("transformer_engine.pytorch",),  # the module called: `transformer_engine` alone imports without it
        install="pip install --no-build-isolation 'transformer_engine[pytorch]' (compiles against the installed torch)",
        verified="not verified on hardware",
    )

    def __init__(self, **options):
        super().__init__(**options)
        self._modules = {}

    def _module(self, heads: int, head_dim: int, scale, dropout_p: float, needs_grad: bool):
        key = (heads, head_dim, scale, dropout_p)
        if key not in self._modules:
            from transformer_engine.pytorch import DotProductAttention

            # softmax_scale only when set: TE's default is 1/sqrt(kv_channels), as ours.
            extra = {"softmax_scale": scale} if scale is not None else {}
            self._modules[key] = DotProductAttention(heads, head_dim, attention_dropout=dropout_p, qkv_format="bshd",
                                                     attn_mask_type="no_mask", **extra)
        module = self._modules[key]
        # TE keeps what its backward needs (the softmax statistics) only in training mode, so a
        # call that will be differentiated runs in training mode even without dropout; dropout
        # needs it too. Anything else runs in eval mode (nothing saved).
        module.train(dropout_p > 0 or needs_grad)
        return module

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, dropout_p):
        B, S, H, D = q_BSHD.shape
        attn = self._module(H, D, scale, dropout_p, _needs_grad(q_BSHD, k_BSHD, v_BSHD))
        q_BSHD, k_BSHD, v_BSHD = (x.contiguous() for x in (q_BSHD, k_BSHD, v_BSHD))  # TE infers layouts from strides
        o_BSX = attn(q_BSHD, k_BSHD, v_BSHD, qkv_format="bshd", attn_mask_type=_dense_mask_type(causal, S, k_BSHD.shape[1]))
        return o_BSX.view(B, S, H, D)

    def varlen(self, q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p, ctx=None,
               cu_seqlens_k=None, max_seqlen_k=None):
        T, H, D = q_THD.shape
        attn = self._module(H, D, scale, dropout_p, _needs_grad(q_THD, k_THD, v_THD))
        q_THD, k_THD, v_THD = (x.contiguous() for x in (q_THD, k_THD, v_THD))
        mask_type = "padding_causal" if causal else "padding"
        if cu_seqlens_k is None:
            cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
        elif causal:  # a KV cache: TE's "padding_causal" is top-left, its bottom-right form is named
            mask_type = "padding_causal_bottom_right"
        o_TX = attn(
            q_THD, k_THD, v_THD, qkv_format="thd", attn_mask_type=mask_type,
            cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens_k, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen_k,
        )
        return o_TX.view(T, H, D)
