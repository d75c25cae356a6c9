"""``python benchmarks/accuracy_parity.py --config configs/accuracy_*.yaml``: one run file, its
report written beside the others (see :mod:`fastzoo.accuracy.runs`)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fastzoo.accuracy import runs
from fastzoo.accuracy.config import load_config
from fastzoo.accuracy.report import results_dir, update_summary
from fastzoo.errors import FastzooError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="accuracy_parity", description=runs.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="a run file, configs/accuracy_*.yaml")
    p.add_argument("--steps", type=int, help="override the file's steps")
    p.add_argument("--eval-every", type=int, help="override the file's eval_every")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any field, dotted into sections: optim.lr=3e-4, data.n_train=200, tolerance.train_loss=1e-3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared CPU, spinning threads make a small model 10x slower)")
    p.add_argument("--out", type=Path, help="folder for <name>.json and <name>.png (default benchmarks/results/<device>/accuracy)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    prog = "accuracy_parity"
    torch.set_num_threads(args.threads)
    assignments = list(args.assignments)
    assignments += [f"steps={args.steps}"] if args.steps is not None else []
    assignments += [f"eval_every={args.eval_every}"] if args.eval_every is not None else []
    try:
        cfg = load_config(args.config, assignments)
        report = runs.run(cfg, device=args.device, progress=not args.no_progress)
    except FastzooError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = args.out or results_dir(args.device)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{cfg.name}.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (out / f"{cfg.name}.md").write_text(report.to_markdown())
    report.plot(out / f"{cfg.name}.png")
    print(report.to_markdown())
    print(f"wrote {out / cfg.name}.json, .md and .png" + (", and the table in ../README.md" if update_summary(out.parent / "README.md", out) else ""))
    return 0 if report.agree else 1
