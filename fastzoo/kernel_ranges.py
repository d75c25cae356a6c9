"""Named profiler ranges around fastzoo's kernel seams, for :func:`fastzoo.explain`.

A seam (an attention layer's backend call, a loss's kernel dispatch) runs inside
``record_function("fastzoo.<kind>:<name>|<requested>")`` while an explanation is being
recorded, so that the profiler's ops can be attributed to the layer or loss that ran them.
Otherwise :func:`kernel_range` is a null context: one global read, nothing recorded.
:func:`quiet_profiler` is what every fastzoo use of torch's profiler calls first.
"""
from __future__ import annotations

import contextlib
import os

from torch.profiler import record_function

PREFIX = "fastzoo."
_depth = 0  # > 0 while fastzoo.explain records


def quiet_profiler() -> None:
    """Kineto, the profiler's C++ library, logs each start and stop (``USDT: ... profiler_start``) and a
    GPU-count probe (``gpuGetDeviceCount failed``) to stderr; its log level, read when it first starts,
    above its highest (6) keeps them out. A ``KINETO_LOG_LEVEL`` the user set is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def kernel_range(kind: str, name: str, requested: str):
    """The profiler range of one seam call; ``requested``: the impl the caller asked for."""
    if not _depth:
        return contextlib.nullcontext()
    return record_function(f"{PREFIX}{kind}:{name}|{requested}")


@contextlib.contextmanager
def recording():
    """Turn the ranges on (nested uses are counted)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def parse(range_name: str) -> tuple[str, str, str] | None:
    """``(kind, name, requested)`` of a range this module named, else None."""
    if not range_name.startswith(PREFIX) or ":" not in range_name or "|" not in range_name:
        return None
    kind, rest = range_name[len(PREFIX):].split(":", 1)
    name, requested = rest.rsplit("|", 1)
    return kind, name, requested
