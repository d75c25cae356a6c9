"""Tasks: one file per task, each a :class:`Task` that a family's spec names. ``TASKS`` is their
order in tables and the tour."""
from fastzoo.tasks.causal_lm import CAUSAL_LM
from fastzoo.tasks.detection import DETECTION
from fastzoo.tasks.image_classification import IMAGE_CLASSIFICATION
from fastzoo.tasks.task import Inputs, Task, resolve

TASKS = (IMAGE_CLASSIFICATION, CAUSAL_LM, DETECTION)

__all__ = ["CAUSAL_LM", "DETECTION", "IMAGE_CLASSIFICATION", "Inputs", "TASKS", "Task", "resolve"]
