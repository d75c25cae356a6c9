"""fastzoo.train building blocks, in process: RNG capture, device-resident metrics,
checkpoint round trip (weights_only), bit-exact comparison, --model-kwargs parsing."""
import random

import numpy as np
import pytest
import torch
from conftest import TINY

import fastzoo
from fastzoo.errors import CheckpointError
from fastzoo.train import distributed as D
from fastzoo.train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from fastzoo.train.cli import train_parser
from fastzoo.train.metrics import RunningMeans
from fastzoo.train.nan_guard import bits_equal, first_nonfinite_output
from fastzoo.train.rng import get_rng_state, set_rng_state

WORLD = D.World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))


def _draw():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_restores_every_generator_and_survives_weights_only(tmp_path):
    state = get_rng_state()
    first = _draw()
    torch.save(state, tmp_path / "rng.pt")
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert _draw() == first  # python, numpy and torch all replay the same numbers exactly


def test_running_means_average_over_counts_and_reset():
    m = RunningMeans("cpu")
    m.update("loss", torch.tensor(6.0), torch.tensor(3))  # mean 2 over 3 items
    m.update("loss", torch.tensor(2.0), 1)  # plus 2 over 1 item -> 8 / 4
    out = m.compute()
    assert out["loss"] == 2.0 and out["loss_count"] == 4.0
    assert m.compute() == {}  # reset after compute


def test_bits_equal_sees_nan_payload_and_last_bit():
    a = torch.tensor([1.0, float("nan")])
    assert bits_equal(a, a.clone())
    b = a.clone()
    b[0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert not bits_equal(a, b)
    assert not bits_equal(a, a.double())


def _tiny_vit():
    return fastzoo.create("vit_s16", **TINY["vit"])


def test_checkpoint_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model = _tiny_vit()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    side = TINY["vit"]["img_size"]
    model(torch.randn(2, 3, side, side)).sum().backward()
    opt.step()
    sched.step()
    save_checkpoint(tmp_path / "ck", model, opt, sched, TrainState(step=5, epoch=1, batch_in_epoch=2), WORLD)
    after_save = torch.rand(4)

    other = _tiny_vit()
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5)
    state = load_checkpoint(tmp_path / "ck", other, opt2, sched2, WORLD)
    assert state == TrainState(step=5, epoch=1, batch_in_epoch=2)
    assert torch.equal(torch.rand(4), after_save)  # RNG restored to the moment of saving
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)
    assert sched2.state_dict()["last_epoch"] == 1
    # the directory is also a pretrained= source
    again = fastzoo.create("vit_s16", pretrained=tmp_path / "ck")
    assert torch.equal(again.head.weight, model.head.weight)


def test_load_checkpoint_names_a_missing_directory(tmp_path):
    model = _tiny_vit()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(CheckpointError, match="no train_state.pt"):
        load_checkpoint(tmp_path / "nope", model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), WORLD)


def test_first_nonfinite_output_names_the_module():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    with first_nonfinite_output(model) as found:
        model(torch.ones(1, 2))
    assert found == ["1"]


def test_model_kwargs_parse_python_literals():
    args = train_parser("t", "vit_s16").parse_args(["--model-kwargs", "depth=2", "img_size=(32, 48)", "global_pool=avg"])
    assert args.model_kwargs == {"depth": 2, "img_size": (32, 48), "global_pool": "avg"}


def test_buffer_snapshot_keeps_pre_forward_stats_without_allocating_per_step():
    """The NaN guard's copy of BatchNorm running stats: pre-forward values, copied into the
    same preallocated tensors every step (the guard used to clone every buffer each step)."""
    from fastzoo.train.nan_guard import BufferSnapshot

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    snap = BufferSnapshot(model)
    assert snap.names == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    ptrs = [t.data_ptr() for t in snap.saved]
    for _ in range(2):
        before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("1.r") or k.endswith("tracked")}
        snap.take()
        model(torch.randn(2, 3, 8, 8))  # updates the running stats
        saved = snap.as_dict()
        assert all(torch.equal(saved[k], before[k]) for k in before)
        assert not torch.equal(saved["1.running_mean"], model[1].running_mean)
    assert [t.data_ptr() for t in snap.saved] == ptrs
