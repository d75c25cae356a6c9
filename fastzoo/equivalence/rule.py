"""The rule every equivalence test, ``fastzoo check``, the benchmarks and the accuracy-parity runs
apply (see :mod:`fastzoo.equivalence`): fp32 within fixed tolerances; a low precision within
``LOW_FACTOR`` times the original's own error in it (flash-attn's rule); gradients by a relative
error with a floor.

"The original's own error" in a low precision is the worse of the original's two runs in it: on its
reference kernels (timm's eager attention, as fastzoo's ``eager``) and on the kernels its users get
(``ModelSpec.as_users_run_it``: timm's fused attention, Hugging Face's SDPA). A fused kernel keeps
the attention's scores and probabilities in fp32 where the eager path rounds them to bf16: a
different rounding, which the eager run's error alone does not bound (the measurement:
benchmarks/results/cpu-2core/README.md, "Why the low-precision rule takes the original's worse run").
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

FP32_OUT_ATOL = 1e-4  # fp32 logits within 1e-4 of the reference
# ... or within this many fp32 units in the last place of the largest reference value, where that is
# coarser: logits of 1e7 (Granite's logits_scaling=1.2e-7) are resolved to 1 by fp32 itself. Below
# 1e-4 for every value under 52, so ordinary outputs keep the 1e-4 rule.
FP32_OUT_ULPS = 16
FP32_GRAD_RTOL = 1e-4  # fp32 gradients within 1e-4 of the parameter's gradient scale
FP32_LAYER_RTOL = 1e-4  # a layer's output / gradients within 1e-4 of their own scale (fp32)
LOW_FACTOR = 3.0  # flash-attn's rule: at most 3x the original's own low-precision error
LOW_OUT_FLOOR = 1e-5  # absolute floor, for a peer that happens to be exact
LOW_GRAD_FLOOR = 1e-5  # relative floor, likewise
GRAD_SCALE_FLOOR = 1e-2  # a parameter's gradient scale is at least 1% of the model's largest gradient
# ... and at least this: fp32 resolves no difference below its smallest normal number (1.2e-38), where
# denormals carry fewer bits the smaller they are. A GPT-2 with initializer_range=6.7e-42 (denormal
# weights) has gradients of that size, 4% apart between two kernels that round them alike elsewhere.
DENORMAL_SCALE = torch.finfo(torch.float32).tiny / FP32_GRAD_RTOL


@dataclass
class Comparison:
    """One compared quantity: outputs or gradients, for one input form."""

    name: str  # e.g. "logits", "grads", "logits (packed)"
    err: float  # max |ours - ref| (gradients: worst relative error, see the module docstring)
    bound: float  # err must not exceed this
    peer_err: float | None = None  # low precision: the original's own error in the same dtype
    worst: str = ""  # the parameter with the largest gradient error

    @property
    def passed(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.bound


def _abs_max(t: torch.Tensor) -> float:
    """``max |t|`` (NaN where ``t`` has one) from one min / max pass, without an ``|t|`` copy: the
    comparisons read gradients of a full-width layer (59M values in a 7B decoder's MLP) several times."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi).item()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"outputs differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    if not a.numel():
        return 0.0
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)  # an fp64 run's own digits kept
    err = _abs_max(a.to(wide) - b.to(wide))
    if math.isinf(err) and wide != torch.float64:  # two finite values near fp32's largest: their distance in fp64
        err = _abs_max(a.double() - b.double())
    return err


def _own_rounding(ref: torch.Tensor, exact: torch.Tensor | None) -> float:
    """The original's own fp32 error on these values: its fp32 run ``ref`` against another of its
    runs, ``exact`` (its fp64 run, or its fp32 run on its users' kernels; 0 where not measured or not
    finite: an unmeasurable error widens nothing)."""
    if exact is None:
        return 0.0
    e = _max_abs(ref, exact)
    return e if math.isfinite(e) else 0.0


def _runs(peer) -> list:
    """The original's runs ``peer``: one run or a sequence of runs (none: None)."""
    if peer is None:
        return []
    return list(peer) if isinstance(peer, Sequence) else [peer]


