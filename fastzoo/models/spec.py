"""What a model family tells the rest of fastzoo: the one object each family folder exports.

A family folder (``fastzoo/models/<family>/``) holds the architecture, its config, the
conversion from and to each original library, and a ``spec.py`` whose ``SPECS`` lists one
:class:`ModelSpec` per family it defines. The registry, ``fastzoo.equivalence``,
``fastzoo.explain``, the benchmarks, the tour and the tests read specs and nothing else
about a family: adding a model is adding a folder.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

TASKS = ("image-classification", "causal-lm", "detection")


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
    # config fields -> the same model on the library's default kernels, as its users run it (what the
    # accuracy runs train); None where the library has no kernel choice (then ``build``)
    in_use: Callable[[dict], nn.Module] | None = None

    def as_used(self, cfg: dict) -> nn.Module:
        """The original as its users run it, at random init."""
        return (self.in_use or self.build)(cfg)


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
    original for every name, in seconds rather than minutes. ``flops`` counts one training step's
    FLOPs from a config and an input description (the benchmarks report achieved FLOP/s against
    the machine's peak with it).
    ``refused``: names the original library gives to architectures of this kind that the
    family does not reproduce, each with the options it would need (``create`` says so).
    """

    family: str
    task: str
    model: type
    variants: tuple[Variant, ...]
    converters: tuple = ()
    tiny: Mapping = field(default_factory=dict)
    original: Original | None = None
    shallow: Callable[[dict], dict] | None = None
    flops: Callable[..., int] | None = None
    refused: Mapping[str, str] = field(default_factory=dict)  # the originals' names it does not reproduce -> why

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"ModelSpec({self.family!r}): task={self.task!r}; one of {', '.join(TASKS)}")

    @property
    def config_class(self) -> type:
        return self.model.config_class

    def converter(self, format: str):
        for conv in self.converters:
            if conv.format == format:
                return conv
        raise ValueError(f"format={format!r}: {self.family} models export to {', '.join(c.format for c in self.converters)}")
