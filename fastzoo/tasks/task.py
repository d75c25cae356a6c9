"""A task: what a model of it is fed and compared on, and where the rest of fastzoo finds its
suites.

A family's spec names its task (``ModelSpec.task``, one of :data:`fastzoo.tasks.TASKS`); the
equivalence check, the benchmarks, the tour, the accuracy-parity runs, timm's and torchvision's
factories and the scripts read the task's declarations and know no task by name (torchtitan's
``ModelSpec`` names its loss builder the same way). The suites a task names sit on floors above
this one (``bench/``, ``accuracy/``), so they are named by import path, ``"module:attribute"``,
and :func:`resolve` d where they are used.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch


@dataclass
class Inputs:
    """One forward's arguments. ``keep``: a ``[B, S]`` bool mask of the rows of the output to
    compare (a padded batch: real tokens only); ``float_args``: cast floating inputs to the run dtype;
    ``output``: the attribute of the model's output compared (e.g. ``"loss"``; None: the logits)."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    keep: torch.Tensor | None = None
    float_args: bool = False
    output: str | None = None

    def to(self, device, dtype) -> "Inputs":
        def move(x):
            if not isinstance(x, torch.Tensor):
                return x
            x = x.to(device)
            return x.to(dtype) if self.float_args and x.is_floating_point() else x

        return Inputs(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()}, self.keep,
                      self.float_args, self.output)


# (model, batch, generator, the backend's capabilities, notes) -> (form, fastzoo's inputs, the original's inputs)
# per input form; a form the backend cannot take is left out with a line in ``notes``.
ExampleInputs = Callable[..., Iterator[tuple[str, Inputs, Inputs]]]


@dataclass(frozen=True, eq=False)
class Task:
    """What fastzoo knows about one task, declared once.

    ``inputs``: the example inputs the equivalence check feeds a model and its original (None:
    no comparison with an original yet). ``compared``: the name of the output compared (tables
    say "logits"). ``step_flops(count, cfg, **sizes)``: one step's FLOPs from the family's
    counter (``ModelSpec.flops``) and the sizes this task's suites know (images: ``batch``,
    ``img_size``; tokens: ``lengths`` and the padded ``width``), ``train`` included.
    ``factories``: timm's ``create_model`` and torchvision's ``get_model`` build its models.
    ``pretrained_cfg``: a fresh model carries timm's ``pretrained_cfg`` (preprocessing goes with
    the weights). ``bench``: ``fastzoo bench NAME``'s suite, called as ``(entry, workload, *,
    backends, mode, device, recipes)``; ``bench_quick_batch``: its batch under ``--quick`` (None:
    the workload's). ``tour``: the tour's entry for a family of this task, ``(spec, size, device,
    compile) -> Entry``. ``parity``: the accuracy-parity data this task trains on (the run file's
    ``task:``) -> its dataset. ``suites``: suites of parts of its training step (``fastzoo bench
    NAME``), name -> the suite's module, as a loss declares its ``bench``. ``train_script``: the
    fine-tune script that trains any family of it.
    """

    name: str
    description: str
    inputs: ExampleInputs | None = None
    compared: str = "logits"
    step_flops: Callable[..., int] | None = None
    factories: bool = False
    pretrained_cfg: bool = False
    bench: str | None = None
    bench_quick_batch: int | None = None
    tour: str | None = None
    parity: Mapping[str, str] = field(default_factory=dict)
    suites: Mapping[str, str] = field(default_factory=dict)
    train_script: str | None = None

    def __str__(self) -> str:
        return self.name

    def flops(self, spec, cfg, **sizes) -> float | None:
        """FLOPs of one step of ``spec``'s model on ``cfg`` (None: the family counts none)."""
        if spec.flops is None or self.step_flops is None:
            return None
        return self.step_flops(spec.flops, cfg, **sizes)


def resolve(path: str):
    """The object an import path ``"package.module:attribute"`` names."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
