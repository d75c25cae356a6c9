"""Training checkpoints: a directory that is both a ``pretrained=`` source and a resume point.

::

    checkpoint/
      config.json          the architecture, as the model's ``save_pretrained`` writes it
      model.safetensors    the weights, likewise: the original library reads the directory
                           (transformers' ``from_pretrained`` for a decoder, with its
                           ``model_type``; timm's hub format for an image classifier)
      train_state.pt       optimizer, LR scheduler, step, epoch, position in the epoch's
                           data order, and every RNG state of every process

``train_state.pt`` holds only tensors, numbers, strings and lists (see ``rng.py``), so it is
read with ``torch.load(weights_only=True)``: resuming never runs pickled code. Resuming
restores all of it, so the run continues with the same losses as one never interrupted.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fastzoo import files
from fastzoo.errors import CheckpointError
from fastzoo.models.base import write_pretrained
from fastzoo.train import distributed as D
from fastzoo.train.rng import get_rng_state, rng_state_problem, set_rng_state
from fastzoo.registry import spec_of
from fastzoo.weights import (
    check_config, check_state_dict, config_from_source, read_config_json, read_file, read_source, to_fastzoo,
)

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of ``epoch`` already consumed

    @property
    def epoch_of_last_step(self) -> int:
        """The epoch the last step belongs to, counted from 1 (as logs and evaluations name it)."""
        return self.epoch + (self.batch_in_epoch > 0)


def model_config_json(model) -> dict:
    cfg = getattr(model, "config", None)
    return {"fastzoo_model": getattr(model, "model_name", None), "family": getattr(model, "family", None),
            **(cfg.to_dict() if hasattr(cfg, "to_dict") else {})}


def write_weights(path: Path, model, state: dict[str, torch.Tensor]) -> None:
    """``config.json`` + ``model.safetensors`` for ``state`` (a full state dict of ``model``)."""
    write_pretrained(path, model_config_json(model), state)


def write_model(path: Path, model, state: dict[str, torch.Tensor]) -> None:
    """``model`` holding ``state`` (a full state dict of it), as its ``save_pretrained`` writes it:
    what the original library reads (transformers' ``from_pretrained`` for a decoder, timm's for
    an image classifier) and ``pretrained=`` reads. Where ``state`` differs from the model's own
    tensors (a NaN capture's pre-step BatchNorm statistics) they are swapped in for the write and
    back. A sharded (FSDP) or foreign model is written as :func:`write_weights` writes it."""
    if not _is_fastzoo_model(model) or _sharded(model):
        return write_weights(path, model, state)
    own = model.state_dict()
    differ = {k: v for k, v in state.items() if k in own and not torch.equal(own[k].detach().cpu(), v.cpu())}
    kept = {k: own[k].detach().clone() for k in differ}
    with torch.no_grad():
        for k, v in differ.items():
            own[k].copy_(v)
        try:
            model.save_pretrained(path)
        finally:
            for k, v in kept.items():
                own[k].copy_(v)


def read_model_weights(path: Path, model) -> dict[str, torch.Tensor]:
    """The weights :func:`write_model` wrote, in ``model``'s own key names (read as ``pretrained=``
    reads a ``save_pretrained`` directory)."""
    if not _is_fastzoo_model(model):
        return read_weights(path)
    return to_fastzoo(spec_of(model), read_source(path))


def _is_fastzoo_model(model) -> bool:
    return hasattr(model, "config_class") and callable(getattr(model, "save_pretrained", None))


def _sharded(model) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = Path(path) / MODEL_FILE
    if not file.is_file():
        raise CheckpointError(f"{path}: no {MODEL_FILE} here; expected a directory written by a fastzoo training script")
    return read_file(file)


def save_checkpoint(path, model, optimizer, scheduler, state: TrainState, world: D.World) -> Path:
    """Write a checkpoint at ``path``, replaced atomically (``files.atomic_dir``): a kill or a
    full disk leaves the previous version. Every process must call this.

    Process 0 writes; then it tells every process whether the write worked (in place of a
    bare barrier), so a failed write (a full disk) stops every process at once with the same
    :class:`CheckpointError`, instead of leaving the others at a barrier until the
    process-group timeout (30 minutes)."""
    path = Path(path)
    weights = D.full_model_state(model)
    optim = D.full_optimizer_state(model, optimizer)
    rngs = D.all_gather_object(get_rng_state())
    error = None
    if world.is_main:
        try:
            with files.atomic_dir(path) as tmp:
                write_model(tmp, model, weights)
                torch.save({**asdict(state), "optimizer": optim, "scheduler": scheduler.state_dict(), "rng": rngs,
                            "world_size": world.size}, tmp / STATE_FILE)
        except OSError as e:
            error = CheckpointError(f"{path}: could not write the checkpoint ({e}); nothing was replaced, "
                                    f"earlier checkpoints are intact")
            error.__cause__ = e
        except Exception as e:  # not the disk's fault: process 0 raises it as it is, the others are told
            error = e
    told = D.broadcast_from_main(None if error is None else (isinstance(error, CheckpointError), str(error)))
    if error is not None:
        raise error
    if told is not None:
        ours, message = told
        raise CheckpointError(message if ours else f"{path}: process 0 failed writing the checkpoint ({message})")
    return path


@dataclass
class Checkpoint:
    """What a checkpoint directory holds, read and checked, not yet applied."""

    weights: dict[str, torch.Tensor]
    data: dict  # train_state.pt

    @property
    def state(self) -> TrainState:
        return TrainState(self.data["step"], self.data["epoch"], self.data["batch_in_epoch"])


_STATE_FIELDS = {"step": int, "epoch": int, "batch_in_epoch": int, "optimizer": dict, "scheduler": dict, "rng": list}


def read_checkpoint(path, model, optimizer) -> Checkpoint:
    """Read every file of checkpoint ``path`` and check it against the run: the architecture
    in its config.json against ``model.config`` (a field that changes the function, such as
    ``n_head``, is refused by name), the weights against the model (keys, shapes, kinds of
    value), train_state.pt's fields and the optimizer's parameter groups. Raises
    :class:`CheckpointError` naming the file and the problem; nothing is applied here."""
    path = Path(path)
    where = f"--resume {path}"
    if path.name.endswith(files.TMP_SUFFIX):
        raise CheckpointError(f"{where}: an unfinished checkpoint (a run was stopped while writing it); "
                              f"resume from a checkpoint-<step> directory")
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{where}: no {STATE_FILE} there; pass the checkpoint directory a training run wrote")
    weights = _check_architecture(path, model)
    check_state_dict(model, weights, str(path / MODEL_FILE))
    try:
        data = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or corrupt: RuntimeError, EOFError, UnpicklingError... by torch version
        raise CheckpointError(f"{path / STATE_FILE}: cannot read it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    problems = [f"{k!r} missing" if k not in data else f"{k!r} is a {type(data[k]).__name__}, not {t.__name__}"
                for k, t in _STATE_FIELDS.items() if not isinstance(data, dict) or not isinstance(data.get(k), t)]
    if isinstance(data, dict) and isinstance(data.get("rng"), list):
        problems += [f"rng[{i}]: {why}" for i, r in enumerate(data["rng"]) if (why := rng_state_problem(r))]
        if not data["rng"]:
            problems.append("'rng' is empty (no process's RNG states)")
    if not problems:
        groups = data["optimizer"].get("param_groups", [])
        sizes, own = [len(g.get("params", [])) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
        if sizes != own:
            problems.append(f"optimizer parameter groups hold {sizes} parameters, this run's optimizer {own}")
    if problems:
        raise CheckpointError(f"{path / STATE_FILE}: not a complete training state ({'; '.join(problems)}); nothing was loaded")
    return Checkpoint(weights, data)


def _check_architecture(path: Path, model) -> dict[str, torch.Tensor]:
    """Check the checkpoint's architecture against ``model``'s; its weights in fastzoo's keys. A
    fastzoo model's checkpoint is read as ``pretrained=`` reads a ``save_pretrained`` directory."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"--resume {path}: no config.json there, so the architecture cannot be checked")
    config = read_config_json(cfg_file)
    family = getattr(model, "family", None)
    if config.get("family") not in (None, family):
        raise CheckpointError(f"{cfg_file}: a {config['family']} checkpoint; this run trains a {family} model")
    if not _is_fastzoo_model(model):
        return read_weights(path)
    if not (path / MODEL_FILE).is_file():
        read_weights(path)  # its message: no weights file here
    spec = spec_of(model)
    src = read_source(path)
    fields = config_from_source(spec, src)
    check_config(model, fields, f"--resume {path}")
    own = model.config.to_dict()
    free = [f"{k}: checkpoint {fields[k]!r}, this run {own[k]!r}"
            for k in sorted(model.config_class.fields_of_kind("free")) if k in fields and k in own and own[k] != fields[k]]
    if free:  # training-only fields (dropout...): the user's choice, but the losses will not continue the old run's
        warnings.warn(f"--resume {path}: resuming with other training settings ({'; '.join(free)})", stacklevel=3)
    return to_fastzoo(spec, src)


def load_checkpoint(path, model, optimizer, scheduler, world: D.World) -> TrainState:
    """Restore what :func:`save_checkpoint` wrote into the (already wrapped) model and optimizer,
    after :func:`read_checkpoint` has read and checked all of it."""
    path = Path(path)
    ckpt = read_checkpoint(path, model, optimizer)
    data = ckpt.data
    try:
        D.load_model_state(model, ckpt.weights)
        D.load_optimizer_state(model, optimizer, data["optimizer"])
        scheduler.load_state_dict(data["scheduler"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"--resume {path}: the training state does not fit this run ({type(e).__name__}: {e})") from e
    rngs = data["rng"]
    if len(rngs) != world.size:
        warnings.warn(f"{path} was written by {len(rngs)} process(es), resuming with {world.size}: the data order "
                      f"is kept but random streams (dropout, augmentation) start from process 0's state", stacklevel=2)
    set_rng_state(rngs[world.rank] if world.rank < len(rngs) else rngs[0])
    return ckpt.state
