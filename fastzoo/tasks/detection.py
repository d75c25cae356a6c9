"""Object detection (DETR): images (with a pixel mask) -> per-query class logits
and boxes, trained with a set-prediction loss. Compared with the original (transformers'
``DetrForObjectDetection``) on random images whose pixel masks cut each a different width, so the
encoder's key padding is exercised; the class logits are compared, and every gradient behind
them. The tour times a DETR training step (set loss included) against transformers' model."""
from __future__ import annotations

import torch

from fastzoo.tasks.task import Inputs, Task


def example_inputs(model, batch, gen, caps, notes):
    """Image i keeps its left ``side - 16 (i mod 3)`` columns; the rest is padding (a batch of
    images of different sizes), named by ``pixel_mask`` as transformers' image processors do. ``side``: 64,
    or the model's ``min_image_side`` where larger (a multi-scale detector's every level keeps two positions)."""
    side = max(64, getattr(model, "min_image_side", 0))
    images = torch.randn(batch, 3, side, side, generator=gen)
    mask = torch.ones(batch, side, side, dtype=torch.long)
    for i in range(batch):
        mask[i, :, side - 16 * (i % 3):] = 0
    inputs = Inputs((images,), {"pixel_mask": mask}, float_args=True)
    yield "", inputs, inputs


DETECTION = Task(
    name="detection",
    description="images -> class logits and boxes per query (set prediction)",
    inputs=example_inputs,
    tour="fastzoo.bench.detection:tour_entry",  # a training step against the original (loss and gradients)
    parity={"digits_canvas": "fastzoo.accuracy.parity:Canvas"},
    # a part of its training step (the whole set loss is a declared loss: fastzoo bench set_prediction)
    suites={"matcher": "fastzoo.bench.matcher",  # the Hungarian matcher alone vs DETR's batch-wide cost
            # multi-scale deformable attention (Deformable DETR, RT-DETR): fused kernels vs transformers' grid_sample
            "deformable_attention": "fastzoo.bench.deformable"},
    train_script="scripts/finetune_detection.py",
)
