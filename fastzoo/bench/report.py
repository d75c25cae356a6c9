"""A suite's results: one :class:`Row` per case, a :class:`Report` per suite, and how they are
rendered (JSON, a markdown table with each figure beside its limit, a PNG chart). The timing
that fills them is :mod:`fastzoo.bench.harness`.
"""
from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastzoo import files
from fastzoo.bench.limits import Limits, si
from fastzoo.text import markdown_table


SPREAD_LIMIT = 0.10  # (max - min) / median of a case's timed rounds beyond which its figure is not to be trusted


def reliability(row: Row | None, peer: Row | None, load: list[float], cores: int) -> list[str]:
    """Why the speed-up of ``row`` over ``peer`` is not to be trusted (empty: nothing seen): fewer
    than two timed rounds (no spread to judge), rounds of either spread beyond ``SPREAD_LIMIT`` of
    their median, or a 1-minute load average above the CPU's cores (others competed for it). Every
    timed figure -- suites, the tour, the results READMEs -- is judged by this one rule."""
    why = []
    timed = [r for r in (row, peer) if r is not None and r.median_s]
    if any(r.iters < 2 for r in timed):
        why.append("one timed round, spread not measured")
    for r in timed:
        if r.iters >= 2 and (spread := (r.max_s - r.min_s) / r.median_s) > SPREAD_LIMIT:
            why.append(f"{r.label}'s rounds spread {spread:.0%} of their median")
    if load and max(load) > cores:
        why.append(f"load {max(load):.1f} on {cores} cores: others competed for the CPU")
    return why


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
    unreliable: list[str] = field(default_factory=list)  # why its figures are not to be trusted (harness.reliability)


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
    load: list[float] = field(default_factory=list)  # 1-minute load average before and after the timing
    cores: int = 0

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
        same = any(r.vs_original is not None for r in self.rows)
        return markdown_table([({"setting": r.group} if with_setting else {}) | row_cells(r, same) | limit_cells(r, columns)
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
        if self.load:
            lines.append(f"Load (1-minute average) {' -> '.join(f'{x:.1f}' for x in self.load)} on {self.cores} cores; "
                         f"a figure is reliable when its rounds and its peer's spread at most {SPREAD_LIMIT:.0%} of their "
                         "median and the load stayed within the cores.")
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
            # long labels (an original's description, its recipe) on two lines: the bars keep their width
            labels = [textwrap.fill(r.label + (" (compiled)" if r.compiled else ""), 56) for r in rows]
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


def row_cells(r: Row, same_recipe: bool = False) -> dict:
    """One row's cells; ``same_recipe``: first the speed-up vs the original under the same recipe,
    then vs the peer (the original as its users run it)."""
    timed = r.median_s is not None
    same = {"vs the original, same recipe": ("original" if r.original else f"{r.vs_original:.2f}x")
            if r.vs_original is not None else "-"} if same_recipe else {}
    return {
        "backend": r.label,
        "compiled": ("yes" + (f" (first step {_fmt_time(r.first_step_s)})" if r.first_step_s is not None else ""))
        if r.compiled else "no",
        "step time (median, min-max)": (
            f"{_fmt_time(r.median_s)} ({_fmt_time(r.min_s)}-{_fmt_time(r.max_s)})" if timed else f"{r.status}: {_short(r.note)}"
        ),
        "throughput": f"{r.throughput:,.1f} {r.unit}" if timed else "-",
        "peak memory": f"{r.peak_mem_mib:,.0f} MiB" if r.peak_mem_mib is not None else ("n/a" if timed else "-"),
        **same,
        "speed-up vs peer": ("peer" if r.peer else f"{r.speedup:.2f}x") if r.speedup is not None else "-",
        "max error vs reference": _fmt_err(r),
        "reliable": ("no: " + "; ".join(r.unreliable) if r.unreliable else "yes") if timed else "-",
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
