"""``fastzoo.explain``: which kernel really ran, per attention layer and per loss, and why not the one asked for.

One forward (and backward, if asked) runs under ``torch.profiler``. Each attention layer's
backend call runs inside a profiler range named by the layer's module path, and each fastzoo
loss inside one named by the loss (:mod:`fastzoo.kernel_ranges`), so every op the profiler saw
is attributed to the layer or loss that launched it; backward ops are attributed through the
autograd sequence numbers that link them to their forward op. What the backend was asked for
(``sdpa_backend="flash"``, varlen's per-call pick, ``impl="kernel"``...) is compared with what
ran. A requested kernel that did not run is a :class:`KernelFallbackError` unless
``allow_fallback=True``; the explanation then says why (e.g. "PyTorch's CPU flash kernel takes
no dropout").

    >>> report = fastzoo.explain(model, images, backward=True)
    >>> print(report)        # one markdown row per layer group and loss
    >>> report.rows[0].executed
    ['aten::_scaled_dot_product_flash_attention_for_cpu']

kernel_report knows no backend by name: each backend declares the ops its kernels show in a
profile (``kernel_ops``) and, per call, which of them prove the requested kernel ran and what
it may run instead (``kernel_profile``). The op names the third-party libraries register
(flash_attn::, xformers, Transformer Engine, NKI) follow their documentation and are not
verified on hardware.
"""
from __future__ import annotations

import contextlib

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from fastzoo import kernel_ranges
from fastzoo.attention import deformable
from fastzoo.errors import FastzooError
from fastzoo.losses.registry import loss_of_function, losses

_DECOMPOSED = ("aten::bmm", "aten::baddbmm", "aten::softmax", "aten::_softmax_backward_data")
_ALLOCATION = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::to", "aten::_to_copy", "aten::contiguous",
               "aten::clone", "aten::copy_", "aten::zeros", "aten::zero_", "aten::fill_", "aten::resize_"}

class KernelFallbackError(FastzooError, RuntimeError):
    """A requested kernel did not run. ``.explanation`` holds the full report."""

    def __init__(self, explanation: "Explanation"):
        self.explanation = explanation
        rows = [r for r in explanation.rows if r.fallback]
        lines = [f"{r.where}: requested {r.requested}, ran {r.executed_text()}: {r.fallback}" for r in rows]
        super().__init__(
            "a requested kernel did not run (pass allow_fallback=True to accept the fallback):\n  " + "\n  ".join(lines)
        )


@dataclass
class KernelRow:
    """One attention layer or one loss: what it asked for and what the profiler saw it run."""

    kind: str  # "attention" | "loss" | "deformable" (the multi-scale deformable attention seam)
    where: str  # the layer's module path, or the loss's name
    requested: str
    executed: list[str] = field(default_factory=list)  # kernel ops in the forward, first seen first
    executed_backward: list[str] = field(default_factory=list)
    device_kernels: list[str] = field(default_factory=list)  # GPU kernels launched by those ops (CUDA only)
    calls: int = 0
    fallback: str | None = None  # why the requested kernel did not run; None: it ran

    def executed_text(self, backward: bool = False) -> str:
        names = self.executed_backward if backward else self.executed
        return ", ".join(names) if names else "nothing recognised"


@dataclass
class Explanation:
    device: str
    dtype: str
    backward: bool
    rows: list[KernelRow]
    warnings: list[str] = field(default_factory=list)  # torch's own words about kernel choice, if any

    @property
    def fallbacks(self) -> list[KernelRow]:
        return [r for r in self.rows if r.fallback]

    def table(self) -> str:
        """Markdown; consecutive attention layers with the same story share one row."""
        head = ["| where | requested | executed (forward) |" + (" executed (backward) |" if self.backward else "")
                + " fallback |", "|---" * (4 + self.backward) + "|"]
        lines = []
        for where, r in _grouped(self.rows):
            cells = [where, r.requested, r.executed_text()]
            if self.backward:
                cells.append(r.executed_text(backward=True))
            cells.append(r.fallback or "none")
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        said = [f"- {w.splitlines()[0]}" for w in self.warnings]
        return "\n".join([f"kernels on {self.device} ({self.dtype}):", *head, *lines]
                         + (["torch's warnings about kernels during the run:", *said] if said else []))

    def __str__(self) -> str:
        return self.table()


