"""The one learning-rate schedule (fastzoo.train.schedule): linear warm-up, then constant or a
cosine decay to 0, as the training scripts and the accuracy-parity runs use it."""
import math

import pytest
import torch

from fastzoo.train.schedule import lr_factor, warmup_schedule


def lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_warmup_then_cosine_to_zero():
    opt = optimizer()
    got = lrs(warmup_schedule(opt, warmup_steps=2, total_steps=6), opt, 8)
    cos = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert got == pytest.approx([0.5, 1.0, *cos, 0.0, 0.0])  # past total_steps the rate stays at 0


def test_constant_after_warmup_and_no_warmup():
    opt = optimizer()
    assert lrs(warmup_schedule(opt, warmup_steps=3, total_steps=5, decay="constant"), opt, 5) == pytest.approx(
        [1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    assert lr_factor(0, warmup_steps=0, total_steps=10) == 1.0  # no warm-up: the full rate at once


def test_accuracy_parity_runs_use_this_schedule():
    from fastzoo.accuracy.runs import Optim, _scheduler

    opt = optimizer()
    acc = lrs(_scheduler(opt, Optim(batch_size=1, lr=1.0, schedule="cosine", warmup_steps=2), steps=6), opt, 6)
    opt = optimizer()
    assert acc == lrs(warmup_schedule(opt, warmup_steps=2, total_steps=6), opt, 6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="decay='linear'"):
        warmup_schedule(optimizer(), warmup_steps=0, total_steps=1, decay="linear")
    with pytest.raises(ValueError, match="warmup_steps and total_steps"):
        warmup_schedule(optimizer(), warmup_steps=-1, total_steps=1)
