"""What this machine can do at best, measured in the same run as the figures set beside it.

A model step's achieved FLOP/s means little alone; divided by the FLOP/s of one large matrix
multiply in the same precision, timed on the same machine minutes apart, it says how much of
the machine the step used (a training step is mostly GEMMs: their peak is its ceiling).
"""
from __future__ import annotations

import torch

from fastzoo.text import dtype_name

GEMM_SIDE = {"cpu": 2048, "cuda": 8192}  # large enough to reach the peak, small enough to time in about a second


def gemm_flops(dtype: torch.dtype, device="cpu", *, iters: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (median of ``iters`` after one warm-up)."""
    from fastzoo.bench.harness import measure, summarize

    device = torch.device(device)
    n = GEMM_SIDE.get(device.type, 2048)
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    seconds = summarize(measure(lambda: torch.mm(a, b), warmup=1, iters=iters, device=device)).median
    return 2 * n**3 / seconds


def gemm_peaks(dtypes, device="cpu") -> dict[str, float]:
    """Precision name ("fp32", "bf16") -> same-run GEMM FLOP/s, for ``run_suite(peaks=...)``."""
    return {dtype_name(d): gemm_flops(d, device) for d in dict.fromkeys(dtypes)}
