"""Two models on the same weights and inputs: outputs of the compared rows, and parameter
gradients of a fixed random projection of them, translated to fastzoo's names by the weights'
converter; optionally the per-layer report. In fp32, where the fixed tolerance fails, the original's
own fp32 rounding is measured (its runs on its users' kernels and in fp64) and judged by the rule."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fastzoo.attention.sdpa import on_math_kernel
from fastzoo.equivalence.exact import fp64_run
from fastzoo.equivalence.layers import LayerReport, Run, hook, layer_report, logits_of
from fastzoo.equivalence.rule import FP32_LAYER_RTOL, Comparison, compare_grads, compare_outputs
from fastzoo.registry import spec_of
from fastzoo.tasks import Inputs
from fastzoo.weights import Source, find_converter


def _run(model: nn.Module, inputs: Inputs, dtype, device, *, seed: int, grads: bool, layers: bool = False,
         against: Run | None = None) -> Run:
    """Outputs of the compared rows as fp32 ``[N, C]``, and fp32 parameter gradients of a fixed
    random projection of them (the same projection for every model); an fp64 run's in fp64."""
    inputs = inputs.to(device, dtype)
    model.zero_grad(set_to_none=True)
    run = Run()
    handles = hook(model, run, grads, inputs.keep, against) if layers else []
    try:
        with torch.set_grad_enabled(grads), warnings.catch_warnings():
            # a module whose inputs need no gradient (the patch projection) reports at its output: expected
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            warnings.filterwarnings("ignore", message="For backward hooks to be called")  # HF's output class
            raw = model(*inputs.args, **inputs.kwargs)
            out = logits_of(raw) if inputs.output is None else getattr(raw, inputs.output)
            out_NC = out.reshape(-1, out.shape[-1]) if out.ndim else out.reshape(1, 1)
            if inputs.keep is not None:  # padded batch: real tokens only, in (b, s) order
                out_NC = out_NC[inputs.keep.to(device).reshape(-1)]
            out_NC = out_NC if out_NC.dtype == torch.float64 else out_NC.float()
            if grads:
                weight_NC = torch.randn(out_NC.shape, generator=torch.Generator().manual_seed(seed + 2),
                                        dtype=torch.float32).to(device)  # one projection in every run, fp64's too
                (out_NC * weight_NC).sum().backward()
    finally:
        for h in handles:
            h.remove()
    run.out_NC = out_NC.detach()
    if grads:
        run.grads = {n: p.grad.detach() if p.grad.dtype == torch.float64 else p.grad.detach().float()
                     for n, p in model.named_parameters() if p.grad is not None}
    return run


def _in_fastzoo_names(model: nn.Module, original: nn.Module, grads: dict) -> dict:
    """The original's gradients under fastzoo's parameter names (the weights' converter, transposes included)."""
    from fastzoo.models.base import FastzooModel

    if isinstance(original, FastzooModel):
        return grads
    # the converter the original's own keys name (its gradients may lack a key that tells formats apart: a
    # parameter no loss reaches)
    src = Source(original.state_dict(), f"{type(original).__name__}")
    return find_converter(spec_of(model), src).to_fastzoo(grads)


def _own_rounding(spec, users: nn.Module, original: nn.Module, inputs: Inputs, device, *, seed: int,
                  grads: bool) -> tuple[list[Run], Run | None]:
    """The original's own fp32 rounding, measured: its runs on the kernels its users get (``users``: as
    PyTorch picks, and on SDPA's math kernel, which they get where flash does not serve) and its fp64 run
    (:func:`~fastzoo.equivalence.exact.fp64_run`; None where the original cannot run in fp64)."""
    runs = [_run(users, inputs, torch.float32, device, seed=seed, grads=grads)]
    with on_math_kernel():
        runs.append(_run(users, inputs, torch.float32, device, seed=seed, grads=grads))

    def wide(x):  # every floating input in fp64, a detector's labels (boxes in a list of dicts) too
        if isinstance(x, torch.Tensor):
            return x.double() if x.is_floating_point() else x
        if isinstance(x, dict):
            return {k: wide(v) for k, v in x.items()}
        return type(x)(wide(v) for v in x) if isinstance(x, (list, tuple)) else x

    inputs64 = dataclasses.replace(inputs, args=wide(inputs.args), kwargs=wide(inputs.kwargs))
    try:
        with fp64_run(spec.original):
            exact = _run(copy.deepcopy(original).double(), inputs64, torch.float64, device, seed=seed, grads=grads)
    except RuntimeError:
        exact = None
    return runs, exact