def _grouped(rows):
    """(label, row) with runs of same-story attention layers merged: ``blocks.0-11.attn``."""
    out = []
    for r in rows:
        key = (r.kind, r.requested, tuple(r.executed), tuple(r.executed_backward), r.fallback)
        if out and out[-1][0] == key:
            out[-1][1].append(r)
        else:
            out.append((key, [r]))
    for _, group in out:
        first, last = group[0].where, group[-1].where
        yield (first if len(group) == 1 else _span(first, last)), group[0]


def _span(first: str, last: str) -> str:
    a, b = re.findall(r"\d+", first), re.findall(r"\d+", last)
    if a and b and re.sub(r"\d+", "#", first) == re.sub(r"\d+", "#", last):
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:
            parts = re.split(r"(\d+)", first)
            parts[2 * i + 1] = f"{a[i]}-{b[i]}"
            return "".join(parts)
    return f"{first} .. {last}"


# -- what each backend call asked for --------------------------------------------------------------
class _Spy:
    """Stands in for a layer's backend while explaining: the same object to the model (attribute
    reads go through), each call inside the layer's profiler range, the kernel profile the
    backend declares for it recorded."""

    def __init__(self, backend, path: str):
        self._backend, self._path, self.profiles = backend, path, []

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def __call__(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        if q_BHSD.numel():
            try:
                self.profiles.append(self._backend.kernel_profile(q_BHSD, k_BHSD, ctx))
            except FastzooError:
                pass  # the call below raises it with the backend's own message
        with kernel_ranges.kernel_range("attention", self._path, self._backend.label()):
            return self._backend(q_BHSD, k_BHSD, v_BHSD, ctx)


def _attention_ops() -> re.Pattern:
    """Ops that are an attention kernel (forward or backward): the union of what every
    registered backend declares (``kernel_ops``)."""
    from fastzoo.attention import backend_class, list_attention

    return _union([backend_class(n).kernel_ops for n in list_attention()])


def _kernel_ops() -> re.Pattern:
    """Ops that are an attention or a loss kernel: the backends' union, the deformable-attention
    kernels' and every declared loss's ``kernel_ops``."""
    return _union([_attention_ops().pattern, deformable.kernel_ops()] + [loss.kernel_ops for loss in losses()])


def _union(declared: list[str | None]) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in dict.fromkeys(declared) if p), re.IGNORECASE)


def _ran_as_asked(profile, ran: list[str]) -> str | None:
    """None if ``profile``'s kernel shows among the ops that ran, else why not."""
    if not profile.checked:
        return None
    if profile.ops is None:  # plain tensor ops: no fused attention op in the list
        if all(n in _DECOMPOSED for n in ran):
            return None
    elif any(re.search(profile.ops, n, re.IGNORECASE) for n in ran):
        return None
    for pattern, why in profile.fallbacks:
        if any(re.search(pattern, n) for n in ran):
            return why
    return profile.missing or f"none of its ops ({profile.ops}) ran"


# -- reading the profile -----------------------------------------------------------------------------
def _descendants(evt):
    for child in evt.cpu_children:
        yield child
        yield from _descendants(child)


def _kernel_names(events, kernel_ops: re.Pattern) -> list[str]:
    """The attention/loss kernel ops among ``events`` (first seen first); the decomposed ops
    (bmm, softmax) if no kernel op ran."""
    events = list(events)
    matched = {id(e) for e in events if _is_kernel(e.name, kernel_ops)}
    found = list(dict.fromkeys(e.name for e in events if id(e) in matched and not _has_ancestor_in(e, matched)))
    if found:
        return found
    return list(dict.fromkeys(e.name for e in events if e.name in _DECOMPOSED))


def _is_kernel(name: str, kernel_ops: re.Pattern) -> bool:
    return not name.startswith("autograd::engine::") and bool(kernel_ops.search(name))


def _has_ancestor_in(evt, ids) -> bool:
    """Only the outermost kernel op is named (cross_entropy, not the log_softmax inside it)."""
    parent = evt.cpu_parent
    while parent is not None:
        if id(parent) in ids:
            return True
        parent = parent.cpu_parent
    return False


def _device_kernels(events) -> list[str]:
    out = []
    for e in events:
        for k in getattr(e, "kernels", []) or []:
            out.append(k.name if len(k.name) <= 80 else k.name[:77] + "...")
    return list(dict.fromkeys(out))


