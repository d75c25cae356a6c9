"""Layer by layer: hooks on every module of both models, matched by name, and the first module
where they part (forward: output wrong while its input agrees; backward: the gradients it sends
wrong while its output and the gradient arriving there agree)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from fastzoo.equivalence.rule import FP32_LAYER_RTOL


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
class Run:
    """One model's run. With layers: per module name, one entry per call, of its input, output
    and the gradients at both: tensors for the reference run, errors against it for the other."""

    out_NC: torch.Tensor | None = None
    grads: dict = field(default_factory=dict)
    seen: dict = field(default_factory=lambda: {"input": {}, "output": {}, "grad_out": {}, "grad_in": {}})
    forward_order: list = field(default_factory=list)
    backward_order: list = field(default_factory=list)

    def err(self, kind: str, name: str, ref: "Run") -> float | None:
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


def hook(model: nn.Module, run: Run, grads: bool, keep: torch.Tensor | None, against: Run | None) -> list:
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1e-12)
    return (a - b).abs().max().item() / scale if a.numel() else 0.0


def layer_report(model: nn.Module, ours: Run, ref: Run, ref_grads: dict, bound: float) -> LayerReport:
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
