"""Accuracy parity on real data, short: every run file in configs/accuracy_*.yaml for a few steps
(smaller data where it is generated), checking that every arm's curves agree with the first arm's
within the file's tolerance, plus the run files' refusals. The full runs' results are committed
in benchmarks/results/<device>/accuracy/."""
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastzoo.accuracy.config import load_config
from fastzoo.accuracy.runs import run
from fastzoo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted((ROOT / "configs").glob("accuracy_*.yaml"))
SHORT = ["steps=3", "eval_every=3", "data.n_train=6", "data.n_test=2", "optim.batch_size=2", "optim.warmup_steps=0"]
SHORT_PRETRAIN = ["pretrain.steps=2", "pretrain.n_images=16", "pretrain.batch_size=8"]  # files with a pretrain section


def short(path) -> list:
    """SHORT, and a short backbone pretraining where the file has one."""
    return SHORT + (SHORT_PRETRAIN if "\npretrain:" in Path(path).read_text() else [])


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_short_run_curves_agree_within_the_files_tolerance(path):
    cfg = load_config(path, short(path))
    report = run(cfg, progress=False)
    ran = [a for a in report.arms if a.status != "unavailable"]
    assert len(ran) >= 2, [a.note for a in report.arms]
    ref = ran[0]
    for a in ran:
        assert len(a.train_loss) == 3 and a.eval_steps == [3]
        assert all(torch.isfinite(torch.tensor(a.train_loss)))
    by_name = {a.name: a for a in ran}
    for arm, a in [(arm, a) for arm, a in zip(cfg.arms, report.arms) if a.status not in ("unavailable", "control", "peer")]:
        # a rounding control and a precision's peer are reported, not judged
        if arm is cfg.arms[0]:
            continue
        bound = _bounds(cfg, arm, by_name)
        for key in ("same_weights_loss", "same_weights_grad"):  # from a drawn state, then the first arm's weights at step 0
            assert a.same_weights["steps"] == [0, 0] and a.diff[key] <= bound[key], f"{a.name}: {key} {a.diff[key]}"
        for key in ("train_loss", "eval_loss", "eval_metric"):
            assert a.diff[key] <= bound[key], f"{a.name}: {key} differs by {a.diff[key]}"
            # the diff is what it says: the max over the run of the absolute difference
            assert a.diff[key] == pytest.approx(max(abs(x - y) for x, y in zip(getattr(a, key), getattr(ref, key))))
        assert a.bound == pytest.approx(bound)  # and it was judged against that bound
    assert report.agree
    if any(arm.amp for arm in cfg.arms):  # the bf16 arms ran, beside their peer
        assert sum(a.status == "peer" for a in report.arms) == 1
        assert all(a.status == "ok" for arm, a in zip(cfg.arms, report.arms) if arm.amp and a.status != "peer")


def _bounds(cfg, arm, by_name) -> dict:
    """fp32: the file's tolerance; low precision: LOW_FACTOR x the peer's difference + that tolerance
    (fastzoo.equivalence's rule for a dtype whose rounding is not the reference's), and for the
    same-weights loss half a unit of the dtype's rounding of the loss (``compare_loss``: one number's
    error can cancel by chance in the peer)."""
    from fastzoo.equivalence import LOW_FACTOR, loss_rounding
    from fastzoo.text import parse_dtype

    tol = {k: getattr(cfg.tolerance, k) for k in ("train_loss", "eval_loss", "eval_metric", "same_weights_loss", "same_weights_grad")}
    if not arm.amp:
        return tol
    peer = by_name[next(a.name for a in cfg.arms if a.amp == arm.amp)]
    bounds = {k: LOW_FACTOR * peer.diff[k] + t for k, t in tol.items()}
    loss = max(map(abs, by_name[arm.name].same_weights["loss"]))
    bounds["same_weights_loss"] += loss_rounding(loss, parse_dtype(arm.amp))
    return bounds


def test_unavailable_arm_is_reported_not_hidden():
    cfg = load_config(ROOT / "configs" / "accuracy_digits_vit.yaml", SHORT)
    flex = next(a for a in run(cfg, progress=False).arms if a.name == "fastzoo flex")
    assert flex.status == "unavailable" and "backward" in flex.note  # CPU flex has no backward