def compare_outputs(name: str, out: torch.Tensor, ref: torch.Tensor,
                    peer: torch.Tensor | Sequence[torch.Tensor] | None = None, *,
                    exact: torch.Tensor | None = None,
                    kernels: torch.Tensor | Sequence[torch.Tensor] | None = None) -> Comparison:
    """``out`` against the fp32 ``ref``; ``peer``: the original in the same low precision (None in
    fp32), or its runs on each of its kernels (the module docstring): the worst one's error counts.

    fp32: within the fixed tolerance, or within ``LOW_FACTOR`` times the original's own fp32 error
    where that is larger (never looser). That error is what the original measurably gives, the worse
    of: ``ref``'s distance from ``exact``, the original's fp64 run on the same weights and inputs
    (what fp32 rounding does to this function: an ill-conditioned one, e.g. a LayerNorm over one
    feature, whose output is rounding noise), and from ``kernels``, its fp32 run on the kernels its
    users get (transformers' SDPA where ``ref`` ran eager; a sequence: its run on each of those
    kernels, the worst counts): a set loss whose matcher meets a near tie settles it by rounding, and
    transformers' SDPA and eager runs then differ by 5.7e-4 on a drawn D-FINE's ``loss_giou``. Or, as
    in :func:`compare_grads`, flash-attn's rule one precision up: ``out`` within ``LOW_FACTOR`` times
    the original's fp32 error of the fp64 run itself."""
    err = _max_abs(out, ref)
    if peer is None:
        top = _abs_max(ref.float()) if ref.numel() else 0.0
        fixed = max(FP32_OUT_ATOL, FP32_OUT_ULPS * torch.finfo(torch.float32).eps * top)
        own64 = _own_rounding(ref, exact)
        own = max([own64] + [_own_rounding(ref, k) for k in _runs(kernels)])
        measured = exact is not None or kernels is not None
        c = Comparison(name, err, max(fixed, LOW_FACTOR * own), own if measured else None)
        if own64 and not c.passed:  # flash-attn's form one precision up, as in compare_grads
            c64 = Comparison(name, _max_abs(out, exact), LOW_FACTOR * own64, own64)
            return c64 if c64.passed else c
        return c
    peer_err = max(_max_abs(p, ref) for p in _runs(peer))
    return Comparison(name, err, LOW_FACTOR * peer_err + LOW_OUT_FLOOR, peer_err)


_NON_FINITE = (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf))


def _kind(t: torch.Tensor) -> torch.Tensor:
    """Per value: 0 finite, 1 NaN, 2 +inf, 3 -inf (:data:`_NON_FINITE`'s order)."""
    k = torch.zeros(t.shape, dtype=torch.int8)
    for i, (_, at) in enumerate(_NON_FINITE, 1):
        k[at(t)] = i
    return k


def unsettled(ref: torch.Tensor, peer: torch.Tensor | Sequence[torch.Tensor] | None) -> torch.Tensor:
    """Where the original's own low-precision runs ``peer`` give another kind of value than its fp32
    ``ref`` (finite, NaN, +inf, -inf): an overflow whose sign is the sign of a logit within the dtype's
    rounding of 0 (Granite's ``logits_scaling`` of 1e-40: +inf in fp32, -inf in bf16). There the kind is
    the original's rounding, not a function: fastzoo's value must be of one of the kinds the original
    gives there, and no value is compared (the original's own error there is not finite)."""
    if peer is None:
        return torch.zeros(ref.shape, dtype=torch.bool)
    k = _kind(ref)
    return torch.stack([_kind(p) != k for p in _runs(peer)]).any(0)


def nonfinite_difference(out: torch.Tensor, ref: torch.Tensor,
                         peer: torch.Tensor | Sequence[torch.Tensor] | None = None) -> str:
    """Empty where ``out`` is NaN, +inf and -inf exactly where ``ref`` is, each kind apart (a NaN
    for an overflow is a different result); else which kind is elsewhere than the reference's.
    ``peer``: the original's low-precision runs; where they give another kind than ``ref``
    (:func:`unsettled`), ``out`` may be of any kind one of the original's runs gives there."""
    if out.shape != ref.shape:
        raise ValueError(f"outputs differ in shape: {tuple(out.shape)} vs {tuple(ref.shape)}")
    excused = unsettled(ref, peer)
    if excused.any():
        k = _kind(out)
        ok = (k == _kind(ref)) | torch.stack([k == _kind(p) for p in _runs(peer)]).any(0)
        excused &= ok
    return next((kind for kind, at in _NON_FINITE if not torch.equal(at(out) & ~excused, at(ref) & ~excused)), "")


def _finite_part(t: torch.Tensor, ref: torch.Tensor, peer=None) -> torch.Tensor:
    """``t`` where ``ref`` is finite and the original's runs ``peer`` agree on that; 0 elsewhere."""
    return t.to(torch.promote_types(t.dtype, torch.float32)).masked_fill(~torch.isfinite(ref) | unsettled(ref, peer), 0)


