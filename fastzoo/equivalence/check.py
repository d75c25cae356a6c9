"""A registered model against its original: the original library's model holding a full random state
(:func:`fastzoo.equivalence.weights.draw_`), fastzoo's built from it as a user would, the inputs its
task declares, and the rule applied to each input form (``fastzoo check``)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from fastzoo.attention import get_backend
from fastzoo.layers.attention import UsesAttention
from fastzoo.equivalence import oplevel
from fastzoo.equivalence.compare import compare
from fastzoo.equivalence.layers import LayerReport
from fastzoo.equivalence.norms import compare_norms
from fastzoo.equivalence.rule import (
    FP32_GRAD_RTOL, FP32_OUT_ATOL, FP32_OUT_ULPS, LOW_FACTOR, LOW_GRAD_FLOOR, LOW_OUT_FLOOR, Comparison,
)
from fastzoo.equivalence.weights import describe, draw_
from fastzoo.registry import create, get_entry, spec_of, specs
from fastzoo.tasks import Inputs
from fastzoo.text import dtype_name


def tiny_overrides(model_name: str) -> dict:
    """The family's small config (its spec's ``tiny``, original field names) for CPU runs and CI."""
    spec = _checkable(model_name)
    return dict(spec.tiny)


def _checkable(model_name: str):
    """The spec of ``model_name``, or a ValueError if its family has no original to compare with."""
    spec = get_entry(model_name).spec
    if spec.original is None or spec.task.inputs is None:
        covered = sorted(s.variants[0].name for s in specs() if s.original is not None and s.task.inputs is not None)
        raise ValueError(f"model {model_name!r} ({spec.family}) has no original to check against; "
                         f"equivalence covers the families of: {', '.join(covered)}")
    return spec


@dataclass
class Result:
    """What :func:`check` found for one model and backend."""

    model: str
    backend: str
    options: dict
    device: str
    dtype: str
    rule: str
    reference: str = ""  # the original it was compared with
    weights: str = ""  # the weights both held (weights.describe)
    comparisons: list[Comparison] = field(default_factory=list)
    layers: dict[str, LayerReport] = field(default_factory=dict)  # input form -> per-layer report
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    def rows(self) -> list[dict]:
        """Table rows, one per comparison (``fastzoo check``)."""
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return [
            {
                "backend": self.backend + (f" ({opts})" if opts else ""),
                "device": self.device,
                "dtype": self.dtype,
                "compared": c.name,
                "max error": f"{c.err:.2e}",
                "bound": f"{c.bound:.2e}",
                "original's own error": "-" if c.peer_err is None else f"{c.peer_err:.2e}",
                "result": "pass" if c.passed else "FAIL" + (f" (worst: {c.worst})" if c.worst else ""),
            }
            for c in self.comparisons
        ]

    def to_dict(self) -> dict:
        return {
            "model": self.model, "backend": self.backend, "options": {k: repr(v) for k, v in self.options.items()},
            "device": self.device, "dtype": self.dtype, "rule": self.rule, "reference": self.reference,
            "weights": self.weights,
            "passed": self.passed, "notes": self.notes,
            "comparisons": [
                {"name": c.name, "err": c.err, "bound": c.bound, "peer_err": c.peer_err, "passed": c.passed, "worst": c.worst}
                for c in self.comparisons
            ],
            "first_diverging_layer": {
                form: (None if r.first is None else r.first.name) for form, r in self.layers.items()
            },
        }


def has_attention(model_name: str) -> bool:
    """Whether ``model_name`` has attention layers (a convnet has none: no backend is ever asked),
    read from its tiny config built on the meta device."""
    model = create(model_name, attn="eager", device="meta", **_checkable(model_name).tiny)
    return any(isinstance(m, UsesAttention) for m in model.modules())


def compares_grads(backend: str, options: dict, device, train: bool) -> bool:
    """Whether a check (and ``fastzoo check --explain``) runs the backward: in training, where the
    backend has a backward on ``device``'s type."""
    return train and torch.device(device).type in get_backend(backend, **options).capabilities.backward


def original(model_name: str, *, seed: int = 0, **overrides) -> nn.Module:
    """The original library's model for ``model_name`` (config from the registry plus
    ``overrides``), holding the weights :func:`~fastzoo.equivalence.weights.draw_` draws from
    ``seed``, in eval mode and with attention dropout 0."""
    entry = get_entry(model_name)
    spec = _checkable(model_name)
    torch.manual_seed(seed)
    dropout = {spec.original.attn_dropout_field: 0.0} if spec.original.attn_dropout_field else {}
    return draw_(spec.original.build({**entry.config, **dropout, **overrides}), seed=seed).eval()


