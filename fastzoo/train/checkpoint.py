"""Training checkpoints: a directory that is both a ``pretrained=`` source and a resume point.

::

    checkpoint/
      config.json          the architecture (as ``save_pretrained`` writes it)
      model.safetensors    the weights, fastzoo key names
      train_state.pt       optimizer, LR scheduler, step, epoch, position in the epoch's
                           data order, and every RNG state of every process

``train_state.pt`` holds only tensors, numbers, strings and lists (see ``rng.py``), so it is
read with ``torch.load(weights_only=True)``: resuming never runs pickled code. Resuming
restores all of it, so the run continues with the same losses as one never interrupted.
"""
from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fastzoo.errors import CheckpointError
from fastzoo.models.base import untied
from fastzoo.train import distributed as D
from fastzoo.train.rng import get_rng_state, set_rng_state

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of ``epoch`` already consumed


def model_config_json(model) -> dict:
    cfg = getattr(model, "config", None)
    return {"fastzoo_model": getattr(model, "model_name", None), "family": getattr(model, "family", None),
            **(cfg.to_dict() if hasattr(cfg, "to_dict") else {})}


def write_weights(path: Path, model, state: dict[str, torch.Tensor]) -> None:
    """``config.json`` + ``model.safetensors`` for ``state`` (a full state dict of ``model``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config_json(model), indent=2))
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(untied(state), str(path / MODEL_FILE), metadata={"format": "fastzoo"})


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = Path(path) / MODEL_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {MODEL_FILE} here; expected a directory written by a fastzoo training script")
    return load_file(str(file))


def save_checkpoint(path, model, optimizer, scheduler, state: TrainState, world: D.World) -> Path:
    """Write a checkpoint at ``path`` (replaced atomically). Every process must call this."""
    path = Path(path)
    weights = D.full_model_state(model)
    optim = D.full_optimizer_state(model, optimizer)
    rngs = D.all_gather_object(get_rng_state())
    if world.is_main:
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write_weights(tmp, model, weights)
        torch.save({**asdict(state), "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rngs,
                    "world_size": world.size}, tmp / STATE_FILE)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    D.barrier()
    return path


def load_checkpoint(path, model, optimizer, scheduler, world: D.World) -> TrainState:
    """Restore what :func:`save_checkpoint` wrote into the (already wrapped) model and optimizer."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"--resume {path}: no {STATE_FILE} there; pass the checkpoint directory a training run wrote")
    D.load_model_state(model, read_weights(path))
    data = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    D.load_optimizer_state(model, optimizer, data["optimizer"])
    scheduler.load_state_dict(data["scheduler"])
    rngs = data["rng"]
    if len(rngs) != world.size:
        warnings.warn(f"{path} was written by {len(rngs)} process(es), resuming with {world.size}: the data order "
                      f"is kept but random streams (dropout, augmentation) start from process 0's state", stacklevel=2)
    set_rng_state(rngs[world.rank] if world.rank < len(rngs) else rngs[0])
    return TrainState(data["step"], data["epoch"], data["batch_in_epoch"])
