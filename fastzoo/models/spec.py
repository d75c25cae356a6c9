"""What a model family tells the rest of fastzoo: the one object each family folder exports.

A family folder (``fastzoo/models/<family>/``) holds the architecture, its config, the
conversion from and to each original library, and a ``spec.py`` whose ``SPECS`` lists one
:class:`ModelSpec` per family it defines. The registry, ``fastzoo.equivalence``,
``fastzoo.explain``, the benchmarks, the tour and the tests read specs and nothing else
about a family: adding a model is adding a folder.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from torch import nn

from fastzoo.tasks import TASKS, Task


class SameKeys:
    """The base of a converter whose format names the weights as fastzoo does (the module names are the
    checkpoint's): both ways a copy; a converter overrides the direction where its keys differ."""

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return dict(state)

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return dict(state)


@dataclass(frozen=True)
class Variant:
    """A named size of a family: config fields in the original library's names."""

    name: str
    config: Mapping
    description: str  # one line: what it is and which original it equals
    peer: str  # the original, as its users name it ("timm vit_base_patch16_224")
    aliases: tuple[str, ...] = ()  # other spellings users type (timm / HF / torchvision names)
    timm: str | None = None  # the timm architecture whose default pretrained_cfg a fresh model carries


@dataclass(frozen=True)
class Original:
    """How to build the original library's model on a fastzoo config (fields in its own names)."""

    build: Callable[[dict], nn.Module]  # config fields -> the original at random init (reference kernels)
    description: str  # "timm VisionTransformer (eager attention)"
    attn_dropout_field: str | None = None  # the field zeroed for a deterministic comparison
    # the original switched to the kernels its users get (timm's fused attention, Hugging Face's SDPA); None:
    # the original as built is what its users run
    users: Callable[[nn.Module], nn.Module] | None = None
    # the fp32 parity gate compares with the original's fp64 run, within 3x the original fp32's own error from it:
    # for a function whose fp32 gradient jumps at rounding's scale (bilinear sampling's cell edges)
    fp64_reference: bool = False
    # what the original's fp64 run needs beside fastzoo.equivalence.exact.fp64_run (a context manager factory):
    # a part of the original that makes its tensors fp32 whatever the model's dtype
    fp64_patch: Callable[[], AbstractContextManager] | None = None
    # after equivalence.draw_, for a benchmark: what makes the drawn state behave as trained weights where the
    # draw leaves the model's working range (RF-DETR: drawn box deltas put boxes far outside the image)
    like_trained: Callable[[nn.Module], None] | None = None


@dataclass(frozen=True)
class Workload:
    """What a benchmark runs: config changes (original field names) and the inputs' sizes."""

    name: str  # as the tables show it: "ViT-S/16 224, 4 of 12 layers"
    config: Mapping = field(default_factory=dict)  # changes to the variant's config ({}: the variant as it is)
    batch: int = 8  # images, or sequences
    img_size: int | None = None  # images' side, for a model whose config has none (a convnet)
    max_len: int | None = None  # causal LM: sequence lengths drawn uniformly from [1, max_len] ...
    median_len: int | None = None  # ... or log-normally around this median, clipped to [16, max_len]


@dataclass(frozen=True)
class BenchSettings:
    """How the benchmarks and the tour run a family: its workloads and the recipes worth trying.

    ``sizes``: ``"bench"`` (``fastzoo bench NAME``), ``"tour"`` (``fastzoo tour``, about a
    minute of CPU for every family together) and ``"quick"`` (``fastzoo tour --quick``: seconds,
    what CI runs). ``peer`` turns the original as built by ``Original.build`` (reference kernels)
    into the original as its users run it (timm's fused attention, Hugging Face's SDPA).
    """

    variant: str  # the variant the tour builds (its config is the base of every workload)
    sizes: Mapping[str, Workload]
    library: str  # the original's library as tables name it: "timm", "HF", "torchvision"
    peer_attention: str | None = None  # the attention the peer runs ("sdpa"); None: the model has none
    channels_last: bool = False  # NHWC is worth trying (convolutions)
    compile: bool = True  # torch.compile is worth trying (the tour tries it with --compile)
    deterministic: Mapping = field(default_factory=dict)  # config fields that make a training step deterministic (dropout 0)


@dataclass(frozen=True)
class ModelSpec:
    """One family, as the rest of the package sees it.

    ``converters`` are the foreign checkpoint formats the family reads and writes, tried in
    order (each has ``format``, ``matches``, ``to_fastzoo``, ``from_fastzoo``,
    ``infer_config`` and optionally ``config_from_json`` and ``check_module``: see
    :mod:`fastzoo.weights`). ``tiny`` is a config small enough for CI (original field names)
    that keeps the family's widths' structure; ``original`` builds the reference model.
    ``shallow`` maps a variant's config to one of reduced depth (and shorter inputs or a smaller
    vocabulary where those are fields) with the same widths: what the tests compare with the
    original for every name, in seconds rather than minutes. ``flops`` counts one step's FLOPs
    from a config and the inputs' sizes, with the keywords its task gives (``flops(cfg, batch=,
    img_size=, train=)`` for images, ``flops(cfg, tokens=, attended=, train=)`` for tokens:
    ``attended`` (query, key) pairs computed); the benchmarks report achieved FLOP/s against the
    same-run GEMM peak with it (through the task's ``step_flops``). ``bench``: the family's benchmark workloads and recipes
    (:class:`BenchSettings`; None: no model suite).
    ``refused``: names the original library gives to architectures of this kind that the
    family does not reproduce, each with the options it would need (``create`` says so);
    ``why_not``: for any other unknown name, what the original library builds under it that this
    family lacks (None: not the original library's name either).
    """

    family: str
    task: Task  # what its models take and return, and the suites that run them (fastzoo.tasks)
    model: type
    variants: tuple[Variant, ...]
    converters: tuple = ()
    tiny: Mapping = field(default_factory=dict)
    original: Original | None = None
    shallow: Callable[[dict], dict] | None = None
    flops: Callable[..., int] | None = None
    bench: BenchSettings | None = None
    refused: Mapping[str, str] = field(default_factory=dict)  # the originals' names it does not reproduce -> why
    why_not: Callable[[str], str | None] | None = None

    def __post_init__(self):
        if not isinstance(self.task, Task):
            raise ValueError(f"ModelSpec({self.family!r}): task={self.task!r}; one of fastzoo.tasks' "
                             f"{', '.join(t.name.upper().replace('-', '_') for t in TASKS)} (or a Task of your own)")

    def original_as_users_run_it(self, cfg: dict) -> nn.Module | None:
        """The original library's model on config fields ``cfg`` at random init, on the kernels its
        users get (``original.build``, then ``original.users``); None for a family without an original."""
        return None if self.original is None else self.as_users_run_it(self.original.build(cfg))

    def as_users_run_it(self, original: nn.Module) -> nn.Module:
        """An original built by ``original.build`` (reference kernels), switched to the kernels its
        users get (``original.users``: timm's fused attention, Hugging Face's SDPA)."""
        return original if self.original.users is None else self.original.users(original)

    @property
    def config_class(self) -> type:
        return self.model.config_class

    def converter(self, format: str):
        for conv in self.converters:
            if conv.format == format:
                return conv
        raise ValueError(f"format={format!r}: {self.family} models export to {', '.join(c.format for c in self.converters)}")
