"""Whether this thread's Python is being traced into a graph (``torch.compile``'s dynamo, ``torch.export``),
the one question behind every "no host read, no lock, no pin while traced" branch in fastzoo.

Not ``torch.compiler.is_compiling()``: that also reads a process-wide flag, which an uncompiled
FlexAttention call sets while it traces its own kernel, so a forward running in another thread
at that moment read True and took the traced path in eager mode (skipped its input checks, its
SDPA flags lock and its backend pin; flex refused itself as compiled flex on CPU).
"""
from __future__ import annotations

import torch


def tracing() -> bool:
    """True while dynamo traces the calling code or ``torch.export`` exports it; False in eager,
    whatever other threads do."""
    return torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()
