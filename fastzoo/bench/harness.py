"""One timing harness for every suite: parity first, then warm-up and the median of N runs.

A suite is a list of :class:`Group` s (one setting: a model config, eval or train,
compiled or not); each group holds :class:`Case` s (a backend, or the peer library the
user would pick instead). For each case the harness

1. builds it (a backend this machine cannot run is reported ``unavailable`` with the reason),
2. compares its outputs and gradients with the group's fp32 eager reference on identical
   weights (:func:`fastzoo.equivalence.compare_cases`, the rule of ``fastzoo check``; with the
   original's run on its users' kernels, ``Group.kernels``, its own fp32 error widens the fp32 bounds
   parameter by parameter as the rule says; with its fp64 outputs, ``Group.exact``: an fp32 case against
   them within 3x the original fp32 runs' own error from them, worst over every gradient, flash-attn's
   rule one precision up); a case that fails is reported and *not timed*,
3. runs ``warmup`` untimed steps (compilation happens here; the parity pass, one full
   step, counts as the first), then ``iters`` timed steps:
   CUDA events on GPU, ``time.perf_counter`` on CPU; reports median and min-max,
   throughput (items per second at the median) and peak memory
   (``torch.cuda.max_memory_allocated`` on GPU; ``n/a`` on CPU, where PyTorch keeps no
   allocator statistics and process RSS would mostly measure other things),
4. divides the peer's median step time by the case's: the speed-up vs the peer, timed in
   the same run, so that a loaded machine shifts both sides alike; and the original's under
   the group's own recipe by the case's (``vs_original``: ``Case(original=True)``);
5. sets each figure beside the machine's limit, where the suite measured them
   (:mod:`fastzoo.bench.limits`, same run): a step that declares its FLOPs gets its FLOP/s as a
   share of the GEMM peak in its precision; one that declares its bytes, its bytes/s as a share of
   the copy bandwidth; in a group with a floor case (``Case(floor=True)``: one autograd call
   on the same tensors, timed with the others) every row gets its time ÷ the floor's; and a case
   doing less work than the peer (packed sequences: no padding) gets the FLOP-ratio bound of
   its speed-up (the peer's FLOPs ÷ its own).
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from fastzoo.bench.limits import Limits, rate
from fastzoo.bench.limits import share as share_of
from fastzoo.bench.report import SPREAD_LIMIT, Report, Row, reliability  # noqa: F401 (the rule, re-exported)
from fastzoo.equivalence import compare_cases
from fastzoo.errors import BackendUnavailableError
from fastzoo.machine import device_name, load_average, versions
from fastzoo.text import dtype_name


class Unavailable(Exception):
    """A case this machine or this checkout cannot run; the message says what it needs."""


# -- statistics ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    n: int


def summarize(samples: list[float]) -> Stats:
    """Median and range of step times in seconds."""
    if not samples:
        raise ValueError("samples is empty: time at least one step")
    return Stats(statistics.median(samples), min(samples), max(samples), len(samples))


def speedup(peer_seconds: float, case_seconds: float) -> float:
    """How many times faster the case is than the peer (>1: faster)."""
    if peer_seconds <= 0 or case_seconds <= 0:
        raise ValueError(f"step times must be positive, got peer={peer_seconds}, case={case_seconds}")
    return peer_seconds / case_seconds


def measure(fn: Callable[[], object], *, warmup: int, iters: int, device: torch.device) -> list[float]:
    """Seconds per call of ``fn`` after ``warmup`` untimed calls."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) / 1e3 for s, e in events]
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


# -- suite description ------------------------------------------------------------------------
@dataclass
class Step:
    """A built case: ``run`` is one timed step; ``outputs`` returns what parity compares
    ("output" and "grad:<param>" tensors); ``items`` counts images or real tokens per step."""

    run: Callable[[], object]
    items: float
    outputs: Callable[[], dict] | None = None
    flops: float | None = None  # FLOPs of one step (the work, counted from the shapes): FLOP/s vs the GEMM peak
    bytes: float | None = None  # bytes one step must move at least: bytes/s vs the copy bandwidth


