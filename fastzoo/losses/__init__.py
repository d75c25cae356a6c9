"""Losses with a reference definition and, where it pays, faster implementations:
GIoU for boxes (four layouts for images with different box counts, and a fused kernel)
the causal LM loss for padded, packed and nested batches, and a fused linear cross-entropy
for the LM head that never materialises the logits. Each loss declares itself (:class:`Loss`:
its implementations, kernel ops, bench suite); :func:`get_loss` / :func:`register_loss` find and
add declarations."""
from fastzoo.losses.giou import (
    generalized_box_iou,
    giou_loss,
    giou_loss_concat,
    giou_loss_kernel,
    giou_loss_padded,
    giou_loss_per_sample,
    kernel_build_needed,
    kernel_path,
)
from fastzoo.losses.linear_ce import linear_cross_entropy
from fastzoo.losses.lm import IGNORE_INDEX, causal_lm_loss, next_token_targets
from fastzoo.losses.registry import Loss, get_loss, list_losses, losses, register_loss

__all__ = [
    "IGNORE_INDEX", "Loss", "causal_lm_loss", "generalized_box_iou", "get_loss", "giou_loss", "giou_loss_concat",
    "giou_loss_kernel", "giou_loss_padded", "giou_loss_per_sample", "kernel_build_needed", "kernel_path", "linear_cross_entropy", "list_losses",
    "losses", "next_token_targets", "register_loss",
]
