"""Equivalence: does a fastzoo model compute the same function as its original?

Three entry points, one rule:

- :func:`compare` takes a fastzoo model and the original (timm / Hugging Face / torchvision
  module, or a fastzoo twin) holding the same weights, runs the same inputs through both
  and compares the outputs and every parameter gradient. With ``layers=True`` it also hooks
  every module of both models, matched by module name (fastzoo's module names are the
  checkpoint's), and names the *first diverging layer*: in forward order the first module
  whose input still agrees with the original's but whose output does not; in backward order
  the first module whose output and the gradient arriving there agree, but whose input or
  own-parameter gradients do not. Each module's tensors are compared relative to the
  original's scale (fp32: 1e-4); the other model's activations are compared as they are
  made, so only one model's are held in memory.
- :func:`check` does all of that for a registered model and one attention backend: it builds
  the original library's model (eager attention, fp32) at random init, the fastzoo model from
  it (``fastzoo.create(name, pretrained=original, attn=backend)``) and the inputs (images for
  ViT; a padded batch and the same sequences packed for GPT-2). ``fastzoo check`` prints it.
- :func:`compare_cases` applies the rule to tensors a benchmark already computed.

The rule (every equivalence test, `fastzoo check` and the benchmarks apply it):

- fp32: ``max|ours - ref| <= 1e-4`` for outputs; gradients by a relative error (below).
- fp16/bf16 (flash-attn's rule): ``max|ours - ref| <= 3 * max|peer - ref| + floor``, where
  the peer is the original run in the same dtype on the same device: a kernel may be as
  inexact as plain PyTorch in that dtype, times three, and no worse.

The gradient error of one parameter is ``max|g - g_ref| / max(max|g_ref|, 1e-2 * G)``, with
``G`` the largest reference gradient of the model: relative, because gradient magnitudes
differ by orders between layers, with a floor so that gradients that are zero in exact
arithmetic (e.g. the key bias, which softmax ignores) do not divide rounding noise by
rounding noise. The reported gradient error is the worst parameter's. A foreign original's
gradients are translated to fastzoo's names by the same converter that translates its
weights (:mod:`fastzoo.weights`), transposes included.

Packed outputs are compared token by token with the padded reference, so a packed run that
leaks attention across sequences fails. Models run in eval mode (no dropout) so that the
comparison is deterministic; gradients are still computed.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from fastzoo.attention import get_backend
from fastzoo.registry import create, get_entry, spec_of
from fastzoo.text import dtype_name
from fastzoo.weights import Source, find_converter

FP32_OUT_ATOL = 1e-4  # fp32 logits within 1e-4 of the reference
FP32_GRAD_RTOL = 1e-4  # fp32 gradients within 1e-4 of the parameter's gradient scale
FP32_LAYER_RTOL = 1e-4  # a layer's output / gradients within 1e-4 of their own scale (fp32)
LOW_FACTOR = 3.0  # flash-attn's rule: at most 3x the original's own low-precision error
LOW_OUT_FLOOR = 1e-5  # absolute floor, for a peer that happens to be exact
LOW_GRAD_FLOOR = 1e-5  # relative floor, likewise
GRAD_SCALE_FLOOR = 1e-2  # a parameter's gradient scale is at least 1% of the model's largest gradient

def tiny_overrides(model_name: str) -> dict:
    """The family's small config (its spec's ``tiny``, original field names) for CPU runs and CI."""
    spec = _checkable(model_name)
    return dict(spec.tiny)


def _checkable(model_name: str):
    """The spec of ``model_name``, or a ValueError if its family has no original to compare with."""
    spec = get_entry(model_name).spec
    if spec.original is None or spec.task not in _INPUTS:
        covered = sorted(s.variants[0].name for s in _specs() if s.original is not None and s.task in _INPUTS)
        raise ValueError(f"model {model_name!r} ({spec.family}) has no original to check against; "
                         f"equivalence covers the families of: {', '.join(covered)}")
    return spec


def _specs():
    from fastzoo.registry import specs

    return specs()


# -- results -------------------------------------------------------------------------------
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


@dataclass
class LayerDiff:
    """One module, matched by name in both models: how far its output and its gradients are
    from the original's (relative to the original's own scale; ``None``: not compared)."""

    name: str
    output_err: float | None = None
    input_err: float | None = None  # its (first) input: wrong there means the fault is upstream
    grad_out_err: float | None = None  # the gradient arriving at the module's output
    grad_in_err: float | None = None  # the gradient it sends to its input, or its own parameters' (worst)
    bound: float = FP32_LAYER_RTOL

    def _bad(self, err) -> bool:
        return err is not None and not (math.isfinite(err) and err <= self.bound)

    @property
    def forward_diverges(self) -> bool:
        """Its output differs from the original's while its input does not: the fault is in here."""
        return self._bad(self.output_err) and not self._bad(self.input_err)

    @property
    def backward_diverges(self) -> bool:
        """Its gradients go wrong here: its output and the gradient arriving there agree with the
        original's, the gradients it sends to its input or its own parameters do not."""
        return (not self._bad(self.output_err) and not self._bad(self.grad_out_err)
                and self._bad(self.grad_in_err))


