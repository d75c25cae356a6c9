"""NaN capture and replay.

When a step's loss or gradient norm is not finite, the training loop calls
:func:`write_capture` *before* the optimizer update, so the directory holds exactly what
produced the bad step:

::

    nan_step<K>/            (one ``rank<r>/`` sub-directory per process under torchrun)
      config.json, model.safetensors   the weights before the update
      batch.pt                         the batch as the step received it (on CPU)
      rng.pt                           every RNG state at the start of the step
      observed.safetensors             the loss, and the gradients (single process)
      meta.json                        step, epoch, loss normalisation, script arguments

``--replay DIR`` rebuilds the model from the same arguments, loads those weights, RNG
states and batch, runs the same forward and backward, and checks the loss and every
gradient against the observed ones bit for bit. It also names the first module whose
output was not finite, which is usually where to look.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from fastzoo import files
from fastzoo.errors import CheckpointError
from fastzoo.train.checkpoint import read_model_weights, read_weights, write_model
from fastzoo.train.rng import rng_state_problem
from fastzoo.weights import read_config_json, read_file

META_FILE = "meta.json"


def nonfinite_flag(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 on the device when the step is bad (no host sync)."""
    return (~torch.isfinite(loss.detach()) | ~torch.isfinite(grad_norm)).float()


class BufferSnapshot:
    """The model's persistent buffers (BatchNorm running statistics...) as they were before a
    step's forward, which updates them: a capture must hold the pre-step values. Copied each
    step into tensors allocated once, in one fused copy (nothing to do for a model without)."""

    def __init__(self, model: nn.Module):
        persistent = model.state_dict().keys()
        self.model = model
        self.names = [n for n, _ in model.named_buffers() if n in persistent]
        buffers = dict(model.named_buffers())
        self.saved = [torch.empty_like(buffers[n]) for n in self.names]

    def take(self) -> None:
        if self.names:
            buffers = dict(self.model.named_buffers())
            torch._foreach_copy_(self.saved, [buffers[n] for n in self.names])

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.saved))


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if callable(getattr(obj, "pin_memory", None)):  # a batch object that moves itself (BoxTargets)
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def write_capture(path: Path, *, model: nn.Module, weights: dict, batch, rng_state: dict, loss: torch.Tensor,
                  grads: dict[str, torch.Tensor] | None, meta: dict) -> Path:
    path = Path(path)
    with files.atomic_dir(path) as tmp:  # a replay never sees half a capture
        write_model(tmp, model, weights)
        torch.save(_to_cpu(batch), tmp / "batch.pt")
        torch.save(rng_state, tmp / "rng.pt")
        observed = {"loss": loss.detach().float().cpu().reshape(())}
        observed.update({f"grad/{k}": v.contiguous() for k, v in (grads or {}).items()})
        save_file(observed, str(tmp / "observed.safetensors"))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    return path


def resolve_capture_dir(path) -> Path:
    """The directory holding ``meta.json``: ``path`` itself, or its ``rank0`` sub-directory."""
    path = Path(path)
    for cand in (path, path / "rank0"):
        if (cand / META_FILE).is_file():
            return cand
    raise CheckpointError(f"--replay {path}: no {META_FILE} there; pass a nan_step<K> directory a training run wrote")


def read_meta(path) -> dict:
    file = resolve_capture_dir(path) / META_FILE
    meta = read_config_json(file)
    missing = [k for k in ("step", "count_global", "world_size", "args") if k not in meta]
    if missing or not isinstance(meta.get("args"), dict):
        raise CheckpointError(f"{file}: not a capture's metadata (missing {', '.join(missing) or 'args'})")
    return meta


def read_capture(path, model=None) -> dict:
    """Every file of a capture, read and checked; :class:`CheckpointError` names a damaged one.
    With ``model``, its weights in the model's key names (as written: the model's
    ``save_pretrained`` form)."""
    meta = read_meta(path)
    path = resolve_capture_dir(path)

    def load(name: str):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"--replay {path}: {name} is missing; the capture is incomplete")
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated or corrupt (the error type depends on where it breaks)
            raise CheckpointError(f"{file}: cannot read it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e

    batch, rng = load("batch.pt"), load("rng.pt")
    if why := rng_state_problem(rng):
        raise CheckpointError(f"{path / 'rng.pt'}: not the RNG states of a step ({why})")
    observed = read_file(path / "observed.safetensors") if (path / "observed.safetensors").is_file() else {}
    if "loss" not in observed:
        raise CheckpointError(f"--replay {path}: observed.safetensors is missing or holds no loss; the capture is incomplete")
    return {
        "meta": meta,
        "weights": read_weights(path) if model is None else read_model_weights(path, model),
        "batch": batch,
        "rng": rng,
        "loss": observed.pop("loss"),
        "grads": {k[len("grad/"):]: v for k, v in observed.items()},
    }


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


@contextmanager
def first_nonfinite_output(model: nn.Module):
    """Yields a list that, after the forward, names the first module (in call order) whose
    output held a NaN or inf. Only for replays: each check synchronises."""
    found: list[str] = []

    def hook(name):
        def fn(module, args, output):
            if found:
                return
            outs = output if isinstance(output, (tuple, list)) else (output.values() if isinstance(output, dict) else [output])
            if any(isinstance(o, torch.Tensor) and o.is_floating_point() and not torch.isfinite(o).all() for o in outs):
                found.append(name or type(module).__name__)
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()
