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

from fastzoo.attention import packing
from fastzoo.attention.base import FLOATS, AttentionBackend, Capabilities
from fastzoo.attention.varlen import packed_sdpa


class NestedBackend(AttentionBackend):
    name = "nested"
    description = "jagged NestedTensor through SDPA (packed sequences)"
    capabilities = Capabilities(
        devices={"cpu": FLOATS, "cuda": FLOATS}, padding_mask=False, varlen=True, verified="CPU fp32 (torch 2.14.1)"
    )

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        packing.check_self_attention(self, q_BHSD, k_BHSD)
        cu_seqlens, max_seqlen = packing.seqlens(ctx, q_BHSD)
        q_THD, k_THD, v_THD = (packing.to_THD(x) for x in (q_BHSD, k_BHSD, v_BHSD))
        if q_BHSD.device.type == "cpu" and ctx.causal:
            o_THD = packed_sdpa(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen,
                                causal=True, scale=ctx.scale, dropout_p=ctx.dropout_p, ctx=ctx)
        else:
            offsets = cu_seqlens.long()

            def jagged_NHjD(x_THD):
                # the jagged kernels need the values contiguous (a [1, T, H, D] view may not be)
                return torch.nested.nested_tensor_from_jagged(
                    x_THD.contiguous(), offsets=offsets, max_seqlen=max_seqlen).transpose(1, 2)

            o_NHjD = F.scaled_dot_product_attention(
                jagged_NHjD(q_THD), jagged_NHjD(k_THD), jagged_NHjD(v_THD),
                dropout_p=ctx.dropout_p, is_causal=ctx.causal, scale=ctx.scale,
            )
            o_THD = o_NHjD.transpose(1, 2).values()
        return packing.from_THD(o_THD, q_BHSD.shape[0])
