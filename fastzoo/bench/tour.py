"""``fastzoo tour``: what fastzoo is for, measured on this machine in a few minutes.

For every family whose spec has tour settings (``ModelSpec.bench``), the tour builds the
original with random weights (no hub), builds fastzoo from it, and runs one training step
(forward + backward) of the suite of the family's task through
:func:`fastzoo.bench.harness.run_suite`, under every recipe worth trying here
(:mod:`fastzoo.bench.recipes`: fp32; bf16 autocast where the device computes bf16 natively;
channels_last where the family's spec says so; ``torch.compile`` with ``--compile``):

1. parity: every fastzoo path against the original on identical weights and inputs (max |diff|
   of the logits / loss, and the worst parameter's relative gradient error; the rule of
   ``fastzoo check``: fp32 within 1e-4, a low precision within 3x the original's own error in
   it; a family whose spec says ``fp64_reference``: fp32 against the original's fp64 run, within 3x
   the original fp32's own error from it); a path that fails is reported and not timed;
2. speed: each fastzoo path that passed, timed in the same run (interleaved rounds on a CPU) as
   the original as its users run it (fp32, eager, the library's default attention) and as the
   original under the same recipe; beside each figure its limit: the share of the same-run
   GEMM peak in its precision, and for packed sequences the FLOP-ratio bound;
3. the recommendation: per model, the fastest path that passed parity, with its recipe;
4. how far to trust each figure: the tour measures the machine's load (1-minute average, before
   and after) and the spread of each timed case's rounds, and marks a speed-up *unreliable* where
   the rounds spread more than ``SPREAD_LIMIT`` of their median, where only one round was timed
   (``--quick``), or where others loaded the CPU (load above its cores). Started on a busy CPU
   without ``--threads``, it times at one thread (a shared CPU thrashes with more).

Each family enters through its task's tour entry (``Task.tour``; a detector's times its loss:
the padded GIoU kernel against torchvision's GIoU).
Sizes: ``tour`` (the default; about a minute and a half of a 2-core CPU) and ``quick``
(seconds; ``--quick``, what CI runs).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastzoo import files
from fastzoo.bench import limits as machine
from fastzoo.bench.harness import SPREAD_LIMIT, Report, Row, Suite, reliability, run_suite
from fastzoo.bench.report import bound_text
from fastzoo.equivalence.weights import describe
from fastzoo.machine import device_name, load_average, versions
from fastzoo.bench.recipes import Recipe

# how to bring one's own weights, said after the recommendations (they were measured from random ones)
BRING = ("Your own checkpoint: fastzoo.create(pretrained=X) reads the family and every size from X, a live timm / "
         "transformers / torchvision model or a save_pretrained directory (transformers' ViT, DeiT, DINOv2, CLIP and "
         "SigLIP towers and ResNet included: model(pixel_values=, labels=) then answers as transformers' class); a bare "
         "state dict takes a name: fastzoo.create(\"google/vit-base-patch16-224\", pretrained=sd).")
SIZES = ("tour", "quick")  # the keys of each family's BenchSettings.sizes the tour runs
TIMING = {"tour": (1, 5), "quick": (0, 1)}  # warm-up, timed rounds (five: a spread to judge each figure by)


@dataclass
class Entry:
    """One model of the tour: its suite, which rows are fastzoo paths (label -> the code a user
    writes), and the groups the recommendation is chosen from (name -> the recipe they ran)."""

    model: str
    original: str
    suite: Suite
    paths: dict[str, str]
    groups: dict[str, Recipe]
    device_type: str = "cpu"


@dataclass
class Recommendation:
    model: str
    use: str  # the code to write: 'fastzoo.create(NAME, attn="varlen") on fastzoo.data.pack(seqs)' and its recipe
    row: Row | None
    peer: Row | None
    unreliable: list[str] = field(default_factory=list)  # why its speed-up is not to be trusted (empty: it is)

    def line(self) -> str:
        """The recommendation with both ratios, the same recipe's first: ``1.01x the original under the
        same recipe (the gain over its users' default is the recipe); 1.97x timm (fp32, eager)``."""
        if self.row is None:
            return f"{self.model}: no fastzoo path passed parity and ran here; see the table"
        r, p = self.row, self.peer
        default = f"{r.speedup:.2f}x {p.label}" if r.speedup is not None and p is not None else "no timed original"
        if r.vs_original is not None and not r.original and not (p is not None and p.original):
            same = f"{r.vs_original:.2f}x the original under the same recipe"
            if recipe_is_the_gain(r):
                same += " (the gain over its users' default is the recipe, measured here and recommended)"
            vs = f"{same}; {default} as its users run it"
        else:  # the original as its users run it already uses the recipe
            vs = f"{default}, the same recipe"
        unreliable = f"  UNRELIABLE: {'; '.join(self.unreliable)}" if self.unreliable else ""
        return f"{self.model}: {self.use}  ({vs}; parity: {_errors(r, '.0e')}){unreliable}"


def recipe_is_the_gain(r: Row) -> bool:
    """fastzoo's path is as fast as the original under its recipe (within the spread a figure may
    have) while faster than the original as its users run it: the recipe, not fastzoo, is the gain."""
    return (r.vs_original is not None and abs(r.vs_original - 1) <= SPREAD_LIMIT
            and r.speedup is not None and r.speedup > 1 + SPREAD_LIMIT)


# -- what every task's tour entry shares (the entries live beside their suites) --------------------
def train_backends(device: torch.device) -> list[str]:
    """Attention backends that run and train on this device (eager, the reference, is never the answer)."""
    from fastzoo.attention import backend_class, list_attention

    return [b for b in list_attention(available_only=True)
            if b != "eager" and device.type in backend_class(b).capabilities.backward]


def dense_backends(device: torch.device) -> list[str]:
    """The training backends that take a dense batch: a kernel for packed sequences (no padding
    mask: nested, varlen) has nothing to skip in a batch of images of one size, only a conversion."""
    from fastzoo.attention import backend_class

    return [b for b in train_backends(device) if backend_class(b).capabilities.padding_mask]


def recipe_groups(suite: Suite, tried: list[Recipe]) -> dict[str, Recipe]:
    """Group name -> its recipe, for the groups of the tried recipes (a group's name ends with its recipe's)."""
    return {g.name: r for g in suite.groups for r in tried if g.name.endswith(f"| {r.name}")}


# -- running and reporting ----------------------------------------------------------------------
@dataclass
class TourResult:
    report: Report
    entries: list[Entry]
    recommendations: list[Recommendation]
    date: str
    seconds: float
    tried: list[str]  # the recipes' names
    load: list[float] = field(default_factory=list)  # 1-minute load average before and after
    cores: int = 0
    note: str = ""  # what the tour chose because of the machine (one thread on a busy CPU)

    @property
    def ok(self) -> bool:
        return self.report.ok and not any(r.status == "failed parity" for r in self.report.rows)

    def summary_rows(self) -> list[dict]:
        out = []
        for e, rec in zip(self.entries, self.recommendations):
            r, p = rec.row, rec.peer
            out.append({
                "model": e.model,
                "original (as its users run it)": e.original,
                "fastzoo here (fastest that kept parity)": rec.use if r is not None else "-",
                "parity (error <= bound)": _parity(r),
                "original step": _ms(p),
                "fastzoo step": _ms(r),
                "vs the original, same recipe": (f"**{r.vs_original:.2f}x**" + (" (the gain is the recipe)"
                                                                                if recipe_is_the_gain(r) else ""))
                if r is not None and r.vs_original is not None else "-",
                "vs the original as its users run it": f"{r.speedup:.2f}x" if r is not None and r.speedup is not None
                else "-",
                "share of GEMM peak": _gemm_share(r),
                "FLOP-ratio bound": bound_text(r) if r is not None and bound_text(r) else "-",
                "reliable": "no: " + "; ".join(rec.unreliable) if rec.unreliable else "yes",
            })
        return out

    def header(self) -> str:
        rep = self.report
        return (f"fastzoo tour on **{rep.device}** ({rep.threads} torch threads), {self.date}; one training step "
                f"(forward + backward), median of {rep.iters} after {rep.warmup} warm-up, original and fastzoo in "
                f"interleaved rounds; recipes tried: {'; '.join(self.tried)}; torch {rep.versions.get('torch')}; "
                f"{self.seconds:.0f} s in all; {machine.Limits(**rep.limits).describe()}; load "
                f"{' -> '.join(f'{x:.1f}' for x in self.load)} on {self.cores} cores{self.note}. First: fastzoo vs the original under the same recipe (dtype, layout, "
                f"compile, batch content); then vs the original as its users run it by default (fp32, eager).")

    def summary_table(self) -> str:
        from fastzoo.text import markdown_table

        return markdown_table(self.summary_rows())

    def to_markdown(self) -> str:
        lines = ["## fastzoo tour", "", self.header(), "", self.summary_table(), "", "Use here:", ""]
        lines += [f"- `{rec.line()}`" for rec in self.recommendations]
        lines += ["", BRING]
        lines += ["", "### Every path measured", "", self.report.table(), "",
                  "Configs: " + "; ".join(f"{k}: {v}" for k, v in self.report.config.items()), ""]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"date": self.date, "seconds": self.seconds, **self.report.to_dict(), "load": self.load,
                "weights": describe(0),  # every suite's original holds the draw of its default seed
                "cores": self.cores, "recommendations": [
                    {"model": r.model, "use": r.use, "label": r.row.label if r.row else None,
                     "speedup": r.row.speedup if r.row else None, "unreliable": r.unreliable, "line": r.line()}
                    for r in self.recommendations]}


