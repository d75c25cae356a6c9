"""Running means that live on the training device.

``update`` only adds device tensors, so a training step never waits for the device;
``compute`` is the one place that synchronises (and all-reduces across processes), and
it is called only when a value is printed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class RunningMeans:
    """Sums and counts per name since the last :meth:`compute`, kept as device tensors."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def update(self, name: str, value_sum: torch.Tensor, count: torch.Tensor | float = 1.0) -> None:
        """Add ``value_sum`` over ``count`` items (both may be device tensors; no sync)."""
        value_sum = value_sum.detach().float()
        count = torch.as_tensor(count, dtype=torch.float32, device=self.device)
        if name not in self._sums:
            self._sums[name] = torch.zeros((), device=self.device)
            self._counts[name] = torch.zeros((), device=self.device)
        self._sums[name] += value_sum
        self._counts[name] += count

    def compute(self, reset: bool = True) -> dict[str, float]:
        """Mean of each name over every process since the last reset (this synchronises)."""
        if not self._sums:
            return {}
        names = sorted(self._sums)
        packed = torch.stack([self._sums[n] for n in names] + [self._counts[n] for n in names])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed)
        values = packed.tolist()  # the single host sync
        k = len(names)
        out = {n: values[i] / values[k + i] if values[k + i] else float("nan") for i, n in enumerate(names)}
        out.update({f"{n}_count": values[k + i] for i, n in enumerate(names)})
        if reset:
            self._sums.clear()
            self._counts.clear()
        return out
