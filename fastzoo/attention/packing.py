"""Moving between a padded batch and packed tokens, for kernels that only take packed sequences.

FlashAttention's and xFormers' variable-length kernels take ``[T, H, D]`` tokens and
``cu_seqlens`` offsets, not a key-padding mask. :func:`unpad` gathers the real tokens of a
padded ``[B, S, H, D]`` batch (any padding pattern: left, right or holes, order kept) and
:func:`repad` scatters the kernel's output back, with zeros at padded positions. Pure
PyTorch, so it is tested on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Unpadded:
    """Where the real tokens of a padded batch went."""

    indices: torch.Tensor  # [T] flat positions (b * S + s) of the real tokens
    cu_seqlens: torch.Tensor  # [B+1] int32 offsets of each row's tokens in the packed layout
    max_seqlen: int
    batch: int
    seqlen: int


def unpad(key_padding_mask_BS: torch.Tensor, *xs_BSHD: torch.Tensor) -> tuple[Unpadded, list[torch.Tensor]]:
    """Pack the real tokens (mask True) of each ``[B, S, H, D]`` tensor into ``[T, H, D]``.

    Reads the mask's row lengths on the host (one device sync) because the kernels take
    ``max_seqlen`` as a Python int.
    """
    if key_padding_mask_BS.dtype != torch.bool or key_padding_mask_BS.ndim != 2:
        raise ValueError(
            f"key_padding_mask must be a [B, S] bool tensor, got {key_padding_mask_BS.dtype} {tuple(key_padding_mask_BS.shape)}"
        )
    B, S = key_padding_mask_BS.shape
    lengths_B = key_padding_mask_BS.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths_B.cumsum(0, dtype=torch.int32), (1, 0))
    indices = key_padding_mask_BS.flatten().nonzero().squeeze(1)
    info = Unpadded(indices, cu_seqlens, int(lengths_B.max()), B, S)
    return info, [x.reshape(B * S, *x.shape[2:]).index_select(0, indices) for x in xs_BSHD]


def repad(x_THD: torch.Tensor, info: Unpadded) -> torch.Tensor:
    """Inverse of :func:`unpad` for one tensor: ``[T, H, D]`` -> ``[B, S, H, D]``, zeros at padding."""
    out = x_THD.new_zeros(info.batch * info.seqlen, *x_THD.shape[1:])
    out = out.index_copy(0, info.indices, x_THD)  # out-of-place, so autograd flows back to x_THD
    return out.view(info.batch, info.seqlen, *x_THD.shape[1:])


def max_seqlen_of(cu_seqlens: torch.Tensor, max_seqlen: int | None) -> int:
    """``max_seqlen`` as given by the data pipeline, else read from ``cu_seqlens`` (one device sync)."""
    if max_seqlen is not None:
        return int(max_seqlen)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def to_THD(x_BHSD: torch.Tensor) -> torch.Tensor:
    """A packed batch (``B == 1``, ``S == T``) in the ``[T, H, D]`` layout varlen kernels take."""
    if x_BHSD.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need a batch of one, got batch {x_BHSD.shape[0]}")
    return x_BHSD[0].transpose(0, 1)


def from_THD(x_THD: torch.Tensor) -> torch.Tensor:
    return x_THD.transpose(0, 1).unsqueeze(0)
