"""``nested``: packed sequences as a jagged NestedTensor through ``scaled_dot_product_attention``.

The packed row ``[1, H, T, D]`` and ``ctx.cu_seqlens`` become jagged ``[N, H, j, D]``
tensors (a view, no copy), and SDPA's NestedTensor path picks FlashAttention or
memory-efficient attention on CUDA, its math kernel on CPU. PyTorch's jagged SDPA has no
causal kernel on CPU (the math path refuses ``is_causal``), so causal calls on CPU run
:func:`fastzoo.attention.varlen.packed_sdpa`, the same exact dense SDPA as varlen's cpu
path. A plain ``[B, S]`` call without ``cu_seqlens`` is treated as B sequences of S tokens.

With a KV cache the keys have their own offsets (``ctx.cu_seqlens_k``) and become their own
jagged tensor. SDPA's ``is_causal`` is top-left aligned, so causal attention with fewer
queries than keys goes to jagged SDPA only where alignment cannot matter: one query per
sequence (``max_seqlen == 1``, the decoding step: the last position sees every key of its
sequence, no mask), on CUDA. Otherwise (a chunk of several new tokens per sequence, or any
causal call on CPU) it runs :func:`~fastzoo.attention.varlen.packed_sdpa` with explicit
bottom-right masks.

On CPU, jagged SDPA's math path turns the jagged tensors into the strided NestedTensor layout
inside torch, whose C++ warns that this layout is a prototype: the one warning of torch's own
about its internal step is filtered (that message, from ``torch.nested``, only).
"""
from __future__ import annotations

import warnings

import torch

from fastzoo.attention import packing
from fastzoo.attention.base import FLOATS, AttentionBackend, Capabilities, KernelProfile
from fastzoo.attention.sdpa import SDPA_OPS, sdpa
from fastzoo.attention.varlen import packed_sdpa


warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage",
                        category=UserWarning, module="torch.nested")


class NestedBackend(AttentionBackend):
    name = "nested"
    description = "jagged NestedTensor through SDPA (packed sequences)"
    capabilities = Capabilities(
        devices={"cpu": FLOATS, "cuda": FLOATS}, padding_mask=False, varlen=True, kv_cache=True,
        head_dim_on=(("cuda", 1, 8),),  # jagged SDPA's flash / efficient kernels: head dim a multiple of 8
        # non-reentrant torch.utils.checkpoint reads the shape of each tensor saved for the backward, which
        # the strided NestedTensors of CPU's jagged math have none of, and its recompute builds new jagged
        # tensors whose ragged size is another symbol than the saved graph's (torch 2.14)
        checkpoint=False,
        verified="CPU fp32 (torch 2.14.1); H100 (torch 2.11): GPT-2 bf16 packed, ViT-B/16 (dense: no padding)",
    )

    # the jagged tensors' construction shows that the NestedTensor path ran: on CPU, jagged SDPA then runs
    # SDPA's math kernel, the op a dense call may run too
    kernel_ops = SDPA_OPS + r"|::_nested_view_from_jagged$"

    def kernel_profile(self, q, k, ctx):
        if q.device.type == "cpu" and ctx.causal:
            why = ("PyTorch's jagged NestedTensor SDPA has no causal kernel on CPU: ran dense SDPA per sequence "
                   "(varlen's cpu kernel)")
        else:
            why = "the NestedTensor path did not run"
        return KernelProfile(f"{self.label()}: jagged NestedTensor SDPA", r"::_nested_view_from_jagged$", missing=why)

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        seqlens = packing.seqlens(ctx, q_BHSD, k_BHSD)
        q_THD, k_THD, v_THD = (packing.to_THD(x) for x in (q_BHSD, k_BHSD, v_BHSD))
        cached = seqlens.cu_k is not seqlens.cu_q
        # jagged SDPA: non-causal, or (not on CPU) causal over equal lengths or with one query per sequence
        jagged = not ctx.causal or (q_BHSD.device.type != "cpu" and (not cached or seqlens.max_q == 1))
        if not jagged:
            o_THD = packed_sdpa(q_THD, k_THD, v_THD, **seqlens.kwargs(), causal=True, scale=ctx.scale,
                                dropout_p=ctx.dropout_p, ctx=ctx)
        else:
            def jagged_NHjD(x_THD, offsets, max_seqlen):
                # the jagged kernels need the values contiguous (a [1, T, H, D] view may not be)
                return torch.nested.nested_tensor_from_jagged(
                    x_THD.contiguous(), offsets=offsets.long(), max_seqlen=max_seqlen).transpose(1, 2)

            k_args = (seqlens.cu_k, seqlens.max_k)
            o_NHjD = sdpa(
                jagged_NHjD(q_THD, seqlens.cu_q, seqlens.max_q), jagged_NHjD(k_THD, *k_args), jagged_NHjD(v_THD, *k_args),
                dropout_p=ctx.dropout_p, is_causal=ctx.causal and not cached, scale=ctx.scale,
            )
            o_THD = _CompactGrad.apply(o_NHjD.transpose(1, 2).values())
        return packing.from_THD(o_THD, q_BHSD.shape[0])


class _CompactGrad(torch.autograd.Function):
    """The identity, whose backward hands on a compact copy of its gradient. torch's jagged NestedTensor SDPA
    backward reads a gradient that is a view into a larger tensor at the wrong place (torch 2.14, CPU): two
    attentions whose outputs are concatenated (``torch.cat``'s backward hands each a slice of its gradient, as
    RT-DETR's denoising groups do) got q / k / v gradients 1.5-2.9 off, their forwards exact."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(memory_format=torch.contiguous_format)