def _parity(r: Row | None) -> str:
    return "-" if r is None or r.max_err is None else _errors(r, ".1e")


def _errors(r: Row, fmt: str) -> str:
    """``logits 2.1e-03 (<= 6e-03), grads 6.9e-03 (<= 2e-02), bf16 rule``: each error beside the
    bound it was held to (the rule of ``fastzoo check``: fp32 fixed, a low precision 3x the
    original's own error in it)."""
    def one(name, err, bound):
        return f"{name} {err:{fmt}}" + (f" (<= {bound:.0e})" if bound is not None else "")

    parts = [one("loss" if "labels" in r.group else "logits", r.max_err, r.out_bound)]
    if r.grad_err is not None:
        parts.append(one("grads", r.grad_err, r.grad_bound))
    return ", ".join(parts) + f", {r.precision} rule"


def _gemm_share(r: Row | None) -> str:
    if r is None or r.flop_share is None:
        return "-"
    return f"{r.flop_share:.0%} ({machine.si(r.flop_rate, 'FLOP/s')} of the {r.precision} peak)"


def _ms(r: Row | None) -> str:
    return f"{r.median_s * 1e3:.3g} ms" if r is not None and r.median_s is not None else "-"


def recommend(entry: Entry, rows: list[Row]) -> Recommendation:
    """The fastest fastzoo path (highest speed-up vs the original as its users run it, timed in
    its own group; the median where no speed-up was measured) among the recipes tried, of those
    that passed parity."""
    rows = [r for r in rows if r.group in entry.groups]
    ok = [r for r in rows if r.label in entry.paths and r.status == "ok" and r.median_s is not None]
    best = min(ok, key=lambda r: (-r.speedup if r.speedup is not None else 0.0, r.median_s), default=None)
    if best is None:
        return Recommendation(entry.model, "-", None, next((r for r in rows if r.peer), None))
    recipe = entry.groups[best.group].code(entry.device_type)
    peer = next((r for r in rows if r.peer and r.group == best.group), None)
    return Recommendation(entry.model, entry.paths[best.label] + (f" + {recipe}" if recipe else ""), best, peer)