def compare_outputs_where_finite(name: str, out: torch.Tensor, ref: torch.Tensor,
                                 peer: torch.Tensor | Sequence[torch.Tensor] | None = None, *,
                                 exact: torch.Tensor | None = None,
                                 kernels: torch.Tensor | Sequence[torch.Tensor] | None = None) -> Comparison:
    """:func:`compare_outputs` where the reference itself is not finite everywhere (a loss over no
    target, an original that overflows): ``out`` must be non-finite at the same places with the same
    kind (:func:`nonfinite_difference`, the original's low-precision runs' kinds where they differ from
    its fp32 run's), and the finite values are compared by the rule."""
    kind = nonfinite_difference(out, ref, peer)
    if kind:
        return Comparison(f"{name} ({kind} at other places than the original's)", math.inf, 0.0)
    return compare_outputs(name, _finite_part(out, ref, peer), _finite_part(ref, ref, peer),
                           None if peer is None else [_finite_part(p, ref, peer) for p in _runs(peer)],
                           exact=None if exact is None else _finite_part(exact, ref),
                           kernels=None if kernels is None else [_finite_part(k, ref) for k in _runs(kernels)])


def compare_grads_where_finite(name: str, g: dict, ref: dict, peer: dict | Sequence[dict] | None = None, *,
                               kernels: dict | Sequence[dict] | None = None, exact: dict | None = None) -> Comparison:
    """:func:`compare_grads` where some reference gradients are not finite: each such parameter's
    gradient must be non-finite at the same places with the same kind (as in
    :func:`compare_outputs_where_finite`), and every finite value of every parameter is compared (one
    overflowing gradient does not excuse the others)."""
    peers = None if peer is None else _runs(peer)

    def peer_of(n):
        return None if peers is None or any(n not in p or p[n].shape != ref[n].shape for p in peers) else [p[n] for p in peers]

    for n, r in ref.items():
        kind = nonfinite_difference(g[n], r, peer_of(n)) if n in g and g[n].shape == r.shape else ""
        if kind:
            return Comparison(f"{name} ({kind} at other places than the original's)", math.inf, 0.0, worst=n)
    finite = (lambda d: {n: _finite_part(t, ref[n], peer_of(n)) if n in ref and t.shape == ref[n].shape else t
                         for n, t in d.items()})
    return compare_grads(name, finite(g), finite(ref), None if peers is None else [finite(p) for p in peers],
                         kernels=None if kernels is None else [finite(k) for k in _runs(kernels)],
                         exact=None if exact is None else finite(exact))


def compare_loss(name: str, loss: torch.Tensor, ref: torch.Tensor, peer: Sequence[torch.Tensor] | None = None, *,
                 dtype: torch.dtype = torch.float32, exact: torch.Tensor | None = None,
                 kernels: torch.Tensor | Sequence[torch.Tensor] | None = None) -> Comparison:
    """A scalar loss against the fp32 reference's (non-finite values as in
    :func:`compare_outputs_where_finite`). fp32: the output rule. In a low precision ``dtype``, the
    original's own error on one number can cancel by chance (a Qwen2 layout, one head, vocabulary 2:
    across 20 seeds fastzoo's loss error was 3.07x the original's at worst, 0.55x at the median), so
    the bound is ``LOW_FACTOR`` times that error plus half a unit of ``dtype``'s rounding of the loss
    (round-to-nearest's largest error on the loss's own value): a loss of 5 in bf16 is held to
    3x the original's error + 0.02, so a loss 1% off fails even where the original's error cancelled.
    ``exact`` and ``kernels``: the original's fp64 loss and its losses on its users' kernels (fp32 only, as in
    :func:`compare_outputs`)."""
    if peer is None:
        return compare_outputs_where_finite(name, loss, ref, exact=exact, kernels=kernels)
    c = compare_outputs_where_finite(name, loss, ref, peer)
    finite = ref[torch.isfinite(ref)]
    return Comparison(c.name, c.err, c.bound + loss_rounding(_abs_max(finite) if finite.numel() else 0.0, dtype),
                      c.peer_err)


def loss_rounding(loss: float, dtype: torch.dtype) -> float:
    """Half a unit of ``dtype``'s rounding of a loss of size ``loss``: what a low-precision loss may
    differ by beyond ``LOW_FACTOR`` times the original's own error (:func:`compare_loss`)."""
    return torch.finfo(dtype).eps / 2 * abs(loss)


