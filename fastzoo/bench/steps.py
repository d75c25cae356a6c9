"""Turning a model and its inputs into a timed :class:`~fastzoo.bench.harness.Step`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fastzoo.bench.harness import Step

MODES = ("eval", "train")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def model_step(
    model: nn.Module,
    inputs: Callable[[], tuple] | tuple,
    *,
    mode: str,
    loss: Callable[[object], torch.Tensor],
    items: float,
    compile: bool = False,
    view: Callable[[object], torch.Tensor] = lambda out: out,
) -> Step:
    """Eval: a forward under ``no_grad``. Train: forward, ``loss``, backward (gradients
    reset each step; no optimizer, so every step sees the same weights).

    ``view`` maps the model's output to the tensor parity compares (e.g. the logits of
    real tokens only); gradients are reported under the module's own parameter names.
    """
    check_mode(mode)
    model.train(mode == "train")
    fn = torch.compile(model) if compile else model
    args = inputs if callable(inputs) else (lambda: inputs)
    params = [p for p in model.parameters() if p.requires_grad]

    def train_step():
        for p in params:
            p.grad = None
        out = fn(*args())
        loss(out).backward()
        return out

    def run():
        if mode == "eval":
            with torch.no_grad():
                return fn(*args())
        return train_step()

    def outputs() -> dict:
        out = run()
        got = {"output": view(out).detach().float()}
        if mode == "train":
            got.update({f"grad:{n}": p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None})
        return got

    return Step(run=run, items=items, outputs=outputs)


def classification_loss(labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: nn.functional.cross_entropy(logits.float(), labels)


def in_fastzoo_names(spec, outputs: dict, names) -> dict:
    """An original library's step outputs with its gradients under fastzoo's parameter names
    ``names`` (the family's weight converter, transposes included), so every gradient is
    compared; a name the converter fills twice (a tied head) is kept once, as fastzoo holds it."""
    from fastzoo.weights import Source, find_converter

    grads = {k[len("grad:"):]: v for k, v in outputs.items() if k.startswith("grad:")}
    if not grads:
        return outputs
    converted = find_converter(spec, Source(grads, "the original's gradients")).to_fastzoo(grads)
    return {"output": outputs["output"], **{f"grad:{k}": v for k, v in converted.items() if k in names}}


def compared_as(step, *, spec, names, original: bool = False, gate: bool = True):
    """What parity compares of ``step``: nothing (``gate=False``: a row checked in another group),
    an original's outputs with its gradients under fastzoo's ``names`` (``original``), or the
    step's own outputs."""
    if not gate:
        step.outputs = None
    elif original:
        outputs = step.outputs
        step.outputs = lambda: in_fastzoo_names(spec, outputs(), names)
    return step
