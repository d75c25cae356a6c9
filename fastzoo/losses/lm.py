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
    jagged NestedTensor ``[B, j, V]`` with ``labels`` nested alike; a model's output object
    (transformers' ``CausalLMOutput...``) stands for its ``.logits``. ``reduction="mean"``
    averages over the counted targets (HF's loss); ``"sum"`` adds them (divide by the
    number of targets of a whole accumulated batch yourself).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: choose 'mean' or 'sum'")
    logits = _logits_of(logits)
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
        _check_cu_seqlens(cu_seqlens, logits.shape[1])
        starts = cu_seqlens[1:-1].long()
        targets_BS = targets_BS.clone()
        targets_BS[0, starts - 1] = ignore_index  # last token of a sequence predicts nothing
    logits_NV = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits_NV, targets_BS.flatten(), ignore_index=ignore_index, reduction=reduction)


def _logits_of(logits) -> torch.Tensor:
    """The logits tensor, read from a model output object if one was given (naming the argument otherwise)."""
    if isinstance(logits, torch.Tensor):
        return logits
    inner = getattr(logits, "logits", None)
    if isinstance(inner, torch.Tensor):
        return inner
    if hasattr(logits, "logits"):
        raise ValueError(f"logits: the {type(logits).__name__} given has logits=None (a training forward with labels "
                         "computes its loss fused with the LM head and returns no logits): use its .loss, or call the "
                         "model without labels")
    raise ValueError(f"logits must be a tensor [B, S, V] or a model output with .logits, got {type(logits).__name__}")


def _check_cu_seqlens(cu_seqlens, total: int) -> None:
    """The offsets must describe the row: 0, strictly increasing, ending at T (one host read)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        what = type(cu_seqlens).__name__ if not isinstance(cu_seqlens, torch.Tensor) else f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1] of offsets, got {what}")
    if torch.compiler.is_compiling():
        return
    first, last, shortest = torch.stack([cu_seqlens[0], cu_seqlens[-1], (cu_seqlens[1:] - cu_seqlens[:-1]).min()]).tolist()
    if first != 0 or last != total or shortest <= 0:
        raise ValueError(f"cu_seqlens must go 0 < ... < T={total} strictly increasing, got {cu_seqlens.tolist()}")
