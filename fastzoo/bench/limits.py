"""What this machine can do, measured in the same run as the figures set beside it.

A speed-up over a peer says nothing about how much is left; a share of the machine's limit does.
Every suite measures the limits here, in its own run and with its own thread count, so that a
loaded machine lowers the limit and the figure alike:

- **GEMM peak** (:func:`gemm_flops`): FLOP/s of a large square matmul (``2 n^3`` FLOPs), per dtype:
  fp32 everywhere; bf16 on a CPU with AVX512-BF16 or AMX (:func:`cpu_bf16_units`; elsewhere
  bf16 matmuls are emulated and no peak), bf16 and fp16 on CUDA. A model step's FLOPs ÷ its
  time ÷ this peak is its share of the matmul units.
- **Copy bandwidth** (:func:`copy_bandwidth`): bytes read + written per second by ``dst.copy_(src)``
  (STREAM's "copy" count), for buffers far larger than the per-core caches and for buffers that
  stay in them.
- **Autograd floor** (:func:`autograd_floor_step`): the fixed cost of one autograd call on the
  tensors a fused op takes -- clone, one elementwise op, the sum a loss ends in, backward. A
  small fused op cannot beat it: it allocates its output, its gradient, and goes through the
  engine once. The op's floor (:func:`op_floor`) is the larger of its bytes ÷ copy bandwidth
  and this cost.

:func:`measure` gathers them into a :class:`Limits`; :func:`share` expresses an achieved figure
as a fraction of a limit. Timings are medians, as the harness reports step times.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fastzoo.text import dtype_name

CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo flags of the x86 units that run bf16 matmuls natively (oneDNN uses them)
BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}


# -- arithmetic -----------------------------------------------------------------------------
def share(achieved: float, limit: float) -> float:
    """``achieved`` as a fraction of ``limit`` (0.7 = 70 % of the machine's peak)."""
    if limit <= 0 or achieved < 0:
        raise ValueError(f"need limit > 0 and achieved >= 0, got achieved={achieved}, limit={limit}")
    return achieved / limit


def gemm_flop_count(m: int, n: int, k: int) -> int:
    """FLOPs of an [m, k] @ [k, n] matmul: one multiply and one add per term."""
    return 2 * m * n * k


def rate(amount: float, seconds: float) -> float:
    """FLOP/s or bytes/s: ``amount`` done in ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return amount / seconds


def op_floor(nbytes: float, copy_bytes_per_s: float, autograd_s: float) -> float:
    """Seconds a fused op moving ``nbytes`` cannot beat: the larger of streaming its bytes at the
    copy bandwidth and one autograd call's fixed cost."""
    if nbytes < 0 or copy_bytes_per_s <= 0 or autograd_s < 0:
        raise ValueError(f"need nbytes >= 0, bandwidth > 0, autograd_s >= 0; got {nbytes}, {copy_bytes_per_s}, {autograd_s}")
    return max(nbytes / copy_bytes_per_s, autograd_s)


def si(value: float, unit: str) -> str:
    """``194e9, "FLOP/s"`` -> ``"194 GFLOP/s"`` (three significant digits)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


# -- what the hardware has -----------------------------------------------------------------
def cpu_bf16_units(cpuinfo: str | None = None) -> list[str]:
    """The CPU's native bf16 matmul units ("AMX", "AVX512-BF16"), from the ``flags`` line of
    ``/proc/cpuinfo`` (``cpuinfo``: its text, for tests); where that file does not exist, from
    torch's own probes. Empty: bf16 matmuls would be emulated, slower than fp32."""
    if cpuinfo is None and CPUINFO.exists():
        cpuinfo = CPUINFO.read_text(errors="replace")
    if cpuinfo is not None:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
        return [name for flag, name in BF16_FLAGS.items() if flag in flags]
    probes = {"AMX": "_is_amx_tile_supported", "AVX512-BF16": "_is_avx512_bf16_supported"}
    return [name for name, probe in probes.items() if getattr(torch.cpu, probe, lambda: False)()]


def peak_dtypes(device: torch.device | str) -> tuple[torch.dtype, ...]:
    """The dtypes whose GEMM peak is worth measuring here: fp32, plus bf16 where the CPU runs it
    natively; fp32, bf16 and fp16 on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.float32, torch.bfloat16, torch.float16
    return (torch.float32, torch.bfloat16) if cpu_bf16_units() else (torch.float32,)


# -- timing ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], *, reps: int, device: torch.device, calls: int = 1) -> float:
    """Median seconds of one call of ``fn``, over ``reps`` samples of ``calls`` back-to-back calls
    (several calls per sample where one is too short for the clock), after one untimed call."""
    fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def gemm_flops(device: torch.device | str, dtype: torch.dtype, *, n: int, reps: int) -> float:
    """FLOP/s of ``a @ b`` on [n, n] matrices of ``dtype`` (median of ``reps``)."""
    device = torch.device(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return rate(gemm_flop_count(n, n, n), median_seconds(lambda: torch.mm(a, b, out=out), reps=reps, device=device))


def copy_bandwidth(device: torch.device | str, nbytes: int, *, reps: int, calls: int = 1) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``nbytes`` (median of ``reps``)."""
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return rate(2 * src.numel() * 4, median_seconds(lambda: dst.copy_(src), reps=reps, device=device, calls=calls))


def autograd_floor_step(x: torch.Tensor, other: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One step of the autograd floor on ``x``'s shape and dtype: ``(leaf.clone() * other).sum()``
    and its backward, the leaf a copy of ``x`` that requires grad. Time it as a case beside the
    fused op (interleaved with it) or with :func:`median_seconds`."""
    leaf = x.detach().clone().requires_grad_(True)

    def step():
        leaf.grad = None
        loss = (leaf.clone() * other).sum()
        loss.backward()
        return loss

    return step


# -- all of them ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    """The limits measured in one run (rates per second; see the module docstring)."""

    device: str  # torch's name ("cpu", "cuda:0"); the report names the machine
    threads: int
    gemm_flops: dict[str, float]  # dtype name ("fp32", "bf16", "fp16") -> FLOP/s of a large GEMM
    gemm_size: int
    copy_bytes_per_s: float  # large buffers (beyond the per-core caches)
    copy_large_bytes: int
    copy_cached_bytes_per_s: float  # buffers that stay in cache
    copy_cached_bytes: int
    bf16_units: list[str] = field(default_factory=list)  # CPU: AMX / AVX512-BF16 ("" on CUDA)
    seconds: float = 0.0  # how long measuring took

    def gemm_peak(self, dtype: torch.dtype) -> float | None:
        """FLOP/s of a large GEMM in ``dtype``, or None where it was not measured here."""
        return self.gemm_flops.get(dtype_name(dtype))

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for a report: every limit with its setting."""
        gemm = ", ".join(f"{name} {si(v, 'FLOP/s')}" for name, v in self.gemm_flops.items())
        bf16 = f" (bf16 on {' + '.join(self.bf16_units)})" if self.bf16_units and "bf16" in self.gemm_flops else ""
        return (f"same-run limits, {self.threads} threads: GEMM {self.gemm_size}^3 {gemm}{bf16}; copy "
                f"{si(self.copy_bytes_per_s, 'B/s')} ({self.copy_large_bytes // 2**20} MiB buffers), "
                f"{si(self.copy_cached_bytes_per_s, 'B/s')} in cache ({self.copy_cached_bytes // 2**10} KiB)")


def measure(device: torch.device | str = "cpu", *, dtypes: tuple[torch.dtype, ...] | None = None,
            quick: bool = False) -> Limits:
    """The GEMM peak of each of ``dtypes`` (default :func:`peak_dtypes`) and the copy bandwidths.
    About 1 s on a 2-core CPU with ``quick`` (smaller GEMM, fewer samples), a few without."""
    device = torch.device(device)
    t0 = time.perf_counter()
    dtypes = dtypes or peak_dtypes(device)
    gpu = device.type == "cuda"
    n = (4096 if gpu else 1024) if quick else (8192 if gpu else 2048)
    gemm = {dtype_name(dt): gemm_flops(device, dt, n=n, reps=3 if quick else 5) for dt in dtypes}
    large = (256 if gpu else 64) * 2**20
    cached = 512 * 2**10  # both buffers stay in a core's L2 (or a GPU's L2)
    copy = copy_bandwidth(device, large, reps=3 if quick else 7)
    copy_cached = copy_bandwidth(device, cached, reps=5 if quick else 11, calls=50)
    return Limits(str(device), torch.get_num_threads(), gemm, n, copy, large, copy_cached, cached,
                  cpu_bf16_units() if device.type == "cpu" else [], time.perf_counter() - t0)