def _grad_errors(g: dict, ref: dict) -> dict[str, float]:
    """Each parameter's relative gradient error (the module docstring's rule); a name on one side
    only: inf."""
    if set(g) != set(ref):
        return {n: math.inf for n in sorted(set(ref) ^ set(g))}
    scale = {n: _abs_max(r) for n, r in ref.items() if r.numel()}
    top = max(scale.values(), default=0.0)
    # every reference gradient exactly 0 (a loss constant in every weight: a one-token vocabulary) leaves
    # no scale to be relative to: rounding noise (4e-8 from the fused cross-entropy) is judged on a scale of 1
    floor = max(GRAD_SCALE_FLOOR * top, DENORMAL_SCALE) if top else 1.0
    errs = {}
    for n, r in ref.items():
        e = _max_abs(g[n], r) / max(scale[n], floor) if r.numel() else 0.0
        errs[n] = math.inf if math.isnan(e) else e
    return errs


def _finite_max(values) -> float | None:
    """The largest of ``values`` that is measured and finite; None where none is."""
    return max((v for v in values if v is not None and math.isfinite(v)), default=None)


def _missing(g: dict, ref: dict) -> str:
    return f"gradient missing for {sorted(set(ref) ^ set(g))[:3]}"


def _grad_error(g: dict, ref: dict, errs: dict[str, float] | None = None) -> tuple[float, str]:
    """The worst parameter's relative error (``errs``: :func:`_grad_errors` of the two, where computed)."""
    if set(g) != set(ref):
        return math.inf, _missing(g, ref)
    errs = _grad_errors(g, ref) if errs is None else errs
    worst = max(errs, key=errs.get, default="")
    return errs.get(worst, 0.0), worst


def compare_grads(name: str, g: dict, ref: dict, peer: dict | Sequence[dict] | None = None, *,
                  kernels: dict | Sequence[dict] | None = None, exact: dict | None = None) -> Comparison:
    """Parameter gradients ``g`` against ``ref`` (same names), by the relative rule above; ``peer`` as
    in :func:`compare_outputs`.

    fp32: within 1e-4 of the scale, or within ``LOW_FACTOR`` times the original's own fp32 rounding
    where that is larger (never looser). The original's rounding is what it measurably gives: its
    disagreement with itself on the kernels its users get (``kernels``: transformers' SDPA, where
    ``ref`` ran its reference kernels; a sequence: its run on each, e.g. SDPA's CPU flash and math
    kernels) and its error against its own fp64 run (``exact``), the worst, parameter by parameter;
    one that cannot be measured (a name missing, a value not finite) widens nothing.
    A gradient near the rule's floor (1% of the largest) can be ill-conditioned: on a DETR whose
    input projection's gradient cancels, transformers' own fp32 gradient is 5.2e-5 of its scale
    from its fp64 one, and torch's CPU flash kernel (fastzoo's packed path) gives 1.7e-4 where its
    math kernel gives transformers' 5.2e-5; on another, transformers' SDPA is 1.64e-4 from its eager.

    Where ``exact`` is given, a parameter also passes by flash-attn's rule one precision up (fp64 the
    reference, fp32 the low precision): fastzoo's fp32 gradient within ``LOW_FACTOR`` times the
    original's own fp32 runs' (``ref``, ``kernels``) worst error from the fp64 one. This is the form
    that judges noise as noise: a gradient that is exactly 0 in exact arithmetic (the bias of a 1x1
    convolution under a GroupNorm of one channel per group, Deformable DETR's input projections) is
    fp32 rounding noise in every run, and two noisy runs' distance from each other (fastzoo's against
    the original's fp32) is not bounded by a multiple of one of them (4.6x measured, while fastzoo's
    distance from the fp64 gradient stays within the original runs' own)."""
    errs = _grad_errors(g, ref)
    err, worst = _grad_error(g, ref, errs)
    if peer is None:
        if not math.isfinite(err) or not ref:
            return Comparison(name, err, FP32_GRAD_RTOL, worst=worst)
        own = [_grad_errors(k, ref) for k in _runs(kernels)]
        own += [_grad_errors(ref, exact)] if exact is not None else []  # its fp32 run against its fp64 one
        # per parameter: its own rounding, where measured (finite), widens its own bound only
        rounding = {n: _finite_max(o.get(n) for o in own) for n in errs}
        bounds = {n: FP32_GRAD_RTOL if r is None else max(FP32_GRAD_RTOL, LOW_FACTOR * r) for n, r in rounding.items()}
        forms = {n: (errs[n], bounds[n], rounding[n]) for n in errs}
        if exact is not None:  # flash-attn's form against the fp64 run (the docstring), where it is the kinder one
            errs64 = _grad_errors(g, exact)
            own64 = [_grad_errors(r, exact) for r in (ref, *_runs(kernels))]
            for n in errs:
                r64 = _finite_max(o.get(n) for o in own64)
                if r64 and math.isfinite(errs64[n]) and errs64[n] / (LOW_FACTOR * r64) < errs[n] / bounds[n]:
                    forms[n] = (errs64[n], LOW_FACTOR * r64, r64)
        worst = max(forms, key=lambda n: forms[n][0] / forms[n][1])
        return Comparison(name, *forms[worst], worst=worst)
    peer_err = max(_grad_error(p, ref)[0] for p in _runs(peer))
    return Comparison(name, err, LOW_FACTOR * peer_err + LOW_GRAD_FLOOR, peer_err, worst=worst)


