"""Object detection (the box detector): images -> per-query class logits and boxes, trained with
a set-prediction loss. No original to compare with yet; the tour times its GIoU loss."""
from __future__ import annotations

from fastzoo.tasks.task import Task

DETECTION = Task(
    name="detection",
    description="images -> class logits and boxes per query (set prediction)",
    tour="fastzoo.bench.giou:tour_entry",
    parity={"digits_canvas": "fastzoo.accuracy.parity:Canvas"},
    # parts of its training step: the whole set loss (matcher + terms, all decoder layers) vs transformers',
    # the Hungarian matcher alone vs DETR's batch-wide cost
    suites={"set_loss": "fastzoo.bench.set_loss", "matcher": "fastzoo.bench.matcher"},
    train_script="scripts/train_boxdet.py",
)
