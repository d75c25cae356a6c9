"""Run timm's own ``train.py`` with ``--model fastzoo_<name>`` and with the original ``--model <name>``,
from the same initial weights and seed, and compare the logged losses step by step.

    python benchmarks/peer_suites/timm_train.py --checkout ~/src/pytorch-image-models

``--checkout`` is a checkout (or unpacked sdist) of timm with ``train.py`` at its root, matching
the installed timm; nothing of it is kept here. The script runs as a user runs it, from a
scratch directory (so the installed timm is imported, not the checkout's), through a one-line
launcher that imports fastzoo first (that import is what registers ``fastzoo_<name>`` in timm's
factory) and then runs ``train.py`` as ``__main__``; the same launcher runs the original.

The data is a tiny synthetic ImageFolder (noise images, two classes) written to the scratch
directory; one batch holds all of it (``-b`` = its size), so each epoch is one optimizer step
whose loss does not depend on the sampler's order (the two models draw different amounts from
the RNG while they initialise). Both runs start from one state dict (timm's model at
``--seed``, passed as ``--initial-checkpoint``), with augmentation off (``--no-aug``). Losses are
read from ``summary.csv`` (``train_loss`` per epoch) and must agree within ``--tol``
(fp32 on CPU; default 1e-4, relative to the loss).

Writes ``timm-train.json`` and ``timm-train.md`` under ``--out`` (default
``benchmarks/results/cpu-2core/peer_suites``).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu-2core" / "peer_suites"
LAUNCH = "import fastzoo, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def write_images(root: Path, classes: int, per_class: int, side: int, seed: int) -> int:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / "train" / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return classes * per_class


def initial_weights(model: str, model_kwargs: dict, classes: int, seed: int, path: Path) -> int:
    import timm
    import torch

    torch.manual_seed(seed)
    net = timm.create_model(model, pretrained=False, num_classes=classes, **model_kwargs)
    torch.save(net.state_dict(), path)
    return sum(p.numel() for p in net.parameters())


def run_train(checkout: Path, work: Path, model: str, args, images: int, init: Path, experiment: str) -> tuple[list, float, str]:
    cmd = [sys.executable, "-c", LAUNCH, str(checkout / "train.py"),
           "--data-dir", str(work / "data"), "--val-split", "", "--model", model,
           "--model-kwargs", *[f"{k}={v}" for k, v in args.model_kwargs.items()],
           "--initial-checkpoint", str(init), "--num-classes", str(args.classes), "--device", "cpu",
           "-b", str(images), "--epochs", str(args.steps), "--workers", "0", "--no-aug", "--seed", str(args.seed),
           "--opt", "adamw", "--lr", str(args.lr), "--weight-decay", "0.05", "--sched", "cosine", "--warmup-epochs", "0",
           "--log-interval", "1", "--output", str(work / "out"), "--experiment", experiment]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    summary = work / "out" / experiment / "summary.csv"
    if proc.returncode != 0 or not summary.exists():
        raise SystemExit(f"train.py --model {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(summary) as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f)]
    created = next((line.split("] ", 1)[-1] for line in proc.stderr.splitlines() if "created, param count" in line), "")
    return losses, seconds, created


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", type=Path, required=True, help="timm's checkout (train.py at its root)")
    p.add_argument("--model", default="vit_small_patch16_224", help="the timm name; fastzoo's is fastzoo_<name>")
    p.add_argument("--model-kwargs", default="depth=1", help="KEY=VALUE,... for both models (default: depth=1)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (one per epoch: one batch holds the data)")
    p.add_argument("--classes", type=int, default=2)
    p.add_argument("--per-class", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="largest |loss difference| / loss allowed (fp32, CPU)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--source", default="", help="where the checkout came from (a line in the results)")
    args = p.parse_args(argv)
    if not (args.checkout / "train.py").is_file():
        p.error(f"--checkout: {args.checkout / 'train.py'} does not exist")
    args.model_kwargs = dict(kv.split("=", 1) for kv in args.model_kwargs.split(",") if kv)
    import timm
    import torch

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        images = write_images(work / "data", args.classes, args.per_class, 64, args.seed)
        typed = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in args.model_kwargs.items()}
        params = initial_weights(args.model, typed, args.classes, args.seed, work / "init.pth")
        original, t_orig, made_orig = run_train(args.checkout, work, args.model, args, images, work / "init.pth", "original")
        ours, t_ours, made_ours = run_train(args.checkout, work, "fastzoo_" + args.model, args, images, work / "init.pth",
                                            "fastzoo")
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, original)]
    passed = len(ours) == len(original) == args.steps and max(rel) <= args.tol
    result = {"script": "timm train.py", "source": args.source or str(args.checkout), "model": args.model,
              "fastzoo_model": "fastzoo_" + args.model, "model_kwargs": args.model_kwargs, "parameters": params,
              "steps": args.steps, "batch": images, "settings": "--no-aug --opt adamw --weight-decay 0.05 --sched cosine "
              f"--lr {args.lr} --seed {args.seed} --device cpu, one --initial-checkpoint for both",
              "losses": {"original": original, "fastzoo": ours}, "max_rel_diff": max(rel), "tol": args.tol,
              "passed": passed, "seconds": {"original": round(t_orig, 1), "fastzoo": round(t_ours, 1)},
              "created": {"original": made_orig, "fastzoo": made_ours},
              "versions": {"python": platform.python_version(), "torch": torch.__version__, "timm": timm.__version__},
              "load": load}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "timm-train.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = "\n".join(f"| {i} | {a:.6f} | {b:.6f} | {r:.1e} |" for i, (a, b, r) in enumerate(zip(original, ours, rel)))
    (args.out / "timm-train.md").write_text(
        f"# timm's train.py: `--model fastzoo_{args.model}` against `--model {args.model}`\n\n"
        f"Produced by `python benchmarks/peer_suites/timm_train.py --checkout <checkout>`; train.py from: "
        f"{result['source']}. Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + f". Load before the run: {load}.\n\n"
        f"Model kwargs {args.model_kwargs} ({params} parameters), {images} synthetic images in one batch, "
        f"{result['settings']}. Losses from each run's summary.csv.\n\n"
        "| step | original | fastzoo | relative difference |\n|---|---|---|---|\n" + rows + "\n\n"
        f"Largest relative difference {max(rel):.1e} (tolerance {args.tol:g}): {'PASS' if passed else 'FAIL'}. "
        f"Wall time: original {t_orig:.1f} s, fastzoo {t_ours:.1f} s (both include start-up).\n")
    print(f"timm train.py, {args.steps} steps: max relative loss difference {max(rel):.1e} "
          f"({'pass' if passed else 'FAIL'}) -> {args.out / 'timm-train.md'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
