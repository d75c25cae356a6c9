"""Object detection (the box detector): images -> per-query class logits and boxes, trained with
a set-prediction loss. No original to compare with yet; the tour times its GIoU loss."""
from __future__ import annotations

from fastzoo.tasks.task import Task

DETECTION = Task(
    name="detection",
    description="images -> class logits and boxes per query (set prediction)",
    tour="fastzoo.bench.giou:tour_entry",
    parity={"digits_canvas": "fastzoo.accuracy.parity:Canvas"},
    suites={"matcher": "fastzoo.bench.matcher"},  # the Hungarian matcher of its set loss, per training step
    train_script="scripts/train_boxdet.py",
)
