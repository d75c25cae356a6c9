"""``xformers``: xFormers' ``memory_efficient_attention`` (Rabe & Staats 2021, "Self-attention
Does Not Need O(n^2) Memory"; xFormers, Lefaudeux et al. 2022).

``xformers.ops.memory_efficient_attention(q, k, v, attn_bias=None, p=0.0, scale=None)`` takes
``[B, M, H, K]`` tensors (BMHK, i.e. our BSHD) and dispatches to the best operator it has
(CUTLASS, which also takes fp32, or FlashAttention for fp16/bf16). Masks are bias objects:
``LowerTriangularMask()`` for causal attention, and
``fmha.attn_bias.BlockDiagonalMask.from_seqlens(...)`` / ``BlockDiagonalCausalMask`` for packed
sequences (batch of one); a model unpads a padded batch into a packed one first. Building
a block-diagonal bias reads the sequence lengths on the host: one device sync per call.
"""
from __future__ import annotations

import torch

from fastzoo.attention.base import FLOATS, Capabilities
from fastzoo.attention.library import LibraryBackend


def xformers_varlen(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p) -> torch.Tensor:
    """Packed sequences through a block-diagonal bias: ``[T, H, D]`` in and out. ``max_seqlen``
    is unused (the bias reads the lengths); it keeps the varlen kernels' common signature."""
    from xformers.ops import fmha, memory_efficient_attention

    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    mask_cls = fmha.attn_bias.BlockDiagonalCausalMask if causal else fmha.attn_bias.BlockDiagonalMask
    bias = mask_cls.from_seqlens(seqlens, device=q_THD.device)
    o_1THD = memory_efficient_attention(
        q_THD.unsqueeze(0), k_THD.unsqueeze(0), v_THD.unsqueeze(0), attn_bias=bias, p=dropout_p, scale=scale
    )
    return o_1THD[0]


class XformersBackend(LibraryBackend):
    name = "xformers"
    description = "xFormers memory_efficient_attention (LowerTriangularMask, BlockDiagonalMask)"
    capabilities = Capabilities(
        devices={"cuda": FLOATS},
        padding_mask=False,
        varlen=True,
        backward=("cuda",),
        compile=False,  # not declared torch.compile-safe by xFormers for training: expect graph breaks
        min_cuda_capability=(6, 0),  # "NVIDIA GPUs with compute capability above 6.0 (P100+)"
        packages=("xformers",),
        install="pip install xformers",
        verified="not verified on hardware",
    )

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, dropout_p):
        from xformers.ops import LowerTriangularMask, memory_efficient_attention

        bias = LowerTriangularMask() if causal else None
        return memory_efficient_attention(q_BSHD, k_BSHD, v_BSHD, attn_bias=bias, p=dropout_p, scale=scale)

    varlen = staticmethod(xformers_varlen)