def compare_cases(ref: dict, got: dict, peer: dict | Sequence[dict] | None = None, *,
                  same_names: bool = True, exact: dict | None = None, kernels: dict | None = None) -> list[Comparison]:
    """The benchmarks' gate: tensors a case computed, ``{"output": t, "grad:<param>": t, ...}``,
    against the fp32 reference's. Outputs, then gradients when the case has them.

    ``peer``: the reference model's outputs in the same low precision (None in fp32), or its runs on
    each of its kernels (the module docstring: the worst one's error counts).
    ``exact``: the reference model's fp64 run (fp32 cases): outputs and gradients judged with the
    original's own fp32 error (:func:`compare_outputs` / :func:`compare_grads`' ``exact``).
    ``kernels``: the reference model's fp32 run on the kernels its users get (fp32 cases): its outputs' and
    gradients' disagreement with ``ref`` is the original's own rounding too (``kernels`` of
    :func:`compare_outputs` / :func:`compare_grads`).
    ``same_names=False``: a peer library naming its own parameters; gradients are compared on
    the names and shapes both sides share (none shared: outputs only).
    """
    peers = None if peer is None else _runs(peer)
    exact = None if peers else exact
    comps = [compare_outputs("output", got["output"].float(), ref["output"].float(),
                             peers and [p["output"].float() for p in peers],
                             exact=None if exact is None else exact["output"],
                             kernels=None if kernels is None or peers else kernels["output"].float())]
    g, g_ref = _case_grads(got), _case_grads(ref)
    if not g or not g_ref:
        return comps
    g_peer = [_case_grads(p) for p in peers] if peers else None
    if not same_names:
        shared = {k for k in g_ref if k in g and g[k].shape == g_ref[k].shape and all(k in p for p in g_peer or [])}
        if not shared:
            return comps
        g, g_ref = {k: g[k] for k in shared}, {k: g_ref[k] for k in shared}
        g_peer = [{k: p[k] for k in shared} for p in g_peer] if g_peer is not None else None
    g_exact = None if exact is None else {k: v for k, v in _case_grads(exact).items() if k in g_ref}
    g_kernels = None if kernels is None or peers else {k: v for k, v in _case_grads(kernels).items() if k in g_ref}
    comps.append(compare_grads("grads", g, g_ref, g_peer, kernels=g_kernels, exact=g_exact))
    return comps


def _case_grads(d: dict) -> dict[str, torch.Tensor]:
    return {k[len("grad:"):]: v for k, v in d.items() if k.startswith("grad:")}


# -- training runs: differences already measured, against the same rule ----------------------------
# The accuracy-parity runs (fastzoo.accuracy) compare whole training runs: loss curves, a final
# metric, the loss and gradients of one batch from shared weights. The rule is this module's: in
# fp32 a difference within its tolerance; in low precision within LOW_FACTOR times the original's
# own difference in that dtype from the fp32 reference, plus the fp32 tolerance as the floor.
def grad_error(g: dict, ref: dict) -> float:
    """The worst parameter's relative gradient error, ``max|g - g_ref| / max(max|g_ref|, 1e-2 * G)``
    (the module docstring's rule; a name missing on one side: inf)."""
    return _grad_error(g, ref)[0]


def curve_error(curve, ref) -> float:
    """The largest absolute difference of two curves over their common steps (inf where a value
    is not finite)."""
    errs = [abs(a - b) for a, b in zip(curve, ref)]
    return max((e if math.isfinite(e) else math.inf for e in errs), default=0.0)


def compare_errors(name: str, err: float, bound: float, peer_err: float | None = None) -> Comparison:
    """A measured difference from the fp32 reference against the rule: ``err <= bound`` in fp32;
    in low precision, where the original in the same dtype differs from the reference by
    ``peer_err``, ``err <= LOW_FACTOR * peer_err + bound``."""
    if peer_err is None:
        return Comparison(name, err, bound)
    return Comparison(name, err, LOW_FACTOR * peer_err + bound, peer_err)