def compare(
    model: nn.Module,
    original: nn.Module,
    inputs: Inputs | tuple,
    *,
    original_inputs: Inputs | tuple | None = None,
    grads: bool = True,
    layers: bool = False,
    peer: nn.Module | Sequence[nn.Module] | None = None,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    name: str = "logits",
    users: Callable[[], nn.Module] | None = None,
) -> tuple[list[Comparison], LayerReport | None]:
    """Compare ``model`` (run in ``dtype``) with ``original`` (fp32) on the same inputs.

    Both must hold the same weights and be in the mode to compare in (eval: no dropout).
    ``inputs`` is an :class:`Inputs` or a tuple of positional arguments; ``original_inputs``
    when the original takes another form of the same batch (padded vs packed). ``peer``: the
    original in ``dtype``, or its runs on each of its kernels (low precision: sets the tolerance). ``layers=True`` also returns the
    per-layer :class:`LayerReport` (fp32 only: a low-precision run differs everywhere a little).
    ``users``: makes the original on the kernels its users get (fp32): where the fixed tolerance fails, the
    original's own fp32 rounding is measured on it and in fp64 (:func:`_own_rounding`), and the rule judges
    with it (``kernels`` and ``exact`` of :func:`~fastzoo.equivalence.rule.compare_outputs` /
    :func:`~fastzoo.equivalence.rule.compare_grads`: a measure only ever widens a bound).
    Returns the comparisons (outputs, then gradients) and the report or None.
    """
    device = torch.device(device)
    inputs = inputs if isinstance(inputs, Inputs) else Inputs(tuple(inputs), float_args=True)
    original_inputs = inputs if original_inputs is None else (
        original_inputs if isinstance(original_inputs, Inputs) else Inputs(tuple(original_inputs), float_args=True))
    layers = layers and dtype == torch.float32
    ref = _run(original, original_inputs, torch.float32, device, seed=seed, grads=grads, layers=layers)
    ours = _run(model, inputs, dtype, device, seed=seed, grads=grads, layers=layers, against=ref)
    # a second name of one of fastzoo's tied parameters (an HF tied head) is not compared twice; any other
    # name fastzoo lacks stays in, so that a parameter lost in the port fails the gradient comparison
    own = {n for n, _ in model.named_parameters()}
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - own
    ref_grads = {k: v for k, v in _in_fastzoo_names(model, original, ref.grads).items() if k not in aliases} if grads else {}
    peers = [] if peer is None else list(peer) if isinstance(peer, Sequence) else [peer]
    low = [_run(p, original_inputs, dtype, device, seed=seed, grads=grads) for p in peers]
    comps = [compare_outputs(name, ours.out_NC, ref.out_NC, [r.out_NC for r in low] or None)]
    if grads:
        peer_grads = [{k: v for k, v in _in_fastzoo_names(model, p, r.grads).items() if k in ref_grads}
                      for p, r in zip(peers, low)]
        comps.append(compare_grads("grads", ours.grads, ref_grads, peer_grads or None))
    if not peers and users is not None and not all(c.passed for c in comps):
        runs, exact = _own_rounding(spec_of(model), users(), original, original_inputs, device, seed=seed, grads=grads)
        comps = [compare_outputs(name, ours.out_NC, ref.out_NC, exact=None if exact is None else exact.out_NC,
                                 kernels=[r.out_NC for r in runs])]
        if grads:
            def named(r):
                return {k: v for k, v in _in_fastzoo_names(model, original, r.grads).items() if k in ref_grads}
            comps.append(compare_grads("grads", ours.grads, ref_grads, kernels=[named(r) for r in runs],
                                       exact=None if exact is None else named(exact)))
    report = layer_report(model, ours, ref, ref_grads, FP32_LAYER_RTOL) if layers else None
    return comps, report
