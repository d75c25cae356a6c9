"""``xformers``: xFormers' ``memory_efficient_attention`` (Rabe & Staats 2021, "Self-attention
Does Not Need O(n^2) Memory"; xFormers, Lefaudeux et al. 2022).

``xformers.ops.memory_efficient_attention(q, k, v, attn_bias=None, p=0.0, scale=None)`` takes
``[B, M, H, K]`` tensors (BMHK, i.e. our BSHD) and dispatches to the best operator it has
(CUTLASS, which also takes fp32, or FlashAttention for fp16/bf16). Masks are bias objects:
``LowerTriangularMask()`` for causal attention (``LowerTriangularFromBottomRightMask()`` with
fewer queries than keys: a KV cache), and
``fmha.attn_bias.BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen)`` / ``BlockDiagonalCausalMask``
for packed sequences (batch of one; ``BlockDiagonalCausalFromBottomRightMask`` when the keys
have their own lengths, a KV cache); a model unpads a padded batch into a packed one first. Building
a block-diagonal bias reads the sequence lengths on the host: one device sync per forward
(the bias is kept in the forward's ``AttnContext`` for the other layers).
"""
from __future__ import annotations

import torch

from fastzoo.attention.base import FLOATS, Capabilities
from fastzoo.attention.library import LibraryBackend


def _block_diagonal(cu_seqlens, causal: bool, device, cu_seqlens_k=None):
    from xformers.ops import fmha

    if cu_seqlens_k is None:
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # the one device sync
        mask_cls = fmha.attn_bias.BlockDiagonalCausalMask if causal else fmha.attn_bias.BlockDiagonalMask
        return mask_cls.from_seqlens(seqlens, device=device)
    # a KV cache: the keys have their own lengths, causal bottom-right in each block
    lengths = torch.stack([cu_seqlens[1:] - cu_seqlens[:-1], (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(cu_seqlens.device)])
    q_lens, k_lens = lengths.tolist()  # the one device sync
    mask_cls = fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask if causal else fmha.attn_bias.BlockDiagonalMask
    return mask_cls.from_seqlens(q_lens, k_lens, device=device)


def causal_bias(causal: bool, Sq: int, Sk: int):
    """``LowerTriangularMask`` is top-left aligned; fastzoo's causal is bottom-right when Sq < Sk."""
    if not causal:
        return None
    from xformers.ops.fmha import attn_bias

    return attn_bias.LowerTriangularMask() if Sq == Sk else attn_bias.LowerTriangularFromBottomRightMask()


def xformers_varlen(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen, *, causal, scale, dropout_p, ctx=None,
                    cu_seqlens_k=None, max_seqlen_k=None) -> torch.Tensor:
    """Packed sequences through a block-diagonal bias: ``[T, H, D]`` in and out. ``max_seqlen``
    and ``max_seqlen_k`` are unused (the bias reads the lengths); they keep the varlen kernels'
    common signature. ``cu_seqlens_k``: the keys' own offsets (a KV cache).
    With ``ctx`` the bias (and its host read of the lengths) is built once per forward."""
    from xformers.ops import memory_efficient_attention

    build = lambda: _block_diagonal(cu_seqlens, causal, q_THD.device, cu_seqlens_k)  # noqa: E731
    key = ("xformers_block_diagonal", causal, q_THD.device, cu_seqlens_k is None)
    bias = build() if ctx is None else ctx.cached(key, build)
    o_1THD = memory_efficient_attention(
        q_THD.unsqueeze(0), k_THD.unsqueeze(0), v_THD.unsqueeze(0), attn_bias=bias, p=dropout_p, scale=scale
    )
    return o_1THD[0]


class XformersBackend(LibraryBackend):
    name = "xformers"
    description = "xFormers memory_efficient_attention (LowerTriangularMask, BlockDiagonalMask)"
    # its own ops, and the CUTLASS kernel it dispatches fp32 (and fp16/bf16 without flash) to,
    # which is PyTorch's: aten::_efficient_attention_forward / _backward
    kernel_ops = r"xformers|fmha|cutlass|::_efficient_attention_\w+"
    capabilities = Capabilities(
        devices={"cuda": FLOATS},
        padding_mask=False,
        varlen=True,
        backward=("cuda",),
        compile=False,  # not declared torch.compile-safe by xFormers for training: expect graph breaks
        kv_cache=True,  # LowerTriangularFromBottomRightMask when there are fewer queries than keys
        min_cuda_capability=(6, 0),  # "NVIDIA GPUs with compute capability above 6.0 (P100+)"
        packages=("xformers.ops",),  # the module called (memory_efficient_attention, fmha)
        kernels_loaded="xformers:_has_cpp_library",  # it imports without them, then every call fails
        install="pip install xformers",
        verified="not verified on hardware",
    )

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal, scale, dropout_p):
        from xformers.ops import memory_efficient_attention

        bias = causal_bias(causal, q_BSHD.shape[1], k_BSHD.shape[1])
        return memory_efficient_attention(q_BSHD, k_BSHD, v_BSHD, attn_bias=bias, p=dropout_p, scale=scale)

    varlen = staticmethod(xformers_varlen)
