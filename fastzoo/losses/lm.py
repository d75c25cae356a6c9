"""Next-token cross-entropy for causal language models, over real tokens only.

Labels follow Hugging Face's convention: ``labels`` is aligned with ``input_ids`` (often a
copy of it) and shifted here, so logits at position t are scored against the label at
t + 1; ``ignore_index`` (-100) marks tokens that are not targets (padding). In a packed
batch the last token of a sequence must not predict the next sequence's first token:
``cu_seqlens`` removes those pairs (``fastzoo.data.pack`` also writes -100 there), and a
jagged NestedTensor is shifted inside each sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits[..., t, :]`` against ``labels[..., t + 1]``.

    ``logits`` is ``[B, S, V]`` (padded), ``[1, T, V]`` with ``cu_seqlens`` (packed), or a
    jagged NestedTensor ``[B, j, V]`` with ``labels`` nested alike. ``reduction="mean"``
    averages over the counted targets (HF's loss); ``"sum"`` adds them (divide by the
    number of targets of a whole accumulated batch yourself).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: choose 'mean' or 'sum'")
    if logits.is_nested:
        if not labels.is_nested or not torch.equal(labels.offsets(), logits.offsets()):
            raise ValueError("labels: with NestedTensor logits, give NestedTensor labels of the same lengths")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: NestedTensor logits carry their own lengths; leave cu_seqlens None")
        cu_seqlens = logits.offsets()
        logits, labels = logits.values()[None], labels.values()[None]
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must be [B, S] for logits [B, S, V], got {tuple(labels.shape)} for {tuple(logits.shape)}")
    targets_BS = labels[:, 1:]
    if cu_seqlens is not None:
        if logits.shape[0] != 1:
            raise ValueError(f"cu_seqlens: a packed batch has batch size 1, got {logits.shape[0]}")
        starts = cu_seqlens[1:-1].long()
        targets_BS = targets_BS.clone()
        targets_BS[0, starts - 1] = ignore_index  # last token of a sequence predicts nothing
    logits_NV = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits_NV, targets_BS.flatten(), ignore_index=ignore_index, reduction=reduction)