@dataclass
class Case:
    label: str
    build: Callable[[], Step]
    peer: bool = False  # the library the user would pick instead; speed-ups are against it
    reference: bool = False  # the eager model in the run dtype (sets the low-precision tolerance)
    compiled: bool = False
    same_names: bool = True  # parameter names equal the reference's (False: a peer library naming its own)
    floor: bool = False  # the group's floor (limits.autograd_floor_step), not a competitor: rows get time ÷ its time
    original: bool = False  # the original library under the group's recipe: the "same recipe" speed-ups are against it
    dtype: torch.dtype | None = None  # this case's precision when not the group's (the fp32 peer of a bf16 group)


@dataclass
class Group:
    name: str
    cases: list[Case]
    reference: Callable[[], dict] | None = None  # fp32 eager outputs on the same weights and inputs
    unit: str = "images/s"
    # the original's fp64 outputs (an fp32 group): where its own fp32 error is as large as a port's could be
    # (bilinear sampling's gradient jumps at cell edges), each fp32 case is compared with them instead
    exact: Callable[[], dict] | None = None
    # the original's fp32 outputs on the kernels its users get (transformers' SDPA) beside ``reference``'s: the
    # worse of its own fp32 runs sets the bound (with ``exact``: each run's error from the fp64 one)
    kernels: Callable[[], dict] | None = None
    dtype: torch.dtype | None = None  # the precision this group runs in; None: the suite's
    cpu_memory: bool = False  # on CPU, report each case's peak memory (cpu_peak_bytes: one extra profiled step)


@dataclass
class Suite:
    name: str
    groups: list[Group]
    config: dict = field(default_factory=dict)  # stated in every output
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    skipped: str | None = None  # the whole suite cannot run here; says what it needs
    limits: Limits | None = None  # measured in this run (limits.measure): the rows' shares of them
    interleave: bool = False  # time each group's cases in rounds (run_suite's interleave), whoever runs it


# -- running --------------------------------------------------------------------------------
def run_suite(suite: Suite, *, warmup: int = 2, iters: int = 10, progress: bool = True, note: str = "", bar=None,
              interleave: bool = False) -> Report:
    """Parity-gate and time every case of ``suite``; see the module docstring.

    ``bar``: a tqdm bar to advance instead of a new one (a run of several suites, one bar).
    ``interleave``: time a group's cases in rounds (one step of each case per round) instead
    of one case after the other, so that a burst of load from elsewhere on a shared CPU slows
    every case of the round alike instead of one case's whole measurement. Each case is still
    built and parity-checked first; peak memory is not reported (the cases are alive together).
    """
    from contextlib import nullcontext

    from tqdm.auto import tqdm

    dtype_text = dtype_name(suite.dtype)
    report = Report(suite.name, device_name(suite.device), dtype_text, suite.config, warmup, iters, versions(),
                    torch.get_num_threads(), [], suite.skipped, note,
                    suite.limits.to_dict() if suite.limits is not None else None)
    interleave = interleave or suite.interleave
    if suite.skipped:
        return report
    report.load, report.cores = [load_average()], os.cpu_count() or 1
    total = sum(len(g.cases) for g in suite.groups)
    own = bar is None
    if own:
        bar = tqdm(total=total, desc=suite.name, disable=not progress, leave=False, dynamic_ncols=True)
    with bar if own else nullcontext():
        for group in suite.groups:
            bar.set_postfix_str(f"{group.name}: reference")
            with true_fp32():
                ref = group.reference() if group.reference is not None else None
                exact = group.exact() if group.exact is not None else None
                kernels = group.kernels() if group.kernels is not None else None
            ref_in_dtype = []  # the reference cases' outputs: the original on each of its kernels in the run dtype
            rows, pending = [], []
            for case in sorted(group.cases, key=lambda c: not c.reference):  # reference first: it sets the tolerance
                bar.set_postfix_str(f"{group.name}: {case.label}")
                row, got, step, warm = _prepare_case(case, group, ref, ref_in_dtype, suite, warmup, exact, kernels)
                if case.reference and got is not None:
                    ref_in_dtype.append(got)
                rows.append(row)
                if step is not None and group.cpu_memory and suite.device.type == "cpu":
                    peak = _guarded(row, suite, lambda: cpu_peak_bytes(step.run))
                    row.peak_mem_mib = peak / 2**20 if peak is not None else None
                if step is None:
                    bar.update(1)
                elif interleave:
                    pending.append((row, step, warm))
                else:
                    _guarded(row, suite, lambda: _time_case(row, step, warm, iters, suite.device))
                    bar.update(1)
                    del step
                    gc.collect()
            if pending:
                bar.set_postfix_str(f"{group.name}: timing {len(pending)} cases in rounds")
                _time_interleaved(pending, iters, suite)
                bar.update(len(pending))
                pending.clear()
                gc.collect()
            order = {c.label + str(c.compiled): i for i, c in enumerate(group.cases)}
            rows.sort(key=lambda r: order[r.label + str(r.compiled)])
            _fill_speedups(rows)
            _fill_limits(rows, suite.limits)
            report.rows += rows
    report.load.append(load_average())
    judge(report.rows, report.load, report.cores)
    return report