@dataclass
class LayerReport:
    """Every module both models share, in forward order, and where they first part."""

    layers: list[LayerDiff]  # forward (completion) order
    backward_order: list[str]  # module names in the order their backward ran
    notes: list[str] = field(default_factory=list)

    @property
    def first_forward(self) -> LayerDiff | None:
        """The first module, in forward order, whose output differs from the original's while its input agrees."""
        return next((d for d in self.layers if d.forward_diverges), None)

    @property
    def first_backward(self) -> LayerDiff | None:
        """The first module, in backward order, whose gradients go wrong inside it."""
        by_name = {d.name: d for d in self.layers}
        return next((by_name[n] for n in self.backward_order if n in by_name and by_name[n].backward_diverges), None)

    @property
    def first(self) -> LayerDiff | None:
        """The first diverging layer: the forward one if the outputs part, else the backward one."""
        return self.first_forward or self.first_backward

    def rows(self) -> list[dict]:
        first_f, first_b = self.first_forward, self.first_backward

        def fmt(e):
            return "-" if e is None else f"{e:.2e}"

        return [
            {"layer": d.name or "(model)", "input error": fmt(d.input_err), "output error": fmt(d.output_err),
             "grad at output": fmt(d.grad_out_err),
             "grad at input/params": fmt(d.grad_in_err), "bound": f"{d.bound:.0e}",
             "": ("<- first forward divergence" if d is first_f else "") + ("<- first backward divergence" if d is first_b else "")}
            for d in self.layers
        ]


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
            "passed": self.passed, "notes": self.notes,
            "comparisons": [
                {"name": c.name, "err": c.err, "bound": c.bound, "peer_err": c.peer_err, "passed": c.passed, "worst": c.worst}
                for c in self.comparisons
            ],
            "first_diverging_layer": {
                form: (None if r.first is None else r.first.name) for form, r in self.layers.items()
            },
        }


# -- the rule ----------------------------------------------------------------------------------
def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"outputs differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def compare_outputs(name: str, out: torch.Tensor, ref: torch.Tensor, peer: torch.Tensor | None = None) -> Comparison:
    """``out`` against the fp32 ``ref``; ``peer``: the original in the same low precision (None in fp32)."""
    err = _max_abs(out, ref)
    if peer is None:
        return Comparison(name, err, FP32_OUT_ATOL)
    peer_err = _max_abs(peer, ref)
    return Comparison(name, err, LOW_FACTOR * peer_err + LOW_OUT_FLOOR, peer_err)


def _grad_error(g: dict, ref: dict) -> tuple[float, str]:
    if set(g) != set(ref):
        missing = sorted(set(ref) ^ set(g))
        return math.inf, f"gradient missing for {missing[:3]}"
    top = max((r.abs().max().item() for r in ref.values() if r.numel()), default=0.0)
    worst, worst_name = 0.0, ""
    for n, r in ref.items():
        if not r.numel():
            continue
        scale = max(r.abs().max().item(), GRAD_SCALE_FLOOR * top, 1e-30)
        e = _max_abs(g[n], r) / scale
        if math.isnan(e):
            return math.inf, n
        if e > worst:
            worst, worst_name = e, n
    return worst, worst_name


