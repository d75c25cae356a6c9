"""Next-token cross-entropy for causal language models, over real tokens only, and the two
rules every causal-LM loss in fastzoo shares (the model's ``labels=``, the scripts, the benchmarks):

- :data:`IGNORE_INDEX` (-100, Hugging Face's and PyTorch's convention) marks a label that is not
  a target (padding; in a packed row each sequence's first token, written by ``fastzoo.data.pack``).
- :func:`next_token_targets`, the shift: ``labels`` is aligned with ``input_ids`` (often a copy
  of it), and position t is scored against the label at t + 1. A sequence's last position
  predicts nothing: in a packed batch it must not predict the next sequence's first token, so
  ``cu_seqlens`` cuts the shift there; a jagged NestedTensor is shifted inside each sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fastzoo.losses.registry import Loss
from fastzoo.tracing import tracing

IGNORE_INDEX = -100


def next_token_targets(
    labels_BS: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``[B, S]`` targets aligned with the positions: ``labels_BS[:, t + 1]`` at position t, and
    ``ignore_index`` at each sequence's last position (each row's end, and with ``cu_seqlens`` the
    end of every sequence packed in the row)."""
    targets_BS = F.pad(labels_BS[:, 1:], (0, 1), value=ignore_index)
    if cu_seqlens is not None:
        ends = cu_seqlens[1:].long() - 1  # last token of each sequence: it predicts nothing
        targets_BS = targets_BS.index_fill(1, ends, ignore_index)
    return targets_BS


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits[..., t, :]`` against ``labels[..., t + 1]``.

    ``logits`` is ``[B, S, V]`` (padded), ``[1, T, V]`` with ``cu_seqlens`` (packed), or a
    jagged NestedTensor ``[B, j, V]`` with ``labels`` nested alike; a model's output (HF's or
    fastzoo's, anything with ``.logits``) stands for its logits. ``reduction="mean"`` averages
    over the counted targets (HF's loss); ``"sum"`` adds them (divide by the number of targets
    of a whole accumulated batch yourself).
    """
    logits = _logits_of(logits)
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
    if cu_seqlens is not None:
        if logits.shape[0] != 1:
            raise ValueError(f"cu_seqlens: a packed batch has batch size 1, got {logits.shape[0]}")
        _check_cu_seqlens(cu_seqlens, logits.shape[1])
    targets_BS = next_token_targets(labels, cu_seqlens=cu_seqlens, ignore_index=ignore_index)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets_BS.flatten(), ignore_index=ignore_index, reduction=reduction)


def _logits_of(output) -> torch.Tensor:
    """The logits tensor, also from a model's output object (``model(...)`` rather than ``model(...).logits``)."""
    if isinstance(output, torch.Tensor):
        return output
    if not hasattr(output, "logits"):
        raise TypeError(f"logits: expected a [B, S, V] tensor or a model output with .logits, got {type(output).__name__}")
    if output.logits is None:
        raise ValueError("logits: the model output holds no logits (a model called with labels= in train mode fuses "
                         "the loss with the LM head): use its .loss, or call the model without labels")
    return output.logits


def _check_cu_seqlens(cu_seqlens, total: int) -> None:
    """The offsets must describe the row: 0, strictly increasing, ending at T (one host read)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        what = type(cu_seqlens).__name__ if not isinstance(cu_seqlens, torch.Tensor) else f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1] of offsets, got {what}")
    if tracing():
        return
    first, last, shortest = torch.stack([cu_seqlens[0], cu_seqlens[-1], (cu_seqlens[1:] - cu_seqlens[:-1]).min()]).tolist()
    if first != 0 or last != total or shortest <= 0:
        raise ValueError(f"cu_seqlens must go 0 < ... < T={total} strictly increasing, got {cu_seqlens.tolist()}")


LM = Loss(
    name="lm",
    description="next-token cross-entropy of a causal LM over real tokens (padded, packed, nested)",
    functions=("causal_lm_loss",),
    impls={"torch": "F.cross_entropy on the shifted targets"},
    kernel_ops=r"cross_entropy|nll_loss|log_softmax",
)

