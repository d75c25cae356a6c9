"""Training utilities shared by the scripts in ``scripts/``: the loop (``loop``), sync-free
metrics (``metrics``), the progress bar (``progress``), checkpoints (``checkpoint``), RNG
capture (``rng``), NaN capture and replay (``nan_guard``), torchrun/DDP/FSDP2
(``distributed``) and the shared command line (``cli``)."""
from fastzoo.train.cli import UsageError, parse_args, run_main, train_parser
from fastzoo.train.loop import Task, setup, train

__all__ = ["Task", "UsageError", "parse_args", "run_main", "setup", "train", "train_parser"]