def compare_grads(name: str, g: dict, ref: dict, peer: dict | None = None) -> Comparison:
    """Parameter gradients ``g`` against ``ref`` (same names), by the relative rule above."""
    err, worst = _grad_error(g, ref)
    if peer is None:
        return Comparison(name, err, FP32_GRAD_RTOL, worst=worst)
    peer_err, _ = _grad_error(peer, ref)
    return Comparison(name, err, LOW_FACTOR * peer_err + LOW_GRAD_FLOOR, peer_err, worst=worst)


def compare_cases(ref: dict, got: dict, peer: dict | None = None, *, same_names: bool = True) -> list[Comparison]:
    """The benchmarks' gate: tensors a case computed, ``{"output": t, "grad:<param>": t, ...}``,
    against the fp32 reference's. Outputs, then gradients when the case has them.

    ``peer``: the reference model's outputs in the same low precision (None in fp32).
    ``same_names=False``: a peer library naming its own parameters; gradients are compared on
    the names and shapes both sides share (none shared: outputs only).
    """
    comps = [compare_outputs("output", got["output"].float(), ref["output"].float(), peer and peer["output"].float())]
    g, g_ref = _case_grads(got), _case_grads(ref)
    if not g or not g_ref:
        return comps
    g_peer = _case_grads(peer) if peer is not None else None
    if not same_names:
        shared = {k for k in g_ref if k in g and g[k].shape == g_ref[k].shape and (g_peer is None or k in g_peer)}
        if not shared:
            return comps
        g, g_ref = {k: g[k] for k in shared}, {k: g_ref[k] for k in shared}
        g_peer = {k: g_peer[k] for k in shared} if g_peer is not None else None
    comps.append(compare_grads("grads", g, g_ref, g_peer))
    return comps


def _case_grads(d: dict) -> dict[str, torch.Tensor]:
    return {k[len("grad:"):]: v for k, v in d.items() if k.startswith("grad:")}


# -- comparing two models ----------------------------------------------------------------------
def logits_of(out) -> torch.Tensor:
    """The tensor a model returns: itself, ``.logits`` (HF outputs), a tower's ``.pooler_output``
    (transformers' vision towers), ``["logits"]`` or the first element."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if getattr(out, "pooler_output", None) is not None:
        return out.pooler_output
    if isinstance(out, Mapping):
        return out["logits"]
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find the logits in a {type(out).__name__}")


@dataclass
class Inputs:
    """One forward's arguments. ``keep``: a ``[B, S]`` bool mask of the rows of the output to
    compare (a padded batch: real tokens only); ``float_args``: cast floating inputs to the run dtype."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    keep: torch.Tensor | None = None
    float_args: bool = False

    def to(self, device, dtype) -> "Inputs":
        def move(x):
            if not isinstance(x, torch.Tensor):
                return x
            x = x.to(device)
            return x.to(dtype) if self.float_args and x.is_floating_point() else x

        return Inputs(tuple(move(a) for a in self.args), {k: move(v) for k, v in self.kwargs.items()}, self.keep,
                      self.float_args)


@dataclass
class _Run:
    """One model's run. With layers: per module name, one entry per call, of its input, output
    and the gradients at both: tensors for the reference run, errors against it for the other."""

    out_NC: torch.Tensor | None = None
    grads: dict = field(default_factory=dict)
    seen: dict = field(default_factory=lambda: {"input": {}, "output": {}, "grad_out": {}, "grad_in": {}})
    forward_order: list = field(default_factory=list)
    backward_order: list = field(default_factory=list)

    def err(self, kind: str, name: str, ref: "_Run") -> float | None:
        """Worst error of one module over its calls (None: not comparable)."""
        errs = self.seen[kind].get(name)
        if errs is None or len(errs) != len(ref.seen[kind].get(name, ())) or any(e is None for e in errs):
            return None
        return max(errs, default=0.0)


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        return next((t for t in map(_first_tensor, x) if t is not None), None)
    if hasattr(x, "logits") or isinstance(x, Mapping):
        try:
            return _first_tensor(logits_of(x))
        except (KeyError, TypeError):
            return None
    return None


