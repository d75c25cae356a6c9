"""Every random number generator a training step draws from, captured and restored as one
value: Python's ``random``, NumPy's global generator, torch's CPU generator and each CUDA
device's. The captured value holds only tensors, lists and numbers, so it round-trips
through ``torch.save`` / ``torch.load(weights_only=True)`` (no pickled code)."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


def get_rng_state() -> dict:
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_problem(state) -> str | None:
    """Why ``state`` is not a value :func:`get_rng_state` made, or None (checked before a
    resume applies anything, so a damaged file is refused whole)."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not the dict of generator states"
    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        return f"no {' / '.join(missing)} generator state"
    py, npy, cpu = state["python"], state["numpy"], state["torch"]
    if not (isinstance(py, list) and len(py) == 3 and isinstance(py[1], list) and len(py[1]) == len(random.getstate()[1])):
        return "the python generator state is damaged"
    if not (isinstance(npy, list) and len(npy) == 5 and isinstance(npy[1], torch.Tensor) and npy[1].numel() == 624):
        return "the numpy generator state is damaged"
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8 and cpu.shape == torch.get_rng_state().shape):
        return "the torch generator state is damaged"
    return None