def check(
    model_name: str,
    backend: str,
    *,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    overrides: dict | None = None,
    backend_options: dict | None = None,
    batch: int = 2,
    train: bool = True,
    layers: bool = False,
    seed: int = 0,
) -> Result:
    """Compare fastzoo's ``model_name`` on ``backend`` with the original library's model on the
    same weights and inputs (see the module docstring).

    ``train=True`` also compares parameter gradients where the backend has a backward on
    ``device`` (otherwise a note says why they were not compared). In bf16 / fp16 the backend is
    also checked alone (:mod:`fastzoo.equivalence.oplevel`: its output and dq/dk/dv on rounded
    q/k/v against fp64 attention, on the features the model uses), one comparison row each. Every
    normalisation is also run alone against the original's same-named module on inputs of variance
    near its eps (:mod:`fastzoo.equivalence.norms`), one row naming the worst. ``layers=True`` adds the
    per-layer report of each input form (fp32). Raises
    :class:`~fastzoo.errors.BackendUnavailableError` if the backend cannot serve the model
    here, exactly as ``fastzoo.create`` would.
    """
    device = torch.device(device)
    options = dict(backend_options or {})
    spec = _checkable(model_name)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    low = dtype != torch.float32
    result = Result(
        model_name, backend, options, str(device), dtype_name(dtype),
        rule=(f"max|ours-ref| <= {LOW_FACTOR:g} * max|original_{dtype_name(dtype)}-ref| + floor "
              f"(floor {LOW_OUT_FLOOR:g} outputs, {LOW_GRAD_FLOOR:g} relative grads); attention op: within "
              f"{oplevel.BOUND_MARGIN:g}x its measured error against fp64 attention on the same rounded inputs") if low else
             (f"fp32: max|ours-ref| <= {FP32_OUT_ATOL:g} or {FP32_OUT_ULPS} ulps of max|ref| (outputs), "
              f"relative grad error <= {FP32_GRAD_RTOL:g}; or within {LOW_FACTOR:g}x the original's own fp32 error "
              "(its runs on its users' kernels and in fp64), measured where the fixed tolerance fails"),
        reference=spec.original.description, weights=describe(seed),
    )
    ref = original(model_name, seed=seed, **(overrides or {}))
    caps = get_backend(backend, **options).capabilities
    grads = compares_grads(backend, options, device, train)
    if train and not grads:
        result.notes.append(f"gradients not compared: {backend} has no backward on {device.type}")
    # The fastzoo model reads its config and weights from the original, as a user would.
    ours = create(model_name, attn=backend, attn_options=options, pretrained=ref, device=device, dtype=dtype)
    ours.train(False)
    # the original in the low precision on its reference kernels and on its users' (equivalence.rule)
    peer = [m.to(device=device, dtype=dtype) for m in (copy.deepcopy(ref), spec.as_users_run_it(copy.deepcopy(ref)))] \
        if low else None
    ref = ref.to(device)
    # fp32: where the fixed tolerance fails, the original's own rounding is measured on this (compare's ``users``)
    users = None if low else (lambda: spec.as_users_run_it(copy.deepcopy(ref)))

    gen = torch.Generator().manual_seed(seed + 1)
    for form, ours_in, ref_in in spec.task.inputs(ours, batch, gen, caps, result.notes):
        suffix = f" ({form})" if form else ""
        comps, report = compare(ours, ref, ours_in, original_inputs=ref_in, grads=grads, layers=layers, peer=peer,
                                device=device, dtype=dtype, seed=seed, name=(ours_in.output or spec.task.compared) + suffix,
                                users=users)
        for c in comps[1:]:
            c.name += suffix
        result.comparisons += comps
        if report is not None:
            result.layers[form or "images"] = report
    probe = compare_norms(ours, ref, dtype=dtype, device=device, seed=seed, notes=result.notes)
    if probe is not None:
        result.comparisons.append(probe)
    if low and any(isinstance(m, UsesAttention) for m in ours.modules()):
        # the kernel alone, where the model's 3x rule is blunt: same rounded q/k/v against fp64 attention
        result.comparisons += oplevel.check_backend(
            backend, options, dtype=dtype, device=device, grads=train,
            request=ours.attention_request(device=device.type, dtype=dtype))
    if layers and low:
        result.notes.append("per-layer report: fp32 only (in low precision every layer differs a little)")
    return result


def example_inputs(model, batch: int = 2, seed: int = 1) -> list[tuple[str, Inputs]]:
    """The input forms :func:`check` feeds ``model`` (e.g. GPT-2: "padded", "packed" where its
    backend takes them), as ``(form, Inputs)``; for ``fastzoo check --explain``."""
    caps = model.attention_backend.capabilities
    gen = torch.Generator().manual_seed(seed)
    return [(form, ours) for form, ours, _ in spec_of(model).task.inputs(model, batch, gen, caps, [])]
