"""The learning-rate schedule shared by the training scripts (``--warmup-steps``) and the
accuracy-parity runs (``optim.schedule`` / ``optim.warmup_steps``): a linear warm-up to the
base rate, then the rate held constant or decayed along a half cosine to 0 at the last step
(Loshchilov & Hutter 2017, "SGDR", without restarts)."""
from __future__ import annotations

import math

import torch

DECAYS = ("constant", "cosine")


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay: str = "cosine") -> float:
    """Multiplier of the base learning rate for the update after ``step`` updates: ``(step + 1) /
    warmup_steps`` during the warm-up (the full rate at its last step), then 1 (``"constant"``) or
    ``(1 + cos(pi * progress)) / 2`` with ``progress`` going from 0 after the warm-up to 1 at
    ``total_steps`` (and staying there past it)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def warmup_schedule(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    decay: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """:func:`lr_factor` as a scheduler: call ``step()`` after each ``optimizer.step()``."""
    if decay not in DECAYS:
        raise ValueError(f"decay={decay!r}: choose one of {', '.join(DECAYS)}")
    if warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"warmup_steps and total_steps must be >= 0, got {warmup_steps} and {total_steps}")

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps, decay=decay)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
