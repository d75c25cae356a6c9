"""How a loss declares itself, and where the rest of fastzoo finds the declarations.

Each loss file declares one :class:`Loss`, as an attention backend declares its capabilities
and ``kernel_ops``: its implementations (the ``impl=`` words), the ops that are its kernels in a
profiler trace, its own fused op and the implementations that ask for it, and its benchmark
suite. ``fastzoo.explain`` reads them to attribute and check a loss's kernels, ``fastzoo bench
NAME`` to find a loss suite; neither knows a loss by name (Hugging Face's ``LOSS_MAPPING`` plays
the same part). A suite sits on a floor above this one, so it is named by import path.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Loss:
    """One loss, declared.

    ``name``: its short name (``fastzoo bench NAME``, :func:`get_loss`). ``functions``: the
    functions whose calls ``fastzoo.explain`` reports (their profiler ranges,
    :mod:`fastzoo.kernel_ranges`). ``impls``: each ``impl=`` word -> what it runs. ``kernel_ops``:
    a regex that the ops of its kernels match, forward and backward (``None``: plain tensor ops
    only). ``fused_op``: a regex of its own fused op, whose body shows whether a compiled kernel or
    the vectorised closed form ran; ``fused_impls``: the ``impl=`` words that ask for that op (when
    it does not run, ``explain`` reports a fallback). ``bench``: the module of its ``fastzoo bench NAME``
    suite (its ``TARGET_SETTING``, the ``BATCH_FIELD`` that ``--batch-size`` sets, and
    ``cli_suite(setting, *, device, dtype)``).
    """

    name: str
    description: str
    functions: tuple[str, ...]
    impls: Mapping[str, str]
    kernel_ops: str | None = None
    fused_op: str | None = None
    fused_impls: tuple[str, ...] = ()
    bench: str | None = None


_BUILTIN = {  # name -> where its declaration lives (imported on first use)
    "giou": "fastzoo.losses.giou:GIOU",
    "linear_ce": "fastzoo.losses.linear_ce:LINEAR_CE",
    "lm": "fastzoo.losses.lm:LM",
    "set_prediction": "fastzoo.losses.set_prediction:SET_PREDICTION",
}
_REGISTRY: dict[str, Loss] = {}


def register_loss(loss: Loss) -> None:
    """Add ``loss`` (a declaration of your own, or a new fastzoo loss) under ``loss.name``."""
    if not isinstance(loss, Loss):
        raise TypeError(f"register_loss takes a fastzoo.losses.Loss declaration, got {type(loss).__name__}")
    _REGISTRY[loss.name] = loss


def list_losses() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTRY})


def get_loss(name: str) -> Loss:
    """The declaration of loss ``name`` (KeyError naming the known losses)."""
    if name not in _REGISTRY and name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    if name not in _REGISTRY:
        raise KeyError(f"no loss {name!r}; losses: {', '.join(list_losses())}")
    return _REGISTRY[name]


def losses() -> list[Loss]:
    """Every declaration, by name."""
    return [get_loss(n) for n in list_losses()]


def loss_of_function(function: str) -> Loss | None:
    """The declaration whose ``functions`` include ``function`` (a profiler range's name), or None."""
    return next((loss for loss in losses() if function in loss.functions), None)
