"""One timing harness for every suite: parity first, then warm-up and the median of N runs.

A suite is a list of :class:`Group` s (one setting: a model config, eval or train,
compiled or not); each group holds :class:`Case` s (a backend, or the peer library the
user would pick instead). For each case the harness

1. builds it (a backend this machine cannot run is reported ``unavailable`` with the reason),
2. compares its outputs and gradients with the group's fp32 eager reference on identical
   weights (:func:`fastzoo.equivalence.compare_cases`, the rule of ``fastzoo check``); a case that fails
   is reported and *not timed*,
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

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from fastzoo import files
from fastzoo.bench.limits import Limits, rate, si
from fastzoo.bench.limits import share as share_of
from fastzoo.equivalence import compare_cases
from fastzoo.errors import BackendUnavailableError
from fastzoo.machine import device_name, versions
from fastzoo.text import dtype_name, markdown_table


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


# -- results ------------------------------------------------------------------------------
@dataclass
class Row:
    group: str
    label: str
    compiled: bool
    status: str  # "ok" | "failed parity" | "unavailable" | "out of memory" | "error"
    peer: bool = False
    note: str = ""
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    iters: int = 0
    throughput: float | None = None
    unit: str = ""
    peak_mem_mib: float | None = None
    speedup: float | None = None
    max_err: float | None = None
    grad_err: float | None = None
    floor: bool = False  # this row is the group's floor
    flop_rate: float | None = None  # FLOP/s at the median
    flop_share: float | None = None  # of the same-run GEMM peak in the group's dtype
    byte_rate: float | None = None  # bytes/s at the median
    bandwidth_share: float | None = None  # of the same-run copy bandwidth (large buffers)
    vs_floor: float | None = None  # median ÷ the floor row's median (1.0: at the floor)
    precision: str = "fp32"  # the case's compute precision: its parity rule and its GEMM peak
    out_bound: float | None = None  # the parity bounds the errors were held to
    grad_bound: float | None = None
    original: bool = False
    vs_original: float | None = None  # speed-up vs the original under the same recipe
    first_step_s: float | None = None  # compiled: the parity pass, compilation included
    work_bound: float | None = None  # the peer's FLOPs ÷ this case's: the speed-up less work alone would give


@dataclass
class Report:
    suite: str
    device: str
    dtype: str
    config: dict
    warmup: int
    iters: int
    versions: dict
    threads: int
    rows: list[Row]
    skipped: str | None = None
    note: str = ""
    limits: dict | None = None  # Limits.to_dict() of the limits measured in this run

    def to_dict(self) -> dict:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}

    def write_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return files.write_json(path, self.to_dict())

    @property
    def ok(self) -> bool:
        return not any(r.status == "error" for r in self.rows)

    def table(self) -> str:
        if not self.rows:
            return "(no rows)"
        with_setting = len({r.group for r in self.rows}) > 1
        columns = limit_columns(self.rows)
        return markdown_table([({"setting": r.group} if with_setting else {}) | row_cells(r) | limit_cells(r, columns)
                               for r in self.rows])

    def to_markdown(self, title: str | None = None) -> str:
        lines = [f"## {title or self.suite}", ""]
        if self.note:
            lines += [f"> {self.note}", ""]
        lines.append(f"Device: **{self.device}** ({self.threads} torch threads), dtype {self.dtype}; "
                     f"warm-up {self.warmup}, median of {self.iters} runs (min-max).")
        lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()) + ".")
        if self.config:
            lines.append("Config: " + "; ".join(f"{k}: {v}" for k, v in self.config.items()) + ".")
        if self.limits:
            lines.append(f"Limits: {Limits(**self.limits).describe()}.")
        lines.append("")
        if self.skipped:
            lines.append(f"Skipped: {self.skipped}")
        else:
            lines.append(self.table())
        return "\n".join(lines) + "\n"

    def plot(self, path) -> Path:
        """Bar chart of throughput per case, one panel per setting; the peer in grey."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        groups = list(dict.fromkeys(r.group for r in self.rows))
        fig, axes = plt.subplots(len(groups), 1, figsize=(8, 1.2 + 0.45 * max(len(self.rows) / max(len(groups), 1), 2) * len(groups)),
                                 squeeze=False)
        for ax, g in zip(axes[:, 0], groups):
            rows = [r for r in self.rows if r.group == g]
            labels = [r.label + (" (compiled)" if r.compiled else "") for r in rows]
            values = [r.throughput or 0.0 for r in rows]
            colors = ["tab:gray" if r.peer else ("silver" if r.floor else "tab:blue") for r in rows]
            bars = ax.barh(labels, values, color=colors)
            for bar, r in zip(bars, rows):
                text = f" {r.speedup:.2f}x" if r.speedup is not None else f" {r.status}"
                text += limit_note(r)
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
            ax.invert_yaxis()
            ax.margins(x=0.12)  # room for the speed-up labels
            ax.set_title(g, fontsize=9)
            ax.set_xlabel(rows[0].unit if rows and rows[0].unit else "throughput")
            ax.tick_params(labelsize=8)
        limits = "; time ÷ floor (silver), share of the same-run limit" if any(limit_note(r) for r in self.rows) else ""
        fig.suptitle(f"{self.suite} on {self.device} ({self.dtype}); speed-up vs peer (grey){limits}", fontsize=10)
        fig.tight_layout()
        files.save_figure(fig, path, dpi=110)
        plt.close(fig)
        return Path(path)


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def row_cells(r: Row) -> dict:
    timed = r.median_s is not None
    return {
        "backend": r.label,
        "compiled": ("yes" + (f" (first step {_fmt_time(r.first_step_s)})" if r.first_step_s is not None else ""))
        if r.compiled else "no",
        "step time (median, min-max)": (
            f"{_fmt_time(r.median_s)} ({_fmt_time(r.min_s)}-{_fmt_time(r.max_s)})" if timed else f"{r.status}: {_short(r.note)}"
        ),
        "throughput": f"{r.throughput:,.1f} {r.unit}" if timed else "-",
        "peak memory": f"{r.peak_mem_mib:,.0f} MiB" if r.peak_mem_mib is not None else ("n/a" if timed else "-"),
        "speed-up vs peer": ("peer" if r.peer else f"{r.speedup:.2f}x") if r.speedup is not None else "-",
        "max error vs reference": _fmt_err(r),
    }


