"""How a model is run: precision, memory format, compilation. The benchmarks try each recipe
that makes sense for a family on this device, the original and fastzoo under the same one.

Precisions: ``fp32``; ``bf16 autocast`` (weights fp32, matmuls and convolutions in bf16:
how CNNs and transformers are trained in bf16) where the device computes bf16 natively
(a CPU with AVX512-BF16 or AMX tiles, any CUDA GPU); ``bf16`` / ``fp16`` (the model cast,
on a GPU). ``channels_last`` where the family's spec says convolutions dominate;
``torch.compile`` (inductor) where asked: it costs a compilation per case, which the
benchmarks time and report.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fastzoo.bench.limits import cpu_bf16_units
from fastzoo.text import DTYPES

PRECISIONS = ("fp32", "bf16 autocast", "bf16", "fp16")


@dataclass(frozen=True)
class Recipe:
    precision: str = "fp32"
    channels_last: bool = False
    compiled: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: one of {', '.join(PRECISIONS)}")

    @property
    def dtype(self) -> torch.dtype:
        """The precision the matmuls run in: the parity rule and the GEMM peak that apply."""
        return DTYPES[self.precision.split()[0]]

    @property
    def autocast(self) -> bool:
        return self.precision.endswith("autocast")

    @property
    def cast(self) -> torch.dtype | None:
        """The dtype the model and its float inputs are cast to (None: they stay fp32)."""
        return None if self.autocast or self.precision == "fp32" else self.dtype

    @property
    def name(self) -> str:
        return ", ".join([self.precision] + ["channels_last"] * self.channels_last + ["compiled"] * self.compiled)

    def code(self, device_type: str) -> str:
        """What a user adds to run this recipe (empty for plain fp32)."""
        parts = []
        if self.autocast:
            parts.append(f'with torch.autocast("{device_type}", torch.bfloat16)')
        elif self.cast is not None:
            parts.append(f"model.to({self.cast})")
        if self.channels_last:
            parts.append("model.to(memory_format=torch.channels_last)")
        if self.compiled:
            parts.append("torch.compile(model)")
        return " + ".join(parts)


BASELINE = Recipe()  # the original as its users run it: fp32, eager


def native_bf16(device) -> bool:
    """Whether ``device`` computes bf16 natively (else bf16 is emulated and slower than fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool(cpu_bf16_units())


def low_precisions(device) -> tuple[str, ...]:
    """The low precisions worth trying on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return ("bf16",)
    return ("bf16 autocast",) if native_bf16(device) else ()


def recipes(settings, device, *, precisions=None, compile: bool = False) -> list[Recipe]:
    """Every recipe of a family's :class:`~fastzoo.models.spec.BenchSettings` on ``device``,
    the baseline first: precisions (default fp32 and :func:`low_precisions`) x memory formats x
    eager / compiled (compiled only when ``compile`` and the family compiles)."""
    precisions = precisions or ("fp32", *low_precisions(device))
    formats = (False, True) if settings.channels_last else (False,)
    compiles = (False, True) if compile and settings.compile else (False,)
    return [Recipe(p, cl, c) for c in compiles for p in precisions for cl in formats]


class Autocast(nn.Module):
    """Runs the wrapped model under bf16 autocast; parameters keep the wrapped model's names."""

    def __init__(self, model: nn.Module, device_type: str):
        super().__init__()
        self.model = model
        self.device_type = device_type

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.model(*args, **kwargs)

    def named_parameters(self, *a, **k):
        return self.model.named_parameters(*a, **k)


def prepare(model: nn.Module, recipe: Recipe, device) -> nn.Module:
    """``model`` on ``device`` under ``recipe`` (compilation is the step's: see ``model_step``)."""
    device = torch.device(device)
    model = model.to(device=device, dtype=recipe.cast)
    if recipe.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return Autocast(model, device.type) if recipe.autocast else model


def prepare_images(images: torch.Tensor, recipe: Recipe, device) -> torch.Tensor:
    images = images.to(device=device, dtype=recipe.cast)
    return images.contiguous(memory_format=torch.channels_last) if recipe.channels_last else images
