"""Detection batches for a DataLoader: images stacked, box targets collated on the CPU in
every layout the loss takes (:class:`fastzoo.losses.boxes.BoxTargets`, re-exported here with
:func:`collate_boxes`, which builds it)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fastzoo.losses.boxes import BoxTargets, collate_boxes

__all__ = ["BoxTargets", "collate_boxes", "collate_detection"]


def collate_detection(batch: Sequence[tuple], num_classes: int | None = None) -> tuple[Tensor, BoxTargets]:
    """``DataLoader(collate_fn=collate_detection)``: items are ``(image, boxes)`` or
    ``(image, boxes, labels)``; returns stacked images and :class:`BoxTargets`, validated here
    (``functools.partial(collate_detection, num_classes=C)`` checks the labels as well)."""
    images = torch.stack([item[0] for item in batch])
    labels = [item[2] for item in batch] if len(batch[0]) > 2 else None
    return images, collate_boxes([item[1] for item in batch], labels, num_classes=num_classes)
