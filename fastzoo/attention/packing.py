"""Packed sequences: their metadata and the layout conversions, in one place.

Varlen kernels (FlashAttention, xFormers, Transformer Engine, ``varlen``, ``nested``) take
``[T, H, D]`` tokens and int32 ``cu_seqlens`` offsets, not the contract's ``[B, H, S, D]``
and not a key-padding mask:

- :func:`seqlens` gives a call's offsets (:class:`Seqlens`: the queries' ``cu_seqlens`` /
  ``max_seqlen`` and the keys', which differ with a KV cache): the context's packed
  sequences, or a plain ``[B, S]`` batch read as B sequences of S tokens;
- :func:`to_THD` / :func:`from_THD` move between the contract's layout and the kernels';
- :func:`unpad` gathers the real tokens of a padded batch (any ``[B, S, ...]`` tensors; any
  padding pattern: left, right or holes, order kept) and :func:`repad` scatters results
  back with zeros at padded positions. Models call them once per forward, so attention
  and everything between attention layers skip the padding.

A backend with no varlen kernel (eager, sdpa, flex, and ``varlen``'s flex impl) attends over a
packed row in one dense attention under the document mask (:func:`fastzoo.attention.masks.context_mask_mod`):
the same function for finite values, but a non-finite value in one sequence (a NaN state) reaches
the row's other sequences as 0 x NaN, as in any dense masked attention; the varlen kernels and
``nested`` read each sequence alone.

Pure PyTorch, so it is tested on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastzoo.attention.base import AttnContext


@dataclass(frozen=True)
class Seqlens:
    """The offsets a varlen kernel takes (``flash_attn_varlen_func``'s four arguments): the
    queries' and the keys' int32 ``[N+1]`` offsets and longest sequences. Self-attention
    shares one set (``cu_k is cu_q``); with a KV cache the keys have their own."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    def kwargs(self) -> dict:
        """The varlen kernels' keywords: ``cu_seqlens``, ``max_seqlen`` and the keys' own
        ``cu_seqlens_k``, ``max_seqlen_k`` (None for self-attention)."""
        own = self.cu_k is not self.cu_q
        return dict(cu_seqlens=self.cu_q, max_seqlen=self.max_q,
                    cu_seqlens_k=self.cu_k if own else None, max_seqlen_k=self.max_k if own else None)


def seqlens(ctx: AttnContext, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor) -> Seqlens:
    """The offsets of this call; computed by the first layer of a forward and reused by the
    others (``ctx.cached``)."""
    B, _, Sq, _ = q_BHSD.shape
    Sk = k_BHSD.shape[-2]
    return ctx.cached(("seqlens", B, Sq, Sk, q_BHSD.device), lambda: _seqlens(ctx, B, Sq, Sk, q_BHSD.device))


def _seqlens(ctx: AttnContext, B: int, Sq: int, Sk: int, device) -> Seqlens:
    if ctx.cu_seqlens is None:  # a plain batch: B sequences of Sq queries and Sk keys each
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=device) * Sq
        return Seqlens(cu_q, cu_q if Sk == Sq else torch.arange(B + 1, dtype=torch.int32, device=device) * Sk, Sq, Sk)
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences come as one row [1, H, T, D], got batch size {B}")
    cu_q, max_q = _offsets(ctx.cu_seqlens, ctx.max_seqlen, device)
    if ctx.cu_seqlens_k is None:
        return Seqlens(cu_q, cu_q, max_q, max_q)
    cu_k, max_k = _offsets(ctx.cu_seqlens_k, ctx.max_seqlen_k, device)
    return Seqlens(cu_q, cu_k, max_q, max_k)


def _offsets(cu_seqlens: torch.Tensor, max_seqlen: int | None, device) -> tuple[torch.Tensor, int]:
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
    if max_seqlen is not None:  # as given by the data pipeline; else read it (one device sync)
        return cu_seqlens, int(max_seqlen)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def to_THD(x_BHSD: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B*S, H, D]``, the layout varlen kernels take (a view for B == 1)."""
    return x_BHSD.transpose(1, 2).flatten(0, 1)


def from_THD(x_THD: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`to_THD`: ``[B*S, H, D]`` -> ``[B, H, S, D]`` (S given by the size: T may be 0)."""
    return x_THD.reshape(batch, x_THD.shape[0] // batch, *x_THD.shape[1:]).transpose(1, 2)


@dataclass
class Unpadded:
    """Where the real tokens of a padded batch went."""

    indices: torch.Tensor  # [T] flat positions (b * S + s) of the real tokens
    cu_seqlens: torch.Tensor  # [N+1] int32 offsets of the non-empty rows' tokens in the packed layout
    max_seqlen: int
    batch: int
    seqlen: int


def mask_sizes(key_padding_mask_BS: torch.Tensor) -> torch.Tensor:
    """``[3]`` int64 on the mask's device: real tokens, non-empty rows, longest row. A caller
    that reads other numbers from the device can stack these with them and read once."""
    lengths_B = key_padding_mask_BS.sum(dim=1)
    return torch.stack([lengths_B.sum(), (lengths_B > 0).sum(), lengths_B.max()])


def unpad(
    key_padding_mask_BS: torch.Tensor, *xs_BS: torch.Tensor, sizes: tuple[int, int, int] | None = None
) -> tuple[Unpadded, list[torch.Tensor]]:
    """Pack the real tokens (mask True) of each ``[B, S, ...]`` tensor into ``[T, ...]``, one
    sequence per non-empty row, in order.

    The kernels take ``max_seqlen`` as a Python int, so the sizes (:func:`mask_sizes`) are read
    on the host: one device sync, or none if the caller passes ``sizes`` it already read.
    """
    if key_padding_mask_BS.dtype != torch.bool or key_padding_mask_BS.ndim != 2:
        raise ValueError(
            f"key_padding_mask must be a [B, S] bool tensor, got {key_padding_mask_BS.dtype} {tuple(key_padding_mask_BS.shape)}"
        )
    B, S = key_padding_mask_BS.shape
    if sizes is None:
        sizes = mask_sizes(key_padding_mask_BS).tolist() if key_padding_mask_BS.numel() else (0, 0, 0)
    tokens, rows, longest = sizes
    lengths_B = key_padding_mask_BS.sum(dim=1, dtype=torch.int32)
    # an all-padding row is no sequence (kernels may refuse empty ones); static sizes: no sync
    lengths_N = lengths_B[torch.nonzero_static(lengths_B, size=rows).squeeze(1)]
    cu_seqlens = torch.nn.functional.pad(lengths_N.cumsum(0, dtype=torch.int32), (1, 0))
    indices = torch.nonzero_static(key_padding_mask_BS.flatten(), size=tokens).squeeze(1)
    info = Unpadded(indices, cu_seqlens, longest, B, S)
    return info, [x.reshape(B * S, *x.shape[2:]).index_select(0, indices) for x in xs_BS]


def repad(x_T: torch.Tensor, info: Unpadded) -> torch.Tensor:
    """Inverse of :func:`unpad` for one tensor: ``[T, ...]`` -> ``[B, S, ...]``, zeros at padding."""
    out = x_T.new_zeros(info.batch * info.seqlen, *x_T.shape[1:])
    out = out.index_copy(0, info.indices, x_T)  # out-of-place, so autograd flows back to x_T
    return out.view(info.batch, info.seqlen, *x_T.shape[1:])