def judge(rows: list[Row], load: list[float], cores: int) -> None:
    """Each timed row's :func:`reliability` against its group's peer (the peer's own: its rounds)."""
    for r in rows:
        if r.median_s is not None:
            peer = next((p for p in rows if p.peer and p.group == r.group and p is not r), None)
            r.unreliable = reliability(r, peer, load, cores)


@contextlib.contextmanager
def true_fp32():
    """Parity outputs in fp32 proper: TF32 off for CUDA matmuls and cuDNN convolutions (cuDNN's default
    is on, and two orders of TF32 rounding differ by ~1e-4 on a gradient), restored afterwards. Timing
    keeps the process's settings."""
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv


def _prepare_case(case, group, ref, ref_in_dtype, suite, warmup, exact=None, kernels=None):
    """Build the case and gate it on parity: (row, its outputs, the step to time or None, warm-up left)."""
    row = Row(group.name, case.label, case.compiled, "ok", peer=case.peer, unit=group.unit, floor=case.floor,
              precision=dtype_name(case.dtype or group.dtype or suite.dtype), original=case.original)
    try:
        step = case.build()
    except (Unavailable, BackendUnavailableError) as e:
        row.status, row.note = "unavailable", str(e)
        return row, None, None, 0
    except Exception as e:  # reported, not hidden: the CLI exits non-zero
        row.status, row.note = "error", f"{type(e).__name__}: {e}"
        return row, None, None, 0
    got = None

    def gate():
        nonlocal got
        parity_ran = ref is not None and step.outputs is not None
        if parity_ran:
            t0 = time.perf_counter()
            with true_fp32():
                got = step.outputs()
            row.first_step_s = time.perf_counter() - t0 if case.compiled else None
            low = (group.dtype or suite.dtype) != torch.float32
            peer = ([got] if case.reference else ref_in_dtype) if low else None
            if low and not peer:
                raise Unavailable("low-precision parity needs the eager reference case in this group")
            if exact is not None and not low:  # flash-attn's rule one precision up, over all gradients together:
                # bilinear sampling's kinks move a different parameter's gradient in each fp32 run, so one run's
                # per-parameter error bounds no other run's; the original's runs' worst error over all of them does
                own = [got] if case.reference else [ref] + ([kernels] if kernels is not None else [])
                comps = compare_cases(exact, got, own, same_names=case.same_names)
            else:
                comps = compare_cases(ref, got, peer, same_names=case.same_names, kernels=kernels)
            row.max_err, row.out_bound = comps[0].err, comps[0].bound
            row.grad_err, row.grad_bound = (comps[1].err, comps[1].bound) if len(comps) > 1 else (None, None)
            failed = [c for c in comps if not c.passed]
            if failed:
                row.status = "failed parity"
                row.note = "not timed: " + "; ".join(f"{c.name} error {c.err:.2g} > {c.bound:.2g}" for c in failed)
                return False
        return True

    passed = _guarded(row, suite, gate)
    if not passed or row.status != "ok":
        return row, got, None, 0
    warm = max(warmup - 1, 0) if (ref is not None and step.outputs is not None) else warmup  # the parity pass was a full step
    return row, got, step, warm


