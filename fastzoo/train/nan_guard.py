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
from safetensors.torch import load_file, save_file
from torch import nn

from fastzoo.train.checkpoint import read_weights, write_weights

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
    write_weights(path, model, weights)
    torch.save(_to_cpu(batch), path / "batch.pt")
    torch.save(rng_state, path / "rng.pt")
    observed = {"loss": loss.detach().float().cpu().reshape(())}
    observed.update({f"grad/{k}": v.contiguous() for k, v in (grads or {}).items()})
    save_file(observed, str(path / "observed.safetensors"))
    (path / META_FILE).write_text(json.dumps(meta, indent=2))
    return path


def resolve_capture_dir(path) -> Path:
    """The directory holding ``meta.json``: ``path`` itself, or its ``rank0`` sub-directory."""
    path = Path(path)
    for cand in (path, path / "rank0"):
        if (cand / META_FILE).is_file():
            return cand
    raise FileNotFoundError(f"--replay {path}: no {META_FILE} there; pass a nan_step<K> directory a training run wrote")


def read_meta(path) -> dict:
    return json.loads((resolve_capture_dir(path) / META_FILE).read_text())


def read_capture(path) -> dict:
    path = resolve_capture_dir(path)
    observed = load_file(str(path / "observed.safetensors"))
    return {
        "meta": json.loads((path / META_FILE).read_text()),
        "weights": read_weights(path),
        "batch": torch.load(path / "batch.pt", weights_only=True),
        "rng": torch.load(path / "rng.pt", weights_only=True),
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