def build_entries(size: str = "tour", device="cpu", *, compile: bool = False) -> list[Entry]:
    """One entry per family whose spec has tour settings, from its task's tour entry, in the tasks' order."""
    from fastzoo.registry import specs
    from fastzoo.tasks import TASKS, resolve

    if size not in SIZES:
        raise ValueError(f"size={size!r}: choose one of {', '.join(SIZES)}")
    device = torch.device(device)
    chosen = [s for s in specs() if s.bench is not None and size in s.bench.sizes and s.task.tour is not None]
    order = {task: i for i, task in enumerate(TASKS)}
    return [resolve(s.task.tour)(s, size, device, compile)
            for s in sorted(chosen, key=lambda s: order.get(s.task, len(TASKS)))]


def run_tour(size: str = "tour", *, device="cpu", compile: bool = False, progress: bool = True,
             threads: int | None = None) -> TourResult:
    """Every entry, measured; ``threads``: torch's thread count (None: as set, or one on a busy CPU)."""
    import time
    import warnings

    # The table says what ran; PyTorch's multi-line warning about uncompiled flex would bury the bar.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype")
    t0 = time.perf_counter()
    device = torch.device(device)
    cores, load, note = os.cpu_count() or 1, [load_average()], ""
    if threads:
        torch.set_num_threads(threads)
    elif device.type == "cpu" and load[0] > cores - 1:  # busy: more threads would thrash against the others
        torch.set_num_threads(1)
        note = " (busy at the start: timed at 1 thread)"
    with quiet_libraries():
        result = _measure(size, device, compile, progress)
    report, entries, recs, tried = result
    load.append(load_average())
    for rec in recs:
        rec.unreliable = reliability(rec.row, rec.peer, load, cores) if rec.row is not None else []
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return TourResult(report, entries, recs, date, time.perf_counter() - t0, list(dict.fromkeys(r.name for r in tried)),
                      load, cores, note)


