"""Run a peer library's own training script for a few steps with a fastzoo model chosen by name,
and with the original model of the same name, on the same seed and synthetic data; compare the
losses the script logs.

    python benchmarks/peer_suites/train_script.py torchvision --checkout ~/src/vision

``--checkout`` is a checkout of the peer (torchvision: ``references/classification/train.py``
with the ``presets`` / ``transforms`` / ``utils`` / ``sampler`` modules beside it). Nothing is
downloaded and nothing of the peer's code is kept here. The script runs unchanged, as a user
runs it after ``import fastzoo`` (which puts ``fastzoo_<name>`` into torchvision's model registry,
``torchvision.models.get_model``): a launcher imports fastzoo in both runs, seeds torch, and
runs the script as ``__main__``. The data is a tiny ImageFolder of random images written to a
temporary directory (``train/`` and ``val/``, a few classes).

fastzoo's ResNets initialise in torchvision's order from the same seed, so the two runs start
from the same weights and draw the same batches and crops: the logged losses are expected to
agree to the digits the script prints (float noise of different kernels aside).

Writes ``<suite>-train.json`` and ``<suite>-train.md`` under ``--out`` (default
``benchmarks/results/cpu-2core/peer_suites``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu-2core" / "peer_suites"

# Runs the peer's script unchanged as __main__, after `import fastzoo` and one seed (argv[1]).
LAUNCH = """
import os, runpy, sys
import torch
import fastzoo  # noqa: F401  (registers fastzoo_<name> with torchvision's get_model)
torch.manual_seed(int(sys.argv[1]))
script, sys.argv = sys.argv[2], sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` does
runpy.run_path(script, run_name="__main__")
"""

SUITES = {
    "torchvision": {
        "title": "torchvision's references/classification/train.py with --model fastzoo_<name> vs --model <name>",
        "script": "references/classification/train.py",
        # one epoch on CPU, batch 4, no workers (the batches are drawn in this process: same seed,
        # same order and crops), small crops, no checkpoint files (--output-dir '')
        "args": ["--device", "cpu", "--epochs", "1", "-b", "4", "-j", "0", "--print-freq", "1", "--lr", "0.01",
                 "--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32", "--output-dir", ""],
        "models": ("resnet18", "resnext50_32x4d"),  # a basic-block and a grouped-bottleneck ResNet
    },
}
STEP = re.compile(r"Epoch: \[\d+\]\s+\[\s*(\d+)/\d+\].*?\bloss: ([-\d.]+) \(([-\d.]+)\)")
TEST = re.compile(r"Acc@1 ([\d.]+) Acc@5 ([\d.]+)")
CLASSES = 6  # the script reports top-5 accuracy: at least 5 classes


def make_image_folder(root: Path, classes: int = CLASSES, train_per_class: int = 4, val_per_class: int = 2,
                      size: int = 40, seed: int = 0) -> Path:
    """``root/train/<class>/*.png`` and ``root/val/<class>/*.png``: random RGB images, each class
    with its own mean colour (so there is something to learn)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            mean = rng.uniform(40, 215, size=3)
            for i in range(n):
                pixels = np.clip(rng.normal(mean, 40, size=(size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def run_script(suite: dict, checkout: Path, data: Path, model: str, seed: int, log: Path) -> tuple[dict, float]:
    """One run of the peer's script; returns its logged steps and test accuracies, and seconds."""
    script = checkout / suite["script"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-c", LAUNCH, str(seed), str(script), "--data-path", str(data), "--model", model,
           *suite["args"]]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=script.parent, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - start
    text = log.read_text()
    steps = [{"step": int(m[1]), "loss": m[2], "loss_mean": m[3]} for m in STEP.finditer(text)]
    test = TEST.search(text)
    error = "" if proc.returncode == 0 else (text.strip().splitlines() or ["(no output)"])[-1]
    return {"model": model, "returncode": proc.returncode, "error": error, "steps": steps,
            "acc1": test[1] if test else None, "acc5": test[2] if test else None}, seconds


def compare(original: dict, ours: dict) -> dict:
    """The logged values side by side: the largest difference of the per-step loss (the script's
    window median) and of its running mean, and whether every printed digit agrees."""
    pairs = list(zip(original["steps"], ours["steps"]))
    same_steps = len(original["steps"]) == len(ours["steps"]) > 0
    diff = max((abs(float(a["loss"]) - float(b["loss"])) for a, b in pairs), default=float("nan"))
    diff_mean = max((abs(float(a["loss_mean"]) - float(b["loss_mean"])) for a, b in pairs), default=float("nan"))
    identical = same_steps and all(a["loss"] == b["loss"] and a["loss_mean"] == b["loss_mean"] for a, b in pairs)
    return {"steps": len(pairs), "same_steps": same_steps, "max_loss_diff": diff, "max_loss_mean_diff": diff_mean,
            "printed_digits_identical": identical and original["acc1"] == ours["acc1"]}


def versions() -> dict:
    import platform

    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torchvision", "timm"):
        try:
            v[name] = __import__(name).__version__
        except ImportError:
            pass
    return v


def write(out: Path, key: str, suite: dict, rows: list[dict], seed: int, load: str, source: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = {"suite": suite["title"], "source": source, "versions": versions(), "load": load, "seed": seed,
               "args": suite["args"]}
    (out / f"{key}-train.json").write_text(json.dumps({"summary": summary, "runs": rows}, indent=1) + "\n")
    lines = [f"# {suite['title']}", "",
             f"Produced by `python benchmarks/peer_suites/train_script.py {key} --checkout <checkout>`; script from: "
             f"{source}. Seed {seed}; synthetic ImageFolder ({CLASSES} classes, 4 train / 2 val images each, 40x40); "
             f"arguments: `{' '.join(a or repr(a) for a in suite['args'])}`.",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()) + f". Load before the run: {load}.",
             "", "| model | steps | max loss diff | max running-mean diff | printed digits identical | Acc@1 original / fastzoo "
             "| seconds original / fastzoo |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c, o, f = r["comparison"], r["original"], r["fastzoo"]
        status = f"{c['steps']}" if o["returncode"] == 0 and f["returncode"] == 0 else (
            f"failed: {(o['error'] or f['error'])[:120]}")
        lines.append(f"| `{o['model']}` vs `{f['model']}` | {status} | {c['max_loss_diff']:.4g} | "
                     f"{c['max_loss_mean_diff']:.4g} | {'yes' if c['printed_digits_identical'] else 'no'} | "
                     f"{o['acc1']} / {f['acc1']} | {r['seconds']['original']:.0f} / {r['seconds']['fastzoo']:.0f} |")
    lines += ["", "Logged losses per step (the script's `loss: median (running mean)`), original | fastzoo:", ""]
    for r in rows:
        lines.append(f"- `{r['original']['model']}`: " + "; ".join(
            f"{a['loss']} ({a['loss_mean']}) | {b['loss']} ({b['loss_mean']})"
            for a, b in zip(r["original"]["steps"], r["fastzoo"]["steps"])))
    (out / f"{key}-train.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--checkout", type=Path, required=True, help="the peer's checkout (its training script inside)")
    p.add_argument("--models", nargs="+", default=None, help="names to run (default: the suite's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--source", default="", help="where the checkout came from (a line in the results)")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    if not (args.checkout / suite["script"]).is_file():
        p.error(f"--checkout: {args.checkout / suite['script']} does not exist")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = make_image_folder(Path(tmp) / "data")
        for name in args.models or suite["models"]:
            original, t0 = run_script(suite, args.checkout, data, name, args.seed, Path(tmp) / f"{name}.log")
            ours, t1 = run_script(suite, args.checkout, data, f"fastzoo_{name}", args.seed, Path(tmp) / f"fz_{name}.log")
            rows.append({"original": original, "fastzoo": ours, "comparison": compare(original, ours),
                         "seconds": {"original": round(t0, 1), "fastzoo": round(t1, 1)}})
            c = rows[-1]["comparison"]
            print(f"{name}: {c['steps']} steps, max loss diff {c['max_loss_diff']:.4g}, "
                  f"identical digits: {c['printed_digits_identical']}"
                  + (f"; error: {original['error'] or ours['error']}" if original["error"] or ours["error"] else ""))
    write(args.out, args.suite, suite, rows, args.seed, load, args.source or str(args.checkout))
    print(f"-> {args.out / (args.suite + '-train.md')}")
    return 0 if all(r["original"]["returncode"] == 0 and r["fastzoo"]["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
