"""Faults in the training loop, then ``--resume``: nothing lost, nothing logged twice.

- killed (SIGKILL) half-way through writing a checkpoint: the previous checkpoints are
  complete, the half-written one is cleaned up by the next run;
- disk full (a writer raising ENOSPC after part of its bytes) while writing a checkpoint:
  one line, exit status 2, the previous checkpoints intact.

Either way, resuming (into the same output directory) from the last complete checkpoint
gives exactly the losses and the final weights of a run never interrupted (same CPU, same
thread count: tolerance 0), and ``log.jsonl`` holds each step once.

Each run is the ViT script at a tiny size (about 3 s); the killed run is a subprocess.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, model_kwargs
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--model", "vit_s16",
        "--model-kwargs", *model_kwargs(TINY["vit"], "img_size", "patch_size", "embed_dim", "depth", "num_heads"), "drop_rate=0.1", "--synthetic", "16", "-b", "4", "--lr", "1e-3", "--workers", "0",
        "--log-interval", "1", "--steps", "4", "--ckpt-interval", "1", "--keep-checkpoints", "0"]
# Runs the script with torch.save (train_state.pt is the last file of a checkpoint) replaced
# by one that writes half its bytes and then kills the process, on the checkpoint of step K.
KILLER = """
import io, os, runpy, signal, sys, torch
K = int(sys.argv.pop(1)); calls = [0]; real = torch.save
def dying_save(obj, f, *a, **kw):
    calls[0] += 1
    if calls[0] < K:
        return real(obj, f, *a, **kw)
    buf = io.BytesIO(); real(obj, buf)
    with open(f, "wb") as out:
        out.write(buf.getvalue()[: len(buf.getvalue()) // 2]); out.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(*args, killer_step=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    pre = ["-c", KILLER, str(killer_step)] if killer_step else []
    return subprocess.run([sys.executable, *pre, str(ROOT / "scripts" / "finetune_image_classification.py"), *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def ok(proc):
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def records(out: Path) -> list[dict]:
    """log.jsonl without the wall-clock throughput, which no two runs share."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_per_s")}
            for line in (out / "log.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    ok(run(*ARGS, "--output-dir", out))
    return out


def test_killed_while_writing_a_checkpoint_then_resumed(uninterrupted, tmp_path):
    proc = run(*ARGS, "--output-dir", tmp_path, killer_step=3)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["args.json", "checkpoint-1", "checkpoint-2", "checkpoint-3.tmp", "log.jsonl"], left
    assert same_weights(tmp_path / "checkpoint-2", uninterrupted / "checkpoint-2")

    ok(run(*ARGS, "--output-dir", tmp_path, "--resume", tmp_path / "checkpoint-2"))
    assert records(tmp_path) == records(uninterrupted)  # every step once, the same losses (tolerance 0)
    steps = [r["step"] for r in records(tmp_path) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))
    for step in (3, 4):
        assert same_weights(tmp_path / f"checkpoint-{step}", uninterrupted / f"checkpoint-{step}")


def test_disk_full_while_writing_a_checkpoint_then_resumed(uninterrupted, tmp_path):
    """The full disk is a safetensors writer that raises ENOSPC after part of its bytes on
    the third checkpoint (injected in a subprocess: in-process runs use another thread count)."""
    inject = """
import errno, runpy, sys, safetensors.torch as st
real, calls = st.save_file, [0]
def full(tensors, path, metadata=None):
    calls[0] += 1
    if calls[0] < 3:
        return real(tensors, path, metadata=metadata)
    open(path, "wb").write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")
st.save_file = full
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", inject, str(ROOT / "scripts" / "finetune_image_classification.py"), *ARGS,
                           "--output-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "checkpoint-3: could not write the checkpoint" in err[0] and "No space left" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["args.json", "checkpoint-1", "checkpoint-2", "log.jsonl"]

    ok(run(*ARGS, "--output-dir", tmp_path, "--resume", tmp_path / "checkpoint-2"))
    assert records(tmp_path) == records(uninterrupted)
    assert same_weights(tmp_path / "checkpoint-4", uninterrupted / "checkpoint-4")