def _token_rows(t: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """A layer's tensor as comparable rows: a padded batch's real tokens (``keep``), a packed
    batch of one without its batch dim; so that padded and packed runs line up token by token."""
    if keep is not None and t.dim() >= 2 and tuple(t.shape[:2]) == tuple(keep.shape):
        return t[keep.to(t.device)]
    return t[0] if t.dim() >= 2 and t.shape[0] == 1 else t


def _hook(model: nn.Module, run: _Run, grads: bool, keep: torch.Tensor | None, against: _Run | None) -> list:
    """Forward (and full backward) hooks on every module. Without ``against`` they keep the
    tensors; with it they keep only each tensor's error against ``against``'s (one model's
    activations in memory, not two)."""
    keep = keep.bool() if keep is not None else None

    def record(kind, name, t):
        if t is None:
            return
        t = _token_rows(t.detach(), keep).float()
        calls = run.seen[kind].setdefault(name, [])
        if against is None:
            calls.append(t.clone())
            return
        theirs = against.seen[kind].get(name, [])
        calls.append(_rel(t, theirs[len(calls)]) if len(calls) < len(theirs) else None)

    handles = []
    for name, mod in model.named_modules():
        def fwd(m, args, out, name=name):
            t = _first_tensor(out)
            if t is None:
                return
            run.forward_order.append(name)
            record("output", name, t)
            record("input", name, _first_tensor(list(args)))

        handles.append(mod.register_forward_hook(fwd))
        if grads:
            def bwd(m, grad_input, grad_output, name=name):
                run.backward_order.append(name)
                record("grad_out", name, _first_tensor(list(grad_output)))
                record("grad_in", name, _first_tensor(list(grad_input)))

            handles.append(mod.register_full_backward_hook(bwd))
    return handles


def _run(model: nn.Module, inputs: Inputs, dtype, device, *, seed: int, grads: bool, layers: bool = False,
         against: _Run | None = None) -> _Run:
    """Outputs of the compared rows as fp32 ``[N, C]``, and fp32 parameter gradients of a fixed
    random projection of them (the same projection for every model)."""
    inputs = inputs.to(device, dtype)
    model.zero_grad(set_to_none=True)
    run = _Run()
    handles = _hook(model, run, grads, inputs.keep, against) if layers else []
    try:
        with torch.set_grad_enabled(grads), warnings.catch_warnings():
            # a module whose inputs need no gradient (the patch projection) reports at its output: expected
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            warnings.filterwarnings("ignore", message="For backward hooks to be called")  # HF's output class
            out = logits_of(model(*inputs.args, **inputs.kwargs))
            out_NC = out.reshape(-1, out.shape[-1])
            if inputs.keep is not None:  # padded batch: real tokens only, in (b, s) order
                out_NC = out_NC[inputs.keep.to(device).reshape(-1)]
            out_NC = out_NC.float()
            if grads:
                weight_NC = torch.randn(out_NC.shape, generator=torch.Generator().manual_seed(seed + 2)).to(device)
                (out_NC * weight_NC).sum().backward()
    finally:
        for h in handles:
            h.remove()
    run.out_NC = out_NC.detach()
    if grads:
        run.grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    return run


def _in_fastzoo_names(model: nn.Module, original: nn.Module, grads: dict) -> dict:
    """The original's gradients under fastzoo's parameter names (the weights' converter, transposes included)."""
    from fastzoo.models.base import FastzooModel

    if isinstance(original, FastzooModel):
        return grads
    src = Source(grads, f"gradients of {type(original).__name__}")
    return find_converter(spec_of(model), src).to_fastzoo(grads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1e-12)
    return (a - b).abs().max().item() / scale if a.numel() else 0.0


def _layer_report(model: nn.Module, ours: _Run, ref: _Run, ref_grads: dict, bound: float) -> LayerReport:
    shared = [n for n in dict.fromkeys(ours.forward_order) if n in ref.seen["output"]]
    # A leaf's own parameter gradients depend only on the gradient at its output and its input
    # (both checked): wrong ones mean its backward is wrong. A container's (a ViT's pos_embed)
    # depend on everything after them, so they tell nothing about the container itself.
    own = {n: [p for p, _ in m.named_parameters(recurse=False)] for n, m in model.named_modules()
           if next(m.children(), None) is None}
    diffs = []
    for name in shared:
        d = LayerDiff(name, ours.err("output", name, ref), input_err=ours.err("input", name, ref), bound=bound)
        if ours.grads:
            d.grad_out_err = ours.err("grad_out", name, ref)
            errs = [ours.err("grad_in", name, ref)]
            for p in own.get(name, []):
                full = f"{name}.{p}" if name else p
                if full in ours.grads and full in ref_grads:
                    errs.append(_rel(ours.grads[full], ref_grads[full]))
            errs = [e for e in errs if e is not None]
            d.grad_in_err = max(errs) if errs else None
        diffs.append(d)
    notes = [] if shared else ["no module names shared by the two models: nothing to compare layer by layer"]
    return LayerReport(diffs, list(dict.fromkeys(ours.backward_order)), notes)


def compare(
    model: nn.Module,
    original: nn.Module,
    inputs: Inputs | tuple,
    *,
    original_inputs: Inputs | tuple | None = None,
    grads: bool = True,
    layers: bool = False,
    peer: nn.Module | None = None,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    name: str = "logits",
) -> tuple[list[Comparison], LayerReport | None]:
    """Compare ``model`` (run in ``dtype``) with ``original`` (fp32) on the same inputs.

    Both must hold the same weights and be in the mode to compare in (eval: no dropout).
    ``inputs`` is an :class:`Inputs` or a tuple of positional arguments; ``original_inputs``
    when the original takes another form of the same batch (padded vs packed). ``peer``: the
    original in ``dtype`` (low precision: sets the tolerance). ``layers=True`` also returns the
    per-layer :class:`LayerReport` (fp32 only: a low-precision run differs everywhere a little).
    Returns the comparisons (outputs, then gradients) and the report or None.
    """
    device = torch.device(device)
    inputs = inputs if isinstance(inputs, Inputs) else Inputs(tuple(inputs), float_args=True)
    original_inputs = inputs if original_inputs is None else (
        original_inputs if isinstance(original_inputs, Inputs) else Inputs(tuple(original_inputs), float_args=True))
    layers = layers and dtype == torch.float32
    ref = _run(original, original_inputs, torch.float32, device, seed=seed, grads=grads, layers=layers)
    ours = _run(model, inputs, dtype, device, seed=seed, grads=grads, layers=layers, against=ref)
    own = {n for n, _ in model.named_parameters()}  # the original's extra names (an HF tied head) are not compared
    ref_grads = {k: v for k, v in _in_fastzoo_names(model, original, ref.grads).items() if k in own} if grads else {}
    low = _run(peer, original_inputs, dtype, device, seed=seed, grads=grads) if peer is not None else None
    comps = [compare_outputs(name, ours.out_NC, ref.out_NC, low.out_NC if low else None)]
    if grads:
        peer_grads = None
        if low is not None:
            peer_grads = {k: v for k, v in _in_fastzoo_names(model, peer, low.grads).items() if k in ref_grads}
        comps.append(compare_grads("grads", ours.grads, ref_grads, peer_grads))
    report = _layer_report(model, ours, ref, ref_grads, FP32_LAYER_RTOL) if layers else None
    return comps, report


# -- a registered model against its original ------------------------------------------------------
def original(model_name: str, *, seed: int = 0, **overrides) -> nn.Module:
    """The original library's model for ``model_name`` (config from the registry plus
    ``overrides``), at random init from ``seed``, in eval mode and with attention dropout 0."""
    entry = get_entry(model_name)
    spec = _checkable(model_name)
    torch.manual_seed(seed)
    dropout = {spec.original.attn_dropout_field: 0.0} if spec.original.attn_dropout_field else {}
    return spec.original.build({**entry.config, **dropout, **overrides}).eval()


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
    ``device`` (otherwise a note says why they were not compared). ``layers=True`` adds the
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
              f"(floor {LOW_OUT_FLOOR:g} outputs, {LOW_GRAD_FLOOR:g} relative grads)") if low else
             (f"fp32: max|ours-ref| <= {FP32_OUT_ATOL:g} (outputs), relative grad error <= {FP32_GRAD_RTOL:g}"),
        reference=spec.original.description,
    )
    ref = original(model_name, seed=seed, **(overrides or {}))
    caps = get_backend(backend, **options).capabilities
    grads = train and device.type in caps.backward
    if train and not grads:
        result.notes.append(f"gradients not compared: {backend} has no backward on {device.type}")
    # The fastzoo model reads its config and weights from the original, as a user would.
    ours = create(model_name, attn=backend, attn_options=options, pretrained=ref, device=device, dtype=dtype)
    ours.train(False)
    peer = copy.deepcopy(ref).to(device=device, dtype=dtype) if low else None
    ref = ref.to(device)

    gen = torch.Generator().manual_seed(seed + 1)
    for form, ours_in, ref_in in _INPUTS[spec.task](ours, batch, gen, caps, result.notes):
        suffix = f" ({form})" if form else ""
        comps, report = compare(ours, ref, ours_in, original_inputs=ref_in, grads=grads, layers=layers, peer=peer,
                                device=device, dtype=dtype, seed=seed, name="logits" + suffix)
        for c in comps[1:]:
            c.name += suffix
        result.comparisons += comps
        if report is not None:
            result.layers[form or "images"] = report
    if layers and low:
        result.notes.append("per-layer report: fp32 only (in low precision every layer differs a little)")
    return result


