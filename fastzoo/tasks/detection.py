"""Object detection (DETR): images (with a pixel mask) -> per-query class logits
and boxes, trained with a set-prediction loss. Compared with the original (transformers'
``DetrForObjectDetection``) on random images whose pixel masks cut each a different width, so the
encoder's key padding is exercised; the class logits are compared, and every gradient behind
them; then, with random boxes as labels, the set loss (matcher, class weights with the no-object
weight, L1 and GIoU terms and their weights) and its gradients. The tour times a DETR training step (set loss included) against transformers' model."""
from __future__ import annotations

import torch

from fastzoo.tasks.task import Inputs, Task


def example_inputs(model, batch, gen, caps, notes):
    """Image i keeps its left ``side``, ``side - 32`` or ``side - 16`` columns (i mod 3); the rest is padding
    (a batch of images of different sizes), named by ``pixel_mask`` as transformers' image processors do. The
    second image's half survives a stride-32 backbone (the tiny config's 2 x 2 feature map), so two images
    already give the encoder a key-padding mask that is not all true. ``side``: 64, or the model's
    ``min_image_side`` where larger (a multi-scale detector's every level keeps two positions)."""
    side = max(64, getattr(model, "min_image_side", 0))
    images = torch.randn(batch, 3, side, side, generator=gen)
    mask = torch.ones(batch, side, side, dtype=torch.long)
    for i in range(batch):
        mask[i, :, side - (0, 32, 16)[i % 3]:] = 0
    inputs = Inputs((images,), {"pixel_mask": mask}, float_args=True)
    yield "", inputs, inputs
    if next(model.parameters()).dtype != torch.float32:  # transformers' matcher: torch.cdist, which has no bf16 on CPU
        notes.append("set loss compared in fp32 only: transformers' DETR loss has no low-precision matcher (cdist)")
        return
    labels = [_boxes(1 + i % 3, model.config.num_labels, gen) for i in range(batch)]
    with_labels = Inputs((images,), {"pixel_mask": mask, "labels": labels}, float_args=True, output="loss")
    yield "set loss", with_labels, with_labels


def _boxes(n: int, num_labels: int, gen) -> dict:
    """``n`` random boxes (cx, cy, w, h in [0, 1]) with class labels, transformers' label format."""
    centres = 0.25 + 0.5 * torch.rand(n, 2, generator=gen)
    sizes = 0.1 + 0.3 * torch.rand(n, 2, generator=gen)
    return {"class_labels": torch.randint(0, num_labels, (n,), generator=gen), "boxes": torch.cat([centres, sizes], 1)}


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
