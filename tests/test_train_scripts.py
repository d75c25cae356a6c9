"""The training scripts end to end, as a user runs them: subprocesses on CPU with tiny
configs. Each script trains a few steps and writes checkpoints; --resume continues with the
same losses and weights as the uninterrupted run; a planted non-finite loss
(--debug-nan-at-step) is captured and --replay reproduces it bit for bit; torchrun with 2
gloo processes matches one process on the same global batch; user errors are one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TINY_VIT = ["--model", "vit_s16", "--model-kwargs", "img_size=16", "patch_size=8", "embed_dim=32", "depth=2",
            "num_heads=2", "--synthetic", "32", "-b", "8", "--lr", "1e-3", "--workers", "0", "--log-interval", "1"]
DROPOUT = ["--model-kwargs", "drop_path_rate=0.1", "drop_rate=0.1"]  # so the RNG state matters for resume and replay


def run(script, *args, nproc=None, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "scripts" / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r}


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def user_error(proc, *needles):
    """Exit status 2, a message naming the problem, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


# -- finetune_vit.py ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vit") / "run"
    ok(run("finetune_vit.py", *TINY_VIT, *DROPOUT, "--steps", 4, "--ckpt-interval", 2, "--output-dir", out))
    return out


def test_vit_trains_and_writes_checkpoints(vit_run):
    assert (vit_run / "checkpoint-2" / "train_state.pt").is_file() and (vit_run / "checkpoint-4" / "model.safetensors").is_file()
    losses = train_losses(vit_run)
    assert sorted(losses) == [1, 2, 3, 4] and all(l == l and l < 10 for l in losses.values())
    assert any("eval_top1" in r for r in map(json.loads, (vit_run / "log.jsonl").read_text().splitlines()))
    import fastzoo  # the checkpoint is a pretrained= source

    model = fastzoo.create("vit_s16", pretrained=vit_run / "checkpoint-4")
    assert torch.equal(model.head.weight, weights(vit_run / "checkpoint-4")["head.weight"])


def test_vit_resume_matches_uninterrupted_run(vit_run, tmp_path):
    ok(run("finetune_vit.py", *TINY_VIT, *DROPOUT, "--steps", 4, "--ckpt-interval", 2, "--output-dir", tmp_path,
           "--resume", vit_run / "checkpoint-2"))
    resumed, full = train_losses(tmp_path), train_losses(vit_run)
    assert sorted(resumed) == [3, 4]
    # Same weights, optimizer state, RNG streams and data order on the same CPU: exactly equal (tolerance 0).
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)
    a, b = weights(tmp_path / "checkpoint-4"), weights(vit_run / "checkpoint-4")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_vit_nan_is_captured_and_replayed_bit_for_bit(tmp_path):
    proc = run("finetune_vit.py", *TINY_VIT, *DROPOUT, "--steps", 4, "--output-dir", tmp_path, "--debug-nan-at-step", 2)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    cap = tmp_path / "nan_step2"
    assert {p.name for p in cap.iterdir()} >= {"model.safetensors", "batch.pt", "rng.pt", "observed.safetensors", "meta.json"}
    assert sorted(train_losses(tmp_path)) == [1]  # stopped before the bad update, no later step
    rep = ok(run("finetune_vit.py", "--replay", cap))
    n = len(load_file(str(cap / "observed.safetensors"))) - 1  # every gradient, plus the loss
    assert "loss inf (captured inf): bit-identical" in rep.stdout and f"gradients: {n}/{n} tensors bit-identical" in rep.stdout
    assert "reproduced bit for bit" in rep.stdout


def test_vit_torchrun_two_gloo_processes_match_one(tmp_path):
    args = [*TINY_VIT, "--steps", 2, "--device", "cpu"]
    ok(run("finetune_vit.py", *args, "--output-dir", tmp_path / "one"))
    ok(run("finetune_vit.py", *args, "--output-dir", tmp_path / "two", nproc=2))
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2]
    # Same global batch; only the order of fp32 sums differs (all-reduce): relative 1e-5.
    assert all(abs(one[s] - two[s]) <= 1e-5 * abs(one[s]) for s in one), (one, two)
    a, b = weights(tmp_path / "one" / "checkpoint-2"), weights(tmp_path / "two" / "checkpoint-2")
    # Two AdamW steps from identical weights; Adam's normalised update amplifies ~1e-7 gradient
    # differences to at most ~lr * 1e-3, so 1e-5 absolute on weights of magnitude ~0.1.
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)


def test_vit_user_errors_are_one_line(tmp_path):
    user_error(run("finetune_vit.py", "--data-dir", tmp_path / "missing"), "--data-dir", "missing")
    user_error(run("finetune_vit.py", *TINY_VIT, "--model", "vit_nope", "--output-dir", tmp_path), "unknown model 'vit_nope'")
    user_error(run("finetune_vit.py", *TINY_VIT, "--model-kwargs", "dept=2", "--output-dir", tmp_path), "dept")
    user_error(run("finetune_vit.py", *TINY_VIT, "-b", "0"), "--batch-size")