@pytest.mark.parametrize("assignment, needle", [
    ("optim.learning_rate=0.1", "unknown field 'learning_rate'; fields: batch_size, lr"),
    ("stepz=3", "unknown field 'stepz' (did you mean 'steps'?)"),
    ("steps=three", "steps: expected int"),
    ("task=imagenet", "task: 'imagenet' is not one of"),
    ("model=gpt2", "model: gpt2 is causal-lm; task 'digits' trains image-classification models"),
    ("model=vit_s99", "model: unknown model 'vit_s99'"),
    ("optim.schedule=linear", "schedule: 'linear' is not one of constant, cosine"),
    ("optim.warmup_steps=5000", "warmup_steps: must be >= 0 and below steps"),
    ("arms=[{name: a, nudge: 0.5}]", "nudge must be in [0, 0.01)"),
    ("arms=[{name: a, amp: fp8}]", "amp='fp8': choose one of fp32, bf16, fp16"),
    ("arms=[{name: a, amp: bf16}]", "the first arm ('a') is the fp32 reference"),
    ("arms=[{name: a}, {name: b, attn: eager, amp: bf16}]", "the first in bf16, is that precision's peer"),
    ("pretrain={steps: 2, lr: 0.1}", "pretrain: a backbone is pretrained for task digits_canvas (a detector), not 'digits'"),
    ("pretrain={steps: 0, lr: 0.1}", "pretrain: steps, batch_size, img_size, n_images and lr must be positive"),
])
def test_bad_fields_are_refused_by_name(assignment, needle):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "accuracy_digits_vit.yaml", [assignment])
    assert needle in str(e.value)


