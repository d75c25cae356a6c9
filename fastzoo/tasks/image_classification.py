"""Image classification (ViT, ResNet): ``model(images[B, 3, H, W]) -> logits[B, num_classes]``,
compared with timm's / torchvision's original on random images; timm's and torchvision's
factories build these models, and a fresh one carries timm's ``pretrained_cfg``."""
from __future__ import annotations

import torch

from fastzoo.tasks.task import Inputs, Task


def example_inputs(model, batch, gen, caps, notes):
    cfg = model.config
    side = getattr(cfg, "img_size", None) or 64  # a convnet takes any size: 64 px keeps CPU runs short
    size = side if isinstance(side, (tuple, list)) else (side, side)
    images = Inputs((torch.randn(batch, cfg.in_chans, *size, generator=gen),), float_args=True)
    yield "", images, images


def step_flops(count, cfg, *, batch: int, img_size: int, train: bool) -> int:
    return count(cfg, batch=batch, img_size=img_size, train=train)


IMAGE_CLASSIFICATION = Task(
    name="image-classification",
    description="images -> class logits",
    inputs=example_inputs,
    step_flops=step_flops,
    factories=True,
    pretrained_cfg=True,
    bench="fastzoo.bench.image_classification:model_suite",
    bench_quick_batch=2,
    tour="fastzoo.bench.image_classification:tour_entry",
    parity={"digits": "fastzoo.accuracy.parity:Digits", "quadrant": "fastzoo.accuracy.parity:Quadrants"},
    train_script="scripts/finetune_image_classification.py",
)