@contextlib.contextmanager
def quiet_libraries():
    """The tour builds its originals from small configs of its own: transformers' and
    torch's log warnings about those (token ids beyond a small vocabulary, FX-tracing and CUDA-home
    notices) say nothing to its user, so they are raised to errors-only while it runs."""
    names = ("transformers", "torch.fx._symbolic_trace", "torch.utils.cpp_extension")
    levels = {n: logging.getLogger(n).level for n in names}
    try:
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
    except ImportError:
        hf_logging = None
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
        if hf_logging is not None:
            hf_logging.set_verbosity(verbosity)


def _measure(size, device, compile, progress):
    """Build every entry, measure the machine's limits, run the suites; the report, the entries,
    their recommendations and the recipes tried."""
    from tqdm.auto import tqdm

    entries = build_entries(size, device, compile=compile)
    warmup, iters = TIMING[size]
    tried = [r for e in entries for r in e.groups.values()]
    limits = machine.measure(device, dtypes=tuple(dict.fromkeys(r.dtype for r in tried)), quick=size == "quick")
    for e in entries:
        e.suite.limits = limits
    total = sum(len(g.cases) for e in entries for g in e.suite.groups)
    reports = []
    with tqdm(total=total, desc="fastzoo tour", disable=not progress, dynamic_ncols=True, leave=False) as bar:
        for e in entries:
            bar.set_description(f"fastzoo tour: {e.model}")
            reports.append(run_suite(e.suite, warmup=warmup, iters=iters, bar=bar, interleave=device.type == "cpu"))
    first = reports[0]
    config = {f"{e.model}": "; ".join(f"{k} {v}" for k, v in rep.config.items()) for e, rep in zip(entries, reports)}
    skipped = [f"{e.model}: {rep.skipped}" for e, rep in zip(entries, reports) if rep.skipped]
    report = Report("fastzoo tour", first.device, first.dtype, config, warmup, iters, versions(), torch.get_num_threads(),
                    [r for rep in reports for r in rep.rows], "; ".join(skipped) or None, limits=limits.to_dict())
    recs = [recommend(e, rep.rows) for e, rep in zip(entries, reports)]
    return report, entries, recs, tried


def write(result: TourResult, out_dir) -> dict[str, Path]:
    """``tour.md``, ``tour.json`` and the chart ``tour.png`` in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "tour.md", "json": out / "tour.json", "chart": out / "tour.png"}
    files.write_text(paths["markdown"], result.to_markdown())
    files.write_json(paths["json"], result.to_dict())
    result.report.plot(paths["chart"])
    return paths


def default_out_dir(device) -> Path:
    return Path("fastzoo-tour") / device_name(device)


# -- command line -------------------------------------------------------------------------------
def add_args(p) -> None:
    p.description = "Parity and speed of every model against its original on this machine, in minutes."
    p.add_argument("--quick", action="store_true", help="tiny sizes, one timed step: seconds, a smoke test (CI)")
    p.add_argument("--compile", action="store_true", help="also try torch.compile (inductor) where the family compiles: "
                   "minutes of compilation on a small CPU, timed and reported")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", help="folder for tour.md, tour.json and the chart tour.png (default: fastzoo-tour/<device>)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_tour(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = run_tour("quick" if args.quick else "tour", device=device, compile=args.compile, progress=not args.no_progress,
                      threads=args.threads)
    paths = write(result, args.out or default_out_dir(device))
    print(result.header() + "\n")
    print(result.summary_table() + "\n")
    for rec in result.recommendations:
        print(rec.line())
    print("\n" + BRING)
    print(f"\nchart: {paths['chart']}   every row: {paths['markdown']}   data: {paths['json']}")
    return 0 if result.ok else 1