def test_cli_flags_override_and_a_bad_field_is_one_line_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "accuracy_parity.py"), "--config",
           str(ROOT / "configs" / "accuracy_digits_vit.yaml"), "--no-progress", "--out", str(tmp_path),
           "--set", "data.n_train=8", "--set", "data.n_test=4"]
    bad = subprocess.run([*cmd, "--set", "optim.lrr=1"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "unknown field 'lrr'" in bad.stderr
    good = subprocess.run([*cmd, "--steps", "2", "--eval-every", "1", "--set", "optim.batch_size=4", "--set", "optim.warmup_steps=0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert good.returncode == 0, good.stderr[-2000:]
    data = json.loads((tmp_path / "accuracy_digits_vit.json").read_text())
    assert data["config"]["steps"] == 2 and data["config"]["optim"]["batch_size"] == 4  # flags won over the file
    ran = [a for a in data["arms"] if a["status"] != "unavailable"]  # flex trains on CUDA only
    assert len(data["arms"]) == len(data["config"]["arms"]) and len(ran) >= 8 and data["agree"]
    assert [len(a["train_loss"]) for a in ran] == [2] * len(ran)
    assert data["threads"] == 1 and len(data["load"]) == 2  # --threads' default; the run says where it ran
    assert (tmp_path / "accuracy_digits_vit.png").read_bytes()[:4] == b"\x89PNG"


DETR = ROOT / "configs" / "accuracy_canvas_detr.yaml"


def test_same_weights_check_catches_a_different_function_that_free_running_curves_miss():
    """An arm that computes another loss (GIoU weighted 2.5x more) is caught by the same-weights
    check, even when the free-running tolerances are too loose to see it."""
    loose = ["tolerance.train_loss=100", "tolerance.eval_loss=100", "tolerance.eval_metric=1"]
    cfg = load_config(DETR, SHORT + loose)
    cfg.arms = [cfg.arms[0], dataclasses.replace(cfg.arms[3], name="padded, other weighting",
                                                 model_kwargs={"giou_loss_coefficient": 5.0})]
    report = run(cfg, progress=False)
    other = report.arms[1]
    assert other.status == "disagrees" and "same_weights_loss" in other.note and not report.agree
    assert other.diff["same_weights_loss"] > 1e-2


def test_kernel_arm_rounds_differently_but_computes_the_same_function():
    """The fused GIoU kernel's hand-written backward rounds differently from autograd through
    torch ops: from the same weights the loss is equal and the gradients agree with transformers'
    within fastzoo check's 1e-4; a free-running tolerance tighter than the rounding marks the arm
    "drifts", not "disagrees"."""
    cfg = load_config(DETR, SHORT + ["tolerance.train_loss=1.0e-12", "tolerance.same_weights_grad=1.0e-4"])
    cfg.arms = [cfg.arms[0], cfg.arms[4]]  # transformers' DETR vs fastzoo, eager attention, GIoU kernel
    report = run(cfg, progress=False)
    kernel = report.arms[1]
    assert kernel.same_weights["steps"] == [0, 0]  # the drawn state, then the first arm's at step 0
    assert kernel.diff["same_weights_loss"] <= cfg.tolerance.same_weights_loss
    assert 0 < kernel.diff["same_weights_grad"] <= 1e-4  # not bit-equal: rounding
    assert kernel.status == ("drifts" if kernel.diff["train_loss"] > 1e-12 else "ok")
    assert report.agree


def test_rounding_control_arm_is_reported_and_not_judged():
    # the same arm twice is bit-identical; a nudged copy drifts, is labelled a control, and does not
    # make the run disagree even under a zero tolerance
    arms = "arms=[{name: a, attn: sdpa}, {name: a again, attn: sdpa}, {name: nudged, attn: sdpa, nudge: 1.0e-4}]"
    cfg = load_config(ROOT / "configs" / "accuracy_digits_vit.yaml", [*SHORT, arms, "tolerance.train_loss=0"])
    rep = run(cfg, progress=False)
    _, same, nudged = rep.arms
    assert same.status == "ok" and same.diff["train_loss"] == 0.0
    assert nudged.status == "control" and nudged.diff["train_loss"] > 0.0
    assert rep.agree and "control" in rep.to_markdown()


def test_cosine_schedule_with_warmup():
    from fastzoo.accuracy.runs import Optim, _scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = _scheduler(opt, Optim(batch_size=1, lr=1.0, schedule="cosine", warmup_steps=2), steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))])


def test_set_reads_a_number_without_a_dot_as_a_number():
    assert load_config(ROOT / "configs" / "accuracy_digits_vit.yaml", ["optim.lr=2e-3"]).optim.lr == 0.002


def test_kernel_giou_is_as_close_to_fp64_as_autograd_on_detector_like_boxes():
    # Why the detector's `kernel` arm drifts from the other three GIoU modes: not a wrong gradient. On
    # boxes like the detector's early predictions (wide boxes near the centre vs small digit boxes, a
    # third of the slots padding), the fused kernel's loss and gradients are as close to an fp64
    # evaluation as autograd's fp32 ones; they differ from each other by a few ulp only, which this small
    # detector under AdamW amplifies (benchmarks/results/cpu-2core/accuracy/, the rounding-control arm).
    from fastzoo.losses.giou import PAD_BOX, giou_loss_padded

    g = torch.Generator().manual_seed(9)
    B, M = 32, 3
    centre = 0.3 + 0.4 * torch.rand(B, M, 2, generator=g)
    size = 0.25 + 0.3 * torch.rand(B, M, 2, generator=g)
    pred = torch.cat([centre - size / 2, centre + size / 2], -1)
    t_lo = 0.7 * torch.rand(B, M, 2, generator=g)
    target = torch.cat([t_lo, t_lo + 0.15 + 0.15 * torch.rand(B, M, 2, generator=g)], -1)
    pad = torch.rand(B, M, generator=g) < 1 / 3
    target[pad] = torch.tensor(PAD_BOX)

    def loss_and_grad(dtype, impl):
        p = pred.to(dtype).requires_grad_(True)
        loss = giou_loss_padded(p, target.to(dtype), reduction="sum", impl=impl)
        return loss.item(), torch.autograd.grad(loss, p)[0].double()

    truth_loss, truth = loss_and_grad(torch.float64, "torch")
    err = {}
    for impl in ("torch", "kernel"):
        loss, grad = loss_and_grad(torch.float32, impl)
        assert abs(loss - truth_loss) <= 1e-6 * abs(truth_loss)
        err[impl] = (grad - truth).abs()
        assert err[impl].max() <= 8 * torch.finfo(torch.float32).eps * truth.abs().max()  # a few ulp at most
        if impl == "kernel":
            assert (grad[pad] == 0).all()  # padding: exactly no gradient
    assert err["kernel"].mean() <= 2 * err["torch"].mean()


def test_the_results_readme_table_is_generated_from_the_committed_runs(tmp_path):
    from fastzoo.accuracy.report import SUMMARY_BEGIN, SUMMARY_END, summary_table, update_summary

    folder = ROOT / "benchmarks" / "results" / "cpu-2core" / "accuracy"
    text = (folder.parent / "README.md").read_text()
    assert text.split(SUMMARY_BEGIN, 1)[1].split(SUMMARY_END, 1)[0].strip() == summary_table(folder)
    runs = {json.loads(p.read_text())["config"]["name"] for p in folder.glob("*.json")}
    assert all(f"({folder.name}/{name}.md)" in summary_table(folder) for name in runs)  # a row per run, linked
    readme = tmp_path / "README.md"  # and the generator rewrites only its block
    readme.write_text(f"before\n{SUMMARY_BEGIN}\nold table\n{SUMMARY_END}\nafter\n")
    assert update_summary(readme, folder)
    assert readme.read_text() == f"before\n{SUMMARY_BEGIN}\n{summary_table(folder)}\n{SUMMARY_END}\nafter\n"
