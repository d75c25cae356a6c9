"""Losses: GIoU for boxes, with a reference and a fused kernel, and four layouts for
images with different box counts."""
from fastzoo.losses.giou import (
    generalized_box_iou,
    giou_loss,
    giou_loss_concat,
    giou_loss_kernel,
    giou_loss_padded,
    giou_loss_per_sample,
    kernel_path,
)

__all__ = [
    "generalized_box_iou", "giou_loss", "giou_loss_concat", "giou_loss_kernel", "giou_loss_padded",
    "giou_loss_per_sample", "kernel_path",
]
