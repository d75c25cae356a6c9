"""Batching token sequences for a causal LM: padded, packed, or nested.

- :func:`pad_to_longest` / :func:`pad_to_max`: ``[B, S]`` ids + ``attention_mask`` +
  ``position_ids`` (counting real tokens, so left padding keeps each sequence at 0, 1, ...)
  + ``labels`` (``IGNORE_INDEX``, -100, on padding).
- :func:`pack`: one row ``[1, T]`` with ``cu_seqlens`` (int32 offsets), ``max_seqlen``,
  ``position_ids`` restarting at 0 per sequence, and ``labels`` with -100 on each
  sequence's first token, so that the usual shift-by-one never scores a token of one
  sequence as the continuation of another.
- :func:`nested`: a jagged NestedTensor ``[B, j]`` of ids.
- :func:`pack_stream`: fills a token budget from a stream of sequences, batch after batch.

Batches feed the model as ``model(**batch.model_inputs())`` and the loss as
``causal_lm_loss(logits, batch.labels)``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from fastzoo.losses.lm import IGNORE_INDEX


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S] 1 = token, 0 = padding
    position_ids: torch.Tensor  # [B, S]
    labels: torch.Tensor  # [B, S] input_ids with IGNORE_INDEX on padding

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    def to(self, device) -> "PaddedBatch":
        return PaddedBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids, self.labels)))


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], 0 at each sequence's start
    cu_seqlens: torch.Tensor  # [N+1] int32: sequence n is input_ids[0, cu[n]:cu[n+1]]
    max_seqlen: int
    labels: torch.Tensor  # [1, T] input_ids with IGNORE_INDEX on each sequence's first token

    def model_inputs(self) -> dict:
        return {
            "input_ids": self.input_ids, "position_ids": self.position_ids,
            "cu_seqlens": self.cu_seqlens, "max_seqlen": self.max_seqlen,
        }

    def to(self, device) -> "PackedBatch":
        return PackedBatch(
            self.input_ids.to(device), self.position_ids.to(device), self.cu_seqlens.to(device),
            self.max_seqlen, self.labels.to(device),
        )


def _as_tensors(seqs) -> list[torch.Tensor]:
    out = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
    if not out:
        raise ValueError("seqs is empty: give at least one sequence")
    for i, s in enumerate(out):
        if s.ndim != 1 or s.numel() == 0:
            raise ValueError(f"seqs[{i}] must be a non-empty 1-D sequence of token ids, got shape {tuple(s.shape)}")
    return out


def pad_to_max(seqs: Sequence, max_length: int, *, pad_id: int = 0, side: str = "right") -> PaddedBatch:
    """Pad every sequence to ``max_length`` tokens (fixed shapes, e.g. for torch.compile)."""
    tensors = _as_tensors(seqs)
    longest = max(len(s) for s in tensors)
    if longest > max_length:
        raise ValueError(f"max_length={max_length} is shorter than the longest sequence ({longest} tokens)")
    return _pad(tensors, max_length, pad_id, side)


def pad_to_longest(seqs: Sequence, *, pad_id: int = 0, side: str = "right") -> PaddedBatch:
    """Pad every sequence to the longest one's length."""
    tensors = _as_tensors(seqs)
    return _pad(tensors, max(len(s) for s in tensors), pad_id, side)


def _pad(tensors: list[torch.Tensor], length: int, pad_id: int, side: str) -> PaddedBatch:
    if side not in ("right", "left"):
        raise ValueError(f"side={side!r}: choose 'right' or 'left'")
    ids = torch.full((len(tensors), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(tensors), length), dtype=torch.long)
    for i, s in enumerate(tensors):
        span = slice(0, len(s)) if side == "right" else slice(length - len(s), length)
        ids[i, span] = s
        mask[i, span] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return PaddedBatch(ids, mask, position_ids, labels)


def pack(seqs: Sequence) -> PackedBatch:
    """Concatenate sequences into one row with the metadata varlen attention needs."""
    tensors = _as_tensors(seqs)
    lengths = torch.tensor([len(s) for s in tensors])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    ids = torch.cat(tensors)
    position_ids = torch.cat([torch.arange(n) for n in lengths.tolist()])
    labels = ids.clone()
    labels[cu_seqlens[:-1].long()] = IGNORE_INDEX
    return PackedBatch(ids[None], position_ids[None], cu_seqlens, int(lengths.max()), labels[None])


def nested(seqs: Sequence) -> torch.Tensor:
    """A jagged NestedTensor ``[B, j]`` of token ids (labels: the same tensor)."""
    tensors = _as_tensors(seqs)
    offsets = torch.nn.functional.pad(torch.tensor([len(s) for s in tensors]).cumsum(0), (1, 0))
    return torch.nested.nested_tensor_from_jagged(torch.cat(tensors), offsets=offsets)


def pack_stream(seqs: Iterable, max_tokens: int) -> Iterator[PackedBatch]:
    """Greedily pack a stream of sequences into batches of at most ``max_tokens`` tokens,
    keeping their order. A sequence longer than ``max_tokens`` is cut into pieces of
    ``max_tokens`` (each piece is its own sequence: positions restart at 0)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    current, used = [], 0
    for seq in seqs:
        for piece in _as_tensors([seq])[0].split(max_tokens):
            if used + len(piece) > max_tokens:
                yield pack(current)
                current, used = [], 0
            current.append(piece)
            used += len(piece)
    if current:
        yield pack(current)