def _backward_events(range_events, all_events):
    """Backward ops of the forward ops in a range: autograd's evaluate_function events carry
    the sequence number of the forward op that created them."""
    seqs = {(e.sequence_nr, e.thread) for e in range_events if e.sequence_nr >= 0}
    out = []
    for e in all_events:
        if e.name.startswith("autograd::engine::evaluate_function:") and (e.sequence_nr, e.fwd_thread) in seqs:
            out.append(e)
            out.extend(_descendants(e))
    return out


def explain_model(model_name: str, backend: str, *, backend_options: dict | None = None, device="cpu",
                  dtype: torch.dtype = torch.float32, overrides: dict | None = None, batch: int = 2,
                  backward: bool = True, allow_fallback: bool = False) -> dict[str, Explanation]:
    """:func:`explain` on ``fastzoo.create(model_name, attn=backend)`` with the inputs
    ``fastzoo check`` uses, per input form ("" for images; "padded" / "packed" for GPT-2).
    ``backward`` only where the backend has one on ``device``; without it the forward runs as
    ``fastzoo check`` runs it then, under ``torch.no_grad()``."""
    from fastzoo.equivalence import example_inputs
    from fastzoo.registry import create

    model = create(model_name, attn=backend, attn_options=backend_options or {}, device=device, dtype=dtype,
                   **(overrides or {})).eval()
    backward = backward and torch.device(device).type in model.attention_backend.capabilities.backward
    out = {}
    for form, inputs in example_inputs(model, batch):
        inputs = inputs.to(device, dtype)
        with torch.no_grad() if not backward else contextlib.nullcontext():
            out[form] = explain(model, *inputs.args, backward=backward, allow_fallback=allow_fallback, **inputs.kwargs)
    return out


# -- the entry point ----------------------------------------------------------------------------------
def explain(model, *inputs, backward: bool = False, loss: Callable[[Any], torch.Tensor] | None = None,
            allow_fallback: bool = False, **kwargs) -> Explanation:
    """Run ``model(*inputs, **kwargs)`` once under the profiler and report, per attention layer and
    per fastzoo loss, the kernel requested, the kernel that executed, and why any fallback happened.

    ``loss(output) -> scalar`` runs after the forward (its kernels are reported too); with
    ``backward=True`` its result, else ``output.loss`` (GPT-2 with ``labels``), else the sum of the
    output's first tensor, is differentiated. The model runs in its current train/eval mode.
    Raises :class:`KernelFallbackError` if a requested kernel did not run, unless
    ``allow_fallback``.
    """
    from fastzoo.layers.attention import UsesAttention

    layers = [(path, m) for path, m in model.named_modules() if isinstance(m, UsesAttention) and m.backend is not None]
    spies = {}
    for path, m in layers:
        spies[path] = m.backend = _Spy(m.backend, path)
    kernel_ranges.quiet_profiler()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with warnings.catch_warnings(record=True) as caught, kernel_ranges.recording(), profile(activities=activities) as prof:
            warnings.simplefilter("always")
            out = model(*inputs, **kwargs)
            value = loss(out) if loss is not None else None
            if backward:
                _scalar(out, value).backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        for path, m in layers:
            m.backend = spies[path]._backend

    events = list(prof.events())
    kernel_ops = _kernel_ops()
    rows = []
    ranges = [(kernel_ranges.parse(e.name), e) for e in events]
    for path, m in layers:
        spy = spies[path]
        mine = [e for parsed, e in ranges if parsed and parsed[0] == "attention" and parsed[1] == path]
        rows.append(_attention_row(path, spy, mine, events, backward, kernel_ops))
    for parsed, e in ranges:
        if parsed and parsed[0] == "loss":
            rows.append(_loss_row(parsed, e, events, backward, kernel_ops))
        elif parsed and parsed[0] == deformable.RANGE_KIND:
            rows.append(_deformable_row(parsed, e, events, backward, kernel_ops))
    rows = _merge_loss_calls(rows)
    p = next(model.parameters(), None)
    if p is None:
        p = next((x for x in inputs if isinstance(x, torch.Tensor)), torch.empty(0))
    texts = [str(w.message) for w in caught if _mentions_kernels(str(w.message))]
    report = Explanation(device=str(p.device), dtype=str(p.dtype).replace("torch.", ""),
                         backward=backward, rows=rows, warnings=list(dict.fromkeys(texts)))
    if report.fallbacks and not allow_fallback:
        raise KernelFallbackError(report)
    return report


