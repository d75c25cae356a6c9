"""Object detection (DETR, and the box detector): images -> per-query class logits and boxes, trained
with a set-prediction loss. The tour times a DETR training step against transformers' model."""
from __future__ import annotations

from fastzoo.tasks.task import Task

DETECTION = Task(
    name="detection",
    description="images -> class logits and boxes per query (set prediction)",
    compared="loss",
    tour="fastzoo.bench.detection:tour_entry",  # a training step against the original (loss and gradients)
    parity={"digits_canvas": "fastzoo.accuracy.parity:Canvas"},
    # parts of its training step: the whole set loss (matcher + terms, all decoder layers) vs transformers',
    # the Hungarian matcher alone vs DETR's batch-wide cost
    suites={"set_loss": "fastzoo.bench.set_loss", "matcher": "fastzoo.bench.matcher"},
    train_script="scripts/train_boxdet.py",
)
