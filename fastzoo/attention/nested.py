"""``nested``: packed sequences as a jagged NestedTensor through ``scaled_dot_product_attention``.

The packed row ``[1, H, T, D]`` and ``ctx.cu_seqlens`` become jagged ``[N, H, j, D]``
tensors (a view, no copy), and SDPA's NestedTensor path picks FlashAttention or
memory-efficient attention on CUDA, its math kernel on CPU. PyTorch's jagged SDPA has no
causal kernel on CPU (the math path refuses ``is_causal``), so causal calls on CPU run
:func:`fastzoo.attention.varlen.packed_sdpa`, the same exact dense SDPA as varlen's cpu
path. A plain ``[B, S]`` call without ``cu_seqlens`` is treated as B sequences of S tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastzoo.attention.base import BF16, FP16, FP32, AttentionBackend, Capabilities
from fastzoo.attention.varlen import packed_sdpa

_ALL = (FP32, BF16, FP16)


class NestedBackend(AttentionBackend):
    name = "nested"
    description = "jagged NestedTensor through SDPA (packed sequences)"
    capabilities = Capabilities(
        devices={"cpu": _ALL, "cuda": _ALL}, padding_mask=False, varlen=True, verified="CPU fp32 (torch 2.14.1)"
    )

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        B, H, S, D = q_BHSD.shape
        cu_seqlens, max_seqlen = ctx.cu_seqlens, ctx.max_seqlen
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q_BHSD.device)
            max_seqlen = S
        elif B != 1:
            raise ValueError(f"cu_seqlens: packed sequences come as one row [1, H, T, D], got batch size {B}")
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())

        def thd(x_BHSD):
            return x_BHSD.transpose(1, 2).reshape(B * S, H, -1)

        if q_BHSD.device.type == "cpu" and ctx.causal:
            o_THD = packed_sdpa(thd(q_BHSD), thd(k_BHSD), thd(v_BHSD), cu_seqlens, max_seqlen,
                                causal=True, scale=ctx.scale, dropout_p=ctx.dropout_p)
        else:
            offsets = cu_seqlens.long()

            def jagged_NHjD(x_BHSD):
                # the jagged kernels need the values contiguous (a [1, T, H, D] view may not be)
                values_THD = thd(x_BHSD).contiguous()
                return torch.nested.nested_tensor_from_jagged(values_THD, offsets=offsets, max_seqlen=max_seqlen).transpose(1, 2)

            o_NHjD = F.scaled_dot_product_attention(
                jagged_NHjD(q_BHSD), jagged_NHjD(k_BHSD), jagged_NHjD(v_BHSD),
                dropout_p=ctx.dropout_p, is_causal=ctx.causal, scale=ctx.scale,
            )
            o_THD = o_NHjD.transpose(1, 2).values()
        return o_THD.view(B, S, H, -1).transpose(1, 2)