def _scalar(out, value) -> torch.Tensor:
    if value is not None:
        return value
    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, dict):
        out = out.get("logits", next(iter(out.values())))
    elif not isinstance(out, torch.Tensor):
        out = getattr(out, "logits", None) if hasattr(out, "logits") else out[0]
    return out.float().sum()


def _mentions_kernels(text: str) -> bool:
    return any(w in text.lower() for w in ("kernel", "flash", "efficient attention", "sdp", "fused"))


def _attention_row(path, spy, range_events, all_events, backward, kernel_ops) -> KernelRow:
    inside = [d for e in range_events for d in _descendants(e)]
    ran = _kernel_names(inside, kernel_ops)
    row = KernelRow("attention", path, requested=spy._backend.label(), executed=ran,
                    device_kernels=_device_kernels(inside), calls=len(spy.profiles))
    if backward:
        row.executed_backward = _kernel_names(_backward_events(inside, all_events), kernel_ops)
    if not spy.profiles:
        row.requested += " (not called)"
        return row
    stories = {p.requested + ("" if p.checked else " (not checked: declares no kernel_ops)"): p for p in spy.profiles}
    row.requested = "; ".join(stories)
    misses = [why for why in (_ran_as_asked(p, ran) for p in stories.values()) if why]
    row.fallback = "; ".join(dict.fromkeys(misses)) or None
    return row


def _loss_row(parsed, evt, all_events, backward, kernel_ops) -> KernelRow:
    _, name, requested = parsed
    inside = list(_descendants(evt))
    ran = _kernel_names(inside, kernel_ops)
    declared = loss_of_function(name)
    own_op = re.compile(declared.fused_op) if declared is not None and declared.fused_op else None
    fused = [n for n in ran if own_op is not None and own_op.search(n)]
    asks_fused = declared is not None and requested in declared.fused_impls
    row = KernelRow("loss", name, requested=f"{name} impl={requested}", executed=ran,
                    device_kernels=_device_kernels(inside), calls=1)
    if fused:  # the op's Python (vectorised) body shows its arithmetic ops; a compiled kernel only allocates
        op = next(e for e in inside if e.name == fused[0])
        # the loss's own ops inside it (the padded op's giou_valid_rows) are kernels too; their bodies are not
        arithmetic = {d.name for d in _descendants(op) if not own_op.search(d.name)} - _ALLOCATION
        compiled = bool(row.device_kernels) or not arithmetic
        row.executed = [f"{fused[0]} ({'compiled kernel' if compiled else 'vectorised closed form'})"] + [
            n for n in ran if n != fused[0]]
        if asks_fused and not compiled:
            row.fallback = "the fused op's compiled kernel is not loaded (see the build warning): ran its vectorised form"
    elif asks_fused:
        row.fallback = "the fused op did not run"
    if backward:
        row.executed_backward = _kernel_names(_backward_events(inside, all_events), kernel_ops)
    return row


def _deformable_row(parsed, evt, all_events, backward, kernel_ops) -> KernelRow:
    """A call of the deformable-attention seam: the kernel it resolved to (``auto->cpu``) must show its ops."""
    _, name, requested = parsed
    inside = list(_descendants(evt))
    ran = _kernel_names(inside, kernel_ops)
    kernel = deformable.KERNELS.get(requested.rpartition("->")[2])
    row = KernelRow(deformable.RANGE_KIND, name, requested=f"impl={requested}", executed=ran,
                    device_kernels=_device_kernels(inside), calls=1)
    if kernel is not None and not any(re.search(kernel.kernel_ops, n) for n in ran):
        row.fallback = f"none of the {kernel.name} kernel's ops ({kernel.kernel_ops}) ran"
    if backward:
        row.executed_backward = _kernel_names(_backward_events(inside, all_events), kernel_ops)
    return row


def _merge_loss_calls(rows):
    """Repeated calls of one loss or of the deformable seam with the same story: one row, counted."""
    out = []
    for r in rows:
        same = next((o for o in out if o.kind == r.kind and r.kind in ("loss", deformable.RANGE_KIND)
                     and o.where == r.where and o.requested == r.requested
                     and o.executed == r.executed and o.fallback == r.fallback), None)
        if same is None:
            out.append(r)
        else:
            same.calls += 1
    return out