LIMIT_COLUMNS = ("time ÷ floor", "share of GEMM peak", "share of copy bandwidth", "FLOP-ratio bound")


def _has_bound(r: Row) -> bool:
    return r.work_bound is not None and abs(r.work_bound - 1) > 1e-3


def limit_columns(rows: list[Row]) -> list[str]:
    """The limit columns some row of ``rows`` has a figure for (none: the table is as before)."""
    have = {"time ÷ floor": any(r.vs_floor is not None for r in rows),
            "share of GEMM peak": any(r.flop_share is not None for r in rows),
            "share of copy bandwidth": any(r.bandwidth_share is not None for r in rows),
            "FLOP-ratio bound": any(_has_bound(r) for r in rows)}
    return [c for c in LIMIT_COLUMNS if have[c]]


def limit_cells(r: Row, columns: list[str]) -> dict:
    cells = {"time ÷ floor": "floor" if r.floor and r.vs_floor is not None else _fmt_opt(r.vs_floor, "{:.2f}x"),
             "share of GEMM peak": _fmt_rate(r.flop_share, r.flop_rate, "FLOP/s") + (
                 f" of {r.precision}" if r.flop_share is not None else ""),
             "share of copy bandwidth": _fmt_rate(r.bandwidth_share, r.byte_rate, "B/s"),
             "FLOP-ratio bound": bound_text(r) or "-"}
    return {c: cells[c] for c in columns}


def bound_text(r: Row) -> str:
    """``1.83x (speed-up ÷ bound 1.08)``: a case doing less work than the peer, and how its speed-up compares."""
    if not _has_bound(r):
        return ""
    return f"{r.work_bound:.2f}x" + (f" (speed-up ÷ bound {r.speedup / r.work_bound:.2f})" if r.speedup is not None else "")


def limit_note(r: Row) -> str:
    """The chart's note beside a bar: time ÷ floor, or the share of the limit; the FLOP-ratio bound."""
    bound = f", bound {r.work_bound:.2f}x" if _has_bound(r) else ""
    if r.vs_floor is not None and not r.floor:
        return f", {r.vs_floor:.2f}x floor"
    if r.flop_share is not None:
        return f", {r.flop_share:.0%} of {r.precision} GEMM peak" + bound
    if r.bandwidth_share is not None:
        return f", {r.bandwidth_share:.0%} of copy bw"
    return bound


def _fmt_opt(value: float | None, fmt: str) -> str:
    return fmt.format(value) if value is not None else "-"


def _fmt_rate(part: float | None, achieved: float | None, unit: str) -> str:
    if part is None or achieved is None:
        return "-"
    return f"{part:.1%} ({si(achieved, unit)})"


def _short(note: str) -> str:
    """The table keeps the reason; the JSON keeps the whole message (with the list of what is available)."""
    return note.split(". Available on this machine")[0]


def _fmt_err(r: Row) -> str:
    if r.max_err is None:
        return "-"
    text = f"{r.max_err:.1e}"
    return text + (f" (grad {r.grad_err:.1e})" if r.grad_err is not None else "")



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
    total = sum(len(g.cases) for g in suite.groups)
    own = bar is None
    if own:
        bar = tqdm(total=total, desc=suite.name, disable=not progress, leave=False, dynamic_ncols=True)
    with bar if own else nullcontext():
        for group in suite.groups:
            bar.set_postfix_str(f"{group.name}: reference")
            ref = group.reference() if group.reference is not None else None
            ref_in_dtype = None
            rows, pending = [], []
            for case in sorted(group.cases, key=lambda c: not c.reference):  # reference first: it sets the tolerance
                bar.set_postfix_str(f"{group.name}: {case.label}")
                row, got, step, warm = _prepare_case(case, group, ref, ref_in_dtype, suite, warmup)
                if case.reference:
                    ref_in_dtype = got
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
    return report


def _prepare_case(case, group, ref, ref_in_dtype, suite, warmup):
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
            got = step.outputs()
            row.first_step_s = time.perf_counter() - t0 if case.compiled else None
            low = (group.dtype or suite.dtype) != torch.float32
            peer = (got if case.reference else ref_in_dtype) if low else None
            if low and peer is None:
                raise Unavailable("low-precision parity needs the eager reference case in this group")
            comps = compare_cases(ref, got, peer, same_names=case.same_names)
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


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes held by tensors that ``fn`` allocates on the CPU, above what existed before: the
    running sum of the profiler's allocation and free events (``profile_memory=True``), i.e.
    what ``torch.cuda.max_memory_allocated`` measures on a GPU. Tensors only: no Python objects,
    no allocator caching or fragmentation (RSS would add those and whatever else the process holds)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
