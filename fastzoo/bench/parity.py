"""Parity of a backend against the eager reference on identical weights: outputs and gradients.

Tolerances follow DESIGN.md's equivalence rule:

- fp32: ``max|out - ref| <= 1e-4`` for outputs; gradients relative to the largest
  reference gradient, ``<= 1e-3`` (a backward sums many more terms than a forward, so
  its rounding grows with depth; relative because gradient magnitudes vary by layer).
- bf16 / fp16 (flash-attn's rule): with ``ref`` the eager model in fp32, a case may be off
  by at most 3x what the eager model in the same low precision is off, plus a floor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP32_OUT_ATOL = 1e-4
FP32_GRAD_RTOL = 1e-3
LOW_PRECISION_FACTOR = 3.0
LOW_PRECISION_FLOOR = 1e-3


@dataclass
class ParityError:
    """How far a case is from the reference: outputs absolute, gradients relative."""

    out: float
    grad: float | None  # None: no gradients compared (eval, or parameter names differ)


def compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> ParityError:
    """``ref``/``got`` map "output" and "grad:<param name>" to tensors; gradients are
    compared on the names both sides have with equal shapes."""
    out = (got["output"].float() - ref["output"].float()).abs().max().item()
    grad_errs = []
    for k, g_ref in ref.items():
        if not k.startswith("grad:") or k not in got or got[k].shape != g_ref.shape:
            continue
        scale = g_ref.float().abs().max().item() or 1.0
        grad_errs.append((got[k].float() - g_ref.float()).abs().max().item() / scale)
    return ParityError(out, max(grad_errs) if grad_errs else None)


@dataclass
class Tolerance:
    out: float
    grad: float

    def passes(self, err: ParityError) -> bool:
        ok = err.out <= self.out
        return ok and (err.grad is None or err.grad <= self.grad)

    def describe(self) -> str:
        return f"out <= {self.out:.2g}, grad (rel) <= {self.grad:.2g}"


def tolerance(dtype: torch.dtype, reference_in_dtype: ParityError | None = None) -> Tolerance:
    """fp32: fixed; low precision: 3x the eager model's own error in that dtype (+ floor)."""
    if dtype == torch.float32:
        return Tolerance(FP32_OUT_ATOL, FP32_GRAD_RTOL)
    if reference_in_dtype is None:
        raise ValueError("low-precision parity needs the eager model's own error in that dtype")
    base_grad = reference_in_dtype.grad or 0.0
    return Tolerance(
        LOW_PRECISION_FACTOR * reference_in_dtype.out + LOW_PRECISION_FLOOR,
        LOW_PRECISION_FACTOR * base_grad + LOW_PRECISION_FLOOR,
    )
