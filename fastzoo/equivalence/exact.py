"""The original's fp64 run: the exact function its own fp32 rounding is measured against (the rule's
``exact``, :mod:`fastzoo.equivalence.rule`).

An original makes tensors per call in the default dtype (transformers' set losses build their class
weights then), so the run sets the default dtype to fp64. What it draws at random it draws in fp32 and
widens: transformers' RT-DETR draws its denoising queries' box noise with ``rand_like`` of a tensor in
the default dtype, and fp64's ``rand_like`` gives other numbers from the same seed: another function,
whose gradients were 0.4-1.0 of their scale from the fp32 run's (3x that bounded any gradient).
"""
from __future__ import annotations

import contextlib

import torch

_DRAWS = ("rand_like", "randn_like")


@contextlib.contextmanager
def drawn_in_fp32():
    """Random fp64 tensors drawn in fp32 and widened: an fp64 run draws the numbers its fp32 run draws."""
    saved = {n: getattr(torch, n) for n in _DRAWS}

    def in_fp32(draw):
        def widened(t, *args, dtype=None, **kwargs):
            if (dtype or t.dtype) != torch.float64:
                return draw(t, *args, dtype=dtype, **kwargs)
            return draw(t, *args, dtype=torch.float32, **kwargs).double()
        return widened

    try:
        for n, draw in saved.items():
            setattr(torch, n, in_fp32(draw))
        yield
    finally:
        for n, draw in saved.items():
            setattr(torch, n, draw)


@contextlib.contextmanager
def fp64_run(original=None):
    """Inside the block: the default dtype fp64, random draws in fp32 (:func:`drawn_in_fp32`) and what the
    family's ``original`` spec (``fastzoo.models.spec.Original``) adds for its fp64 run (``fp64_patch``); the
    caller casts the model and its inputs."""
    patch = getattr(original, "fp64_patch", None)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with drawn_in_fp32(), patch() if patch is not None else contextlib.nullcontext():
            yield
    finally:
        torch.set_default_dtype(before)
