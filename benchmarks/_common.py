"""Shared command line and output writing for the benchmark scripts (not a suite itself)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fastzoo import files
from fastzoo.bench.harness import Report
from fastzoo.machine import device_name

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small configs, few runs: a 2-core CPU in minutes")
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device name>)")
    p.add_argument("--note", default="", help="a line shown above the tables (e.g. machine load)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="add torch.compile rows (default: on GPU, and on CPU without --quick)")
    p.add_argument("--no-progress", action="store_true")
    return p


def setup(args) -> tuple[torch.device, Path]:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out = args.out or RESULTS / device_name(device)
    out.mkdir(parents=True, exist_ok=True)
    return device, out


def timing(quick: bool, device: torch.device) -> dict:
    """warm-up and timed runs (at least 5: the spread a figure is judged by); compilation happens in the warm-up."""
    return {"warmup": 1, "iters": 5} if quick else {"warmup": 3, "iters": 10 if device.type == "cpu" else 20}


def dtype_for(device: torch.device) -> torch.dtype:
    """fp32 on CPU (the equivalence rule's exact setting); bf16 on GPU (how models are trained there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def recipes_for(entry, quick: bool, device: torch.device, compile: bool | None = None) -> list:
    """Every recipe worth trying for the family here (fp32 and the device's low precision, its
    memory formats), compiled too on GPU and on CPU without --quick (compiling every case on a
    2-core CPU in a quick run would take longer than the suite)."""
    from fastzoo.bench.recipes import recipes

    if compile is None:
        compile = not (device.type == "cpu" and quick)
    return recipes(entry.spec.bench, device, compile=compile)


def save(report: Report, out: Path, stem: str) -> Report:
    report.write_json(out / f"{stem}.json")
    files.write_text(out / f"{stem}.md", report.to_markdown())
    if not report.skipped and report.rows:
        report.plot(out / f"{stem}.png")
    print(report.to_markdown())
    return report