def example_inputs(model, batch: int = 2, seed: int = 1) -> list[tuple[str, Inputs]]:
    """The input forms :func:`check` feeds ``model`` (e.g. GPT-2: "padded", "packed" where its
    backend takes them), as ``(form, Inputs)``; for ``fastzoo check --explain``."""
    caps = model.attention_backend.capabilities
    gen = torch.Generator().manual_seed(seed)
    return [(form, ours) for form, ours, _ in _INPUTS[spec_of(model).task](model, batch, gen, caps, [])]


def _image_inputs(model, batch, gen, caps, notes):
    cfg = model.config
    side = getattr(cfg, "img_size", None) or 64  # a convnet takes any size: 64 px keeps CPU runs short
    size = side if isinstance(side, (tuple, list)) else (side, side)
    images = Inputs((torch.randn(batch, cfg.in_chans, *size, generator=gen),), float_args=True)
    yield "", images, images


def _token_inputs(model, batch, gen, caps, notes):
    cfg = model.config
    S = min(32, model.n_positions or 32)  # a learned position table bounds the length; rotary does not
    lengths = [S - (i * S) // (2 * batch) for i in range(batch)]  # distinct lengths, all >= S/2
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    ids_BS = torch.zeros(batch, S, dtype=torch.long)
    mask_BS = torch.zeros(batch, S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BS[i, : len(s)] = s
        mask_BS[i, : len(s)] = 1
    padded = Inputs((ids_BS,), {"attention_mask": mask_BS}, keep=mask_BS.bool())
    if caps.padding_mask or caps.varlen:  # GPT-2 unpads a padded batch for packed-only backends
        yield "padded", padded, padded
    else:
        notes.append("padded batch not compared: the backend takes neither a key-padding mask nor packed sequences")
    if caps.varlen:
        from fastzoo.data import pack

        packed = pack(seqs)
        get = (lambda k: packed[k]) if isinstance(packed, Mapping) else (lambda k: getattr(packed, k))
        kwargs = {k: get(k) for k in ("position_ids", "cu_seqlens", "max_seqlen")}
        yield "packed", Inputs((get("input_ids"),), kwargs), padded  # the original runs the padded batch
    else:
        notes.append("packed sequences not compared: the backend takes no cu_seqlens")


# task -> the input forms a model of that task is compared on (see ModelSpec.task)
_INPUTS = {"image-classification": _image_inputs, "causal-lm": _token_inputs}


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
