"""A failed checkpoint (or NaN-capture) write under data parallelism: 2 CPU processes on gloo.

Process 0 writes the checkpoint; its disk is full (an injected ``OSError(ENOSPC)``). Every
process must stop with the same :class:`CheckpointError` right away, not wait at the barrier
for the process-group timeout (30 minutes in training) and then get a timeout error that says
nothing about the disk. The NaN capture, which every process
writes its part of, is held to the same rule when one process's write fails.

The workers stay alive after their error until the test lets them go, as a training process
blocked in a collective does (with NCCL a crashed peer is not noticed; gloo would notice a
peer that exits, which would hide the hang). The process group's timeout here is 60 s: a
worker still at the barrier then reports a timeout, which fails the test.
"""
from __future__ import annotations

import datetime
import errno
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
PG_TIMEOUT_S = 60


def _worker(rank: int, init_file: str, out_dir: str, results, release) -> None:
    from fastzoo.errors import CheckpointError
    from fastzoo.train import checkpoint
    from fastzoo.train.distributed import World

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        if rank == 0:
            def full_disk(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")
            checkpoint.write_weights = full_disk
        world = World(rank, WORLD, rank, torch.device("cpu"))
        try:
            checkpoint.save_checkpoint(f"{out_dir}/checkpoint-1", model, optimizer, scheduler, checkpoint.TrainState(1), world)
            results.put((rank, "no error", ""))
        except CheckpointError as e:
            results.put((rank, "CheckpointError", str(e)))
        except Exception as e:  # a timeout at the barrier: the bug this test is about
            results.put((rank, type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
        release.wait(timeout=2 * PG_TIMEOUT_S)  # alive, as a training process stuck in a collective
    finally:
        dist.destroy_process_group()


def _capture_worker(rank: int, init_file: str, out_dir: str, results, release) -> None:
    """The NaN capture: every rank writes its own part; rank 1's disk is full."""
    import argparse
    from types import SimpleNamespace

    from fastzoo.errors import CheckpointError
    from fastzoo.train import loop, nan_guard
    from fastzoo.train.checkpoint import TrainState
    from fastzoo.train.distributed import World

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        if rank == 1:
            def full_disk(*args, **kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")
            nan_guard.write_capture = full_disk
        trainer = SimpleNamespace(world=World(rank, WORLD, rank, torch.device("cpu")), raw=torch.nn.Linear(4, 2),
                                  out=__import__("pathlib").Path(out_dir), args=argparse.Namespace(seed=0))
        try:
            loop.Trainer._capture(trainer, 3, TrainState(2), {"x": torch.zeros(1)}, {}, torch.tensor(float("inf")),
                                  torch.tensor(2.0), {})
            results.put((rank, "no error", ""))
        except CheckpointError as e:
            results.put((rank, "CheckpointError", str(e)))
        except Exception as e:
            results.put((rank, type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
        release.wait(timeout=2 * PG_TIMEOUT_S)
    finally:
        dist.destroy_process_group()


def _run_two(worker, tmp_path) -> dict:
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=worker, args=(r, str(tmp_path / "pg"), str(tmp_path), results, release))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(WORLD):
            rank, kind, message = results.get(timeout=PG_TIMEOUT_S + 60)  # a worker at the barrier reports at the timeout
            got[rank] = (kind, message)
    except queue.Empty:
        pytest.fail(f"only ranks {sorted(got)} reported: the others are stuck")
    finally:
        release.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_a_failed_write_on_rank_0_stops_every_rank_with_the_same_error(tmp_path):
    got = _run_two(_worker, tmp_path)
    assert got[0][0] == got[1][0] == "CheckpointError", got
    assert got[0][1] == got[1][1], got  # the same message on every rank
    assert "No space left on device" in got[0][1] and "checkpoint-1" in got[0][1]
    assert not (tmp_path / "checkpoint-1").exists()  # nothing half-written was left in its place


def test_a_failed_nan_capture_write_on_one_rank_stops_every_rank_with_the_same_error(tmp_path):
    got = _run_two(_capture_worker, tmp_path)
    assert got[0][0] == got[1][0] == "CheckpointError", got
    assert got[0][1] == got[1][1], got
    assert "rank 1: [Errno 28] No space left on device" in got[0][1] and "nan_step3" in got[0][1]
