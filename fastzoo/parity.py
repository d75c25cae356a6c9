"""Parity harness: does attention backend X compute the same model as the eager reference?

For one model and one backend, :func:`check_parity` builds the fp32 ``eager`` reference and
the candidate on identical weights, runs the same inputs through both (images for ViT; a
padded batch and the same sequences packed for GPT-2), and compares the outputs and every
parameter gradient, with DESIGN.md's rule:

- fp32: ``max|ours - ref| <= 1e-4`` for outputs; gradients by a relative error (below).
- fp16/bf16 (flash-attn's rule): ``max|ours - ref| <= 3 * max|peer - ref| + floor``, where the
  peer is the eager model run in the same dtype on the same device: a kernel may be as
  inexact as plain PyTorch in that dtype, times three, and no worse.

The gradient error of one parameter is ``max|g - g_ref| / max(max|g_ref|, 1e-2 * G)``, with
``G`` the largest reference gradient of the model: relative, because gradient magnitudes
differ by orders between layers, with a floor so that gradients that are zero in exact
arithmetic (e.g. the key bias, which softmax ignores) do not divide rounding noise by
rounding noise. The reported gradient error is the worst parameter's.

Packed outputs are compared token by token with the padded reference, so a packed run
that leaks attention across sequences fails. Models run in eval mode (no dropout) so that
the comparison is deterministic; gradients are still computed. Used by ``fastzoo check``
and the benchmarks' parity gate.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

import fastzoo
from fastzoo.attention import get_backend
from fastzoo.attention.base import dtype_name
from fastzoo.registry import get_entry

FP32_OUT_ATOL = 1e-4  # DESIGN.md: fp32 logits within 1e-4 of the reference
FP32_GRAD_RTOL = 1e-4  # fp32 gradients within 1e-4 of the parameter's gradient scale
LOW_FACTOR = 3.0  # flash-attn's rule: at most 3x the eager model's own low-precision error
LOW_OUT_FLOOR = 1e-5  # absolute floor, for a peer that happens to be exact
LOW_GRAD_FLOOR = 1e-5  # relative floor, likewise
GRAD_SCALE_FLOOR = 1e-2  # a parameter's gradient scale is at least 1% of the model's largest gradient

# Small configs for CPU runs and CI, in the original libraries' field names.
TINY = {
    "vit": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
}
_NO_ATTN_DROPOUT = {"gpt2": {"attn_pdrop": 0.0}, "vit": {"attn_drop_rate": 0.0}}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r}: choose one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def tiny_overrides(model_name: str) -> dict:
    family = get_entry(model_name).model_class.family
    if family not in TINY:
        raise ValueError(f"model {model_name!r} ({family}) has no attention to check; parity covers: {', '.join(TINY)}")
    return dict(TINY[family])


@dataclass
class Comparison:
    """One compared quantity: outputs or gradients, for one input form."""

    name: str  # e.g. "logits", "grads", "logits (packed)"
    err: float  # max |ours - ref| (gradients: worst relative error, see the module docstring)
    bound: float  # err must not exceed this
    peer_err: float | None = None  # low precision: the eager peer's error in the same dtype
    worst: str = ""  # the parameter with the largest gradient error

    @property
    def passed(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.bound


@dataclass
class ParityResult:
    model: str
    backend: str
    options: dict
    device: str
    dtype: str
    rule: str
    comparisons: list[Comparison] = field(default_factory=list)
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
                "eager peer error": "-" if c.peer_err is None else f"{c.peer_err:.2e}",
                "result": "pass" if c.passed else "FAIL" + (f" (worst: {c.worst})" if c.worst else ""),
            }
            for c in self.comparisons
        ]

    def to_dict(self) -> dict:
        return {
            "model": self.model, "backend": self.backend, "options": {k: repr(v) for k, v in self.options.items()},
            "device": self.device, "dtype": self.dtype, "rule": self.rule, "passed": self.passed, "notes": self.notes,
            "comparisons": [
                {"name": c.name, "err": c.err, "bound": c.bound, "peer_err": c.peer_err, "passed": c.passed, "worst": c.worst}
                for c in self.comparisons
            ],
        }


def check_parity(
    model_name: str,
    backend: str,
    *,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    overrides: dict | None = None,
    backend_options: dict | None = None,
    batch: int = 2,
    train: bool = True,
    seed: int = 0,
) -> ParityResult:
    """Compare ``backend`` with the fp32 eager reference on ``model_name`` (see the module docstring).

    ``train=True`` also compares parameter gradients where the backend has a backward on
    ``device`` (otherwise a note says why they were not compared). Raises
    :class:`~fastzoo.errors.BackendUnavailableError` if the backend cannot serve the model
    here, exactly as ``fastzoo.create`` would.
    """
    device = torch.device(device)
    options = dict(backend_options or {})
    family = get_entry(model_name).model_class.family
    if family not in _INPUTS:
        raise ValueError(f"model {model_name!r} ({family}) has no attention to check; parity covers: {', '.join(_INPUTS)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    low = dtype != torch.float32
    result = ParityResult(
        model_name, backend, options, str(device), dtype_name(dtype),
        rule=(f"max|ours-ref| <= {LOW_FACTOR:g} * max|eager_{dtype_name(dtype)}-ref| + floor "
              f"(floor {LOW_OUT_FLOOR:g} outputs, {LOW_GRAD_FLOOR:g} relative grads)") if low else
             (f"fp32: max|ours-ref| <= {FP32_OUT_ATOL:g} (outputs), relative grad error <= {FP32_GRAD_RTOL:g}"),
    )

    torch.manual_seed(seed)
    # Compared in eval mode, where attention dropout never runs: built at 0, since a backend
    # without dropout (flex, fa3) refuses a model configured with it.
    ref = fastzoo.create(model_name, attn="eager", **{**_NO_ATTN_DROPOUT.get(family, {}), **(overrides or {})})
    grads = train and device.type in get_backend(backend, **options).capabilities.backward
    if train and not grads:
        result.notes.append(f"gradients not compared: {backend} has no backward on {device.type}")
    # The candidate is the reference's twin, switched through the public API (same check as create).
    cand = copy.deepcopy(ref).train(grads)
    cand.set_attention(backend, device=device, dtype=dtype, **options)
    cand = cand.eval().to(device=device, dtype=dtype)
    peer = copy.deepcopy(ref).eval().to(device=device, dtype=dtype) if low else None
    ref = ref.eval().to(device)

    gen = torch.Generator().manual_seed(seed + 1)
    for form, inputs in _INPUTS[family](ref, batch, gen, get_backend(backend, **options).capabilities, result.notes):
        out_ref, g_ref = _run(ref, inputs, torch.float32, device, gen_seed=seed, grads=grads)
        out, g = _run(cand, inputs, dtype, device, gen_seed=seed, grads=grads)
        suffix = f" ({form})" if form else ""
        peer_out = peer_g = None
        if low:
            peer_out, peer_g = _run(peer, inputs, dtype, device, gen_seed=seed, grads=grads)
        result.comparisons.append(_compare_outputs("logits" + suffix, out, out_ref, peer_out))
        if grads:
            result.comparisons.append(_compare_grads("grads" + suffix, g, g_ref, peer_g))
    return result


# -- inputs ------------------------------------------------------------------------------
def _vit_inputs(model, batch, gen, caps, notes):
    cfg = model.config
    images = torch.randn(batch, cfg.in_chans, *cfg.img_size, generator=gen)
    yield "", {"args": (images,), "kwargs": {}, "float_args": True}


def _gpt2_inputs(model, batch, gen, caps, notes):
    cfg = model.config
    S = min(32, cfg.n_positions)
    lengths = [S - (i * S) // (2 * batch) for i in range(batch)]  # distinct lengths, all >= S/2
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    ids_BS = torch.zeros(batch, S, dtype=torch.long)
    mask_BS = torch.zeros(batch, S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids_BS[i, : len(s)] = s
        mask_BS[i, : len(s)] = 1
    if caps.padding_mask or caps.varlen:  # GPT-2 unpads a padded batch for packed-only backends
        yield "padded", {"args": (ids_BS,), "kwargs": {"attention_mask": mask_BS}, "keep": mask_BS.bool()}
    else:
        notes.append("padded batch not compared: the backend takes neither a key-padding mask nor packed sequences")
    if caps.varlen:
        from fastzoo.data import pack

        packed = pack(seqs)
        get = (lambda k: packed[k]) if isinstance(packed, Mapping) else (lambda k: getattr(packed, k))
        kwargs = {k: get(k) for k in ("position_ids", "cu_seqlens", "max_seqlen")}
        yield "packed", {"args": (get("input_ids"),), "kwargs": kwargs, "keep": None}
    else:
        notes.append("packed sequences not compared: the backend takes no cu_seqlens")


_INPUTS = {"vit": _vit_inputs, "gpt2": _gpt2_inputs}


# -- running and comparing -----------------------------------------------------------------
def _run(model, inputs, dtype, device, *, gen_seed: int, grads: bool):
    """Outputs of the real tokens as fp32 ``[N, C]``, and fp32 parameter gradients of a fixed
    random projection of them (the same projection for every model)."""
    def move(x):
        if not isinstance(x, torch.Tensor):
            return x
        x = x.to(device)
        return x.to(dtype) if inputs.get("float_args") and x.is_floating_point() else x

    args = [move(a) for a in inputs["args"]]
    kwargs = {k: move(v) for k, v in inputs["kwargs"].items()}
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        out = model(*args, **kwargs)
        out = getattr(out, "logits", out)  # GPT-2 returns transformers' output object
        out_NC = out.reshape(-1, out.shape[-1])
        if inputs.get("keep") is not None:  # padded batch: real tokens only, in (b, s) order
            out_NC = out_NC[inputs["keep"].to(device).reshape(-1)]
        out_NC = out_NC.float()
        if not grads:
            return out_NC.detach(), {}
        weight_NC = torch.randn(out_NC.shape, generator=torch.Generator().manual_seed(gen_seed + 2)).to(device)
        (out_NC * weight_NC).sum().backward()
    g = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    return out_NC.detach(), g


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"outputs differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a - b).abs().max().item()


def _compare_outputs(name, out, ref, peer) -> Comparison:
    err = _max_abs(out, ref)
    if peer is None:
        return Comparison(name, err, FP32_OUT_ATOL)
    peer_err = _max_abs(peer, ref)
    return Comparison(name, err, LOW_FACTOR * peer_err + LOW_OUT_FLOOR, peer_err)


def _grad_error(g: dict, ref: dict) -> tuple[float, str]:
    if set(g) != set(ref):
        missing = sorted(set(ref) ^ set(g))
        return math.inf, f"gradient missing for {missing[:3]}"
    top = max((r.abs().max().item() for r in ref.values()), default=0.0)
    worst, worst_name = 0.0, ""
    for n, r in ref.items():
        scale = max(r.abs().max().item(), GRAD_SCALE_FLOOR * top, 1e-30)
        e = _max_abs(g[n], r) / scale
        if math.isnan(e):
            return math.inf, n
        if e > worst:
            worst, worst_name = e, n
    return worst, worst_name


def _compare_grads(name, g, ref, peer) -> Comparison:
    err, worst = _grad_error(g, ref)
    if peer is None:
        return Comparison(name, err, FP32_GRAD_RTOL, worst=worst)
    peer_err, _ = _grad_error(peer, ref)
    return Comparison(name, err, LOW_FACTOR * peer_err + LOW_GRAD_FLOOR, peer_err, worst=worst)


# -- command line: `fastzoo check MODEL --attn ...` -------------------------------------------
def add_check_args(p) -> None:
    p.add_argument("model", help="model name (see `fastzoo list`)")
    p.add_argument("--attn", nargs="+", default=["all"], metavar="BACKEND",
                   help="backends to check: 'all', names, or NAME:key=value[:key=value] for options "
                        "(e.g. sdpa:sdpa_backend=math)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES))
    p.add_argument("--tiny", action="store_true", help="a small config of the model (CPU, CI)")
    p.add_argument("--no-grad", action="store_true", help="compare outputs only")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def parse_backend_spec(spec: str) -> tuple[str, dict]:
    """``"sdpa:sdpa_backend=math"`` -> ``("sdpa", {"sdpa_backend": "math"})``; values are Python literals or strings."""
    import ast

    name, *pairs = spec.split(":")
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"backend option {pair!r} in {spec!r}: write key=value")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return name, options


def cmd_check(args) -> int:
    import json

    from fastzoo.attention import list_attention
    from fastzoo.cli import markdown_table
    from fastzoo.errors import BackendUnavailableError

    dtype = parse_dtype(args.dtype)
    everything = args.attn == ["all"]
    specs = [(n, {}) for n in list_attention()] if everything else [parse_backend_spec(s) for s in args.attn]
    overrides = tiny_overrides(args.model) if args.tiny else None
    rows, results, failed = [], [], False
    for name, options in specs:
        try:
            res = check_parity(args.model, name, device=args.device, dtype=dtype, overrides=overrides,
                               backend_options=options, batch=args.batch, train=not args.no_grad)
        except BackendUnavailableError as e:
            failed |= not everything  # asked for by name: not being able to run it is a failure
            rows.append({"backend": name, "device": args.device, "dtype": args.dtype, "result": f"unavailable: {e}"})
            results.append({"backend": name, "options": {k: repr(v) for k, v in options.items()}, "unavailable": str(e)})
            continue
        except Exception as e:  # a kernel that crashes is a failed check, and the table goes on
            failed = True
            rows.append({"backend": name, "device": args.device, "dtype": args.dtype,
                         "result": f"ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            results.append({"backend": name, "options": {k: repr(v) for k, v in options.items()},
                            "error": f"{type(e).__name__}: {e}", "passed": False})
            continue
        failed |= not res.passed
        rows.extend(res.rows())
        rows.extend({"backend": name, "result": f"note: {n}"} for n in res.notes)
        results.append(res.to_dict())
    cols = ["backend", "device", "dtype", "compared", "max error", "bound", "eager peer error", "result"]
    print(f"Parity of {args.model}{' (tiny config)' if args.tiny else ''} against fp32 eager; rule: "
          + (f"fp32 abs {FP32_OUT_ATOL:g}, grads rel {FP32_GRAD_RTOL:g}" if dtype == torch.float32
             else f"<= {LOW_FACTOR:g} x the eager {args.dtype} error + floor"))
    print(markdown_table(rows, cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "tiny": args.tiny, "device": args.device, "dtype": args.dtype,
                       "torch": torch.__version__, "results": results}, f, indent=2)
    return 1 if failed else 0