def _guarded(row: Row, suite: Suite, fn):
    """Run ``fn``; an unavailable kernel, out-of-memory or any other exception becomes the row's status."""
    try:
        return fn()
    except (Unavailable, BackendUnavailableError) as e:
        row.status, row.note = "unavailable", str(e)
    except torch.OutOfMemoryError as e:  # a result, not a bug: eager attention at long sequence lengths
        row.status, row.note = "out of memory", str(e).splitlines()[0]
        torch.cuda.empty_cache()
    except Exception as e:
        row.status, row.note = "error", f"{type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def native_stderr_silenced():
    """File descriptor 2 to the null device while the memory profiler runs: c10's CPU allocator writes
    from C++ straight to fd 2, where no Python filter reaches, that a block allocated before profiling
    has no size ("Memory block of unknown size was allocated before the profiling started"), which
    says nothing about the run. An error still raises, after fd 2 is back."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes held by tensors that ``fn`` allocates on the CPU, above what existed before: the
    running sum of the profiler's allocation and free events (``profile_memory=True``), i.e.
    what ``torch.cuda.max_memory_allocated`` measures on a GPU. Tensors only: no Python objects,
    no allocator caching or fragmentation (RSS would add those and whatever else the process holds)."""
    from torch.profiler import ProfilerActivity, profile

    from fastzoo.kernel_ranges import quiet_profiler

    quiet_profiler()
    with native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch._C._autograd.DeviceType.CPU
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _record(row: Row, samples: list[float], step: Step) -> None:
    stats = summarize(samples)
    row.median_s, row.min_s, row.max_s, row.iters = stats.median, stats.min, stats.max, stats.n
    row.throughput = step.items / stats.median
    row.flop_rate = rate(step.flops, stats.median) if step.flops is not None else None
    row.byte_rate = rate(step.bytes, stats.median) if step.bytes is not None else None


def _time_case(row: Row, step: Step, warm: int, iters: int, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    _record(row, measure(step.run, warmup=warm, iters=iters, device=device), step)
    if device.type == "cuda":
        row.peak_mem_mib = torch.cuda.max_memory_allocated(device) / 2**20


def _time_interleaved(pending: list, iters: int, suite: Suite) -> None:
    live = []
    for row, step, warm in pending:
        if _guarded(row, suite, lambda: measure(step.run, warmup=max(warm - 1, 0), iters=1, device=suite.device)) is not None:
            live.append((row, step, []))
    for _ in range(iters):
        for row, step, samples in live:
            if row.status == "ok":
                got = _guarded(row, suite, lambda: measure(step.run, warmup=0, iters=1, device=suite.device))
                if got is not None:
                    samples.extend(got)
    for row, step, samples in live:
        if row.status == "ok" and samples:
            _record(row, samples, step)


def _fill_speedups(rows: list[Row]) -> None:
    """Speed-ups vs the peer, and vs the original under the group's recipe."""
    for flag, attr in (("peer", "speedup"), ("original", "vs_original")):
        base = next((r for r in rows if getattr(r, flag) and r.median_s is not None), None)
        for r in rows:
            if base is not None and r.median_s is not None:
                setattr(r, attr, speedup(base.median_s, r.median_s))


def _fill_limits(rows: list[Row], limits: Limits | None) -> None:
    """Each timed row beside the limits: time ÷ the group's floor row; FLOP/s and bytes/s as
    shares of the same-run GEMM peak (in the row's precision) and copy bandwidth; the peer's
    FLOPs ÷ the row's (the FLOP-ratio bound of its speed-up)."""
    floor = next((r for r in rows if r.floor and r.median_s is not None), None)
    peer = next((r for r in rows if r.peer and r.flop_rate is not None), None)
    for r in rows:
        if r.median_s is None:
            continue
        if floor is not None:
            r.vs_floor = r.median_s / floor.median_s
        peak = limits.gemm_flops.get(r.precision) if limits is not None else None
        if r.flop_rate is not None and peak is not None:
            r.flop_share = share_of(r.flop_rate, peak)
        if r.flop_rate is not None and peer is not None:
            r.work_bound = (peer.flop_rate * peer.median_s) / (r.flop_rate * r.median_s)
        if r.byte_rate is not None and limits is not None:
            r.bandwidth_share = share_of(r.byte_rate, limits.copy_bytes_per_s)
