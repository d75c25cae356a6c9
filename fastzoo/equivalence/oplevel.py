"""The op-level low-precision check: one attention backend on bf16 / fp16 q, k, v against fp64
attention on those same rounded inputs.

The model-level rule (``LOW_FACTOR`` times the original's own low-precision error) is blunt where
a whole model's rounding hides a small systematic error: a 1 % attention scale passes it in bf16.
Here only the kernel's own rounding counts: q, k, v (and the output gradient) are drawn, rounded
to the dtype once, and the fp64 reference runs on exactly those values, so the difference is what
the kernel computes differently. Two statistics per compared tensor (the output; dq, dk, dv), in
units of the dtype's rounding (``u``, the unit roundoff: 2^-8 bf16, 2^-11 fp16): the largest error,
``max|x - ref| / (u * max|ref|)``, which sees a bug in a few rows (one sequence's mask), and the root
mean square, ``rms(x - ref) / (u * rms(ref))``, which sees a small bug everywhere (a 1 % scale): a
kernel that rounds its scores to bf16 (eager) has random errors as large as that bug's at their
largest, but their rms is steady from draw to draw, and the bug's adds to it.

The reference (:func:`reference_attention`) is written from the contract's words
(``fastzoo.attention.base``: bottom-right causal, the sliding window, soft-capping, key padding,
packed documents, ``h // groups`` for grouped k/v) with its own index arithmetic, apart from
``attention.masks``: a check that shared the masks it checks would share their bugs.

The bounds are measured (:func:`bounds`): ``python benchmarks/oplevel_bounds.py`` runs every
backend and pinned kernel this machine has on CPU on ``MEASURE_DRAWS`` draws of every case it serves
(seeds apart from the check's) and writes each one's worst of each statistic to
``oplevel_bounds.json``; a backend's bound on CPU is ``BOUND_MARGIN`` times its own, and a backend
never measured (a user's) or on another device (a GPU's kernels are others) gets the worst of all. The run and its figures are in
benchmarks/results/cpu-2core/README.md. The draw makes every feature matter: scores with a standard
deviation of 2.5 (attention far from uniform), 64 keys, a soft cap of 3 (inside the scores' range),
a window of 9, three packed sequences, one row right-padded and one left-padded by 23 keys.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fastzoo.attention import get_backend
from fastzoo.attention.base import AttnContext, AttnRequest, Capabilities
from fastzoo.equivalence.rule import Comparison
from fastzoo.text import dtype_name

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# What measure() found for each CPU kernel (the largest and the rms error over MEASURE_DRAWS draws of
# every case it serves, outputs and gradients), written by `python benchmarks/oplevel_bounds.py`
BOUNDS_FILE = Path(__file__).with_name("oplevel_bounds.json")
BOUND_MARGIN = 1.5  # the bound is this times the measured worst: room for draws the measurement did not see
MEASURE_DRAWS = 40
CHECK_DRAWS = 2  # draws per case in equivalence.check (each case has 2 x 4 x 64 x 32 outputs)

B, HEADS, KV_HEADS, S, D = 2, 4, 2, 64, 32
SCORE_STD = 2.5  # q, k entries of std sqrt(2.5): scores q.k / sqrt(D) of std 2.5
SOFTCAP, WINDOW, QUERIES_CACHED = 3.0, 9, 16
PACKED_LENS, PADDING = (20, 37, 7), 23
SCALE = 0.7 * D**-0.5  # an explicit scale, not the default 1/sqrt(D)


@dataclass(frozen=True)
class Case:
    """One attention call the check draws: the features it exercises."""

    causal: bool = False
    padding: bool = False
    packed: bool = False
    window: bool = False
    softcap: bool = False
    gqa: bool = False
    kv_cache: bool = False
    scale: bool = False

    @property
    def name(self) -> str:
        on = [f for f in ("padding", "packed", "window", "softcap", "gqa", "kv_cache", "scale") if getattr(self, f)]
        return "+".join(["causal" if self.causal else "full"] + on)


_FEATURES = ("padding", "packed", "window", "softcap", "gqa", "kv_cache")


def _served(caps: Capabilities, case: Case, device: str) -> bool:
    return ((not case.causal or caps.causal) and (not case.padding or caps.padding_mask)
            and (not case.packed or caps.varlen) and (not case.window or caps.window)
            and (not case.softcap or caps.softcap) and (not case.kv_cache or caps.kv_cache)
            and device in caps.devices)


def cases(caps: Capabilities, request: AttnRequest | None = None, device: str = "cpu") -> list[Case]:
    """The cases a backend declaring ``caps`` serves on ``device``, restricted to what a model
    asking ``request`` uses (its causality and features; grouped k/v and an explicit scale always,
    as every backend takes them); ``request=None``: every case the backend serves."""
    if request is None:
        wanted = [Case(causal=c) for c in (False, True)] + [Case(causal=c, scale=True) for c in (False, True)]
        wanted += [Case(padding=True), Case(gqa=True)]
        wanted += [replace(Case(causal=True), **{f: True}) for f in _FEATURES]
    else:
        base = Case(causal=request.causal)
        uses = {"padding": request.padding_mask, "packed": request.varlen or request.unpads,
                "window": request.window and request.causal, "softcap": request.softcap,
                "kv_cache": request.kv_cache and request.causal, "gqa": True}
        wanted = [base, replace(base, scale=True)] + [replace(base, **{f: True}) for f in _FEATURES if uses[f]]
    # the features with no meaning without causality (a window, a cache's alignment) are drawn causal
    return [c for c in dict.fromkeys(wanted) if _served(caps, c, device)]


@dataclass
class Draw:
    """One case's rounded inputs and context, and which query rows carry real tokens."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    ctx: AttnContext
    real_BS: torch.Tensor  # [B, Sq] bool: the query rows compared


def draw(case: Case, dtype: torch.dtype, seed: int, device="cpu") -> Draw:
    """Rounded q, k, v and the output gradient of ``case`` (deterministic in ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    b = 1 if case.packed else B
    sq = QUERIES_CACHED if case.kv_cache else S
    hk = KV_HEADS if case.gqa else HEADS
    std = SCORE_STD**0.5 * (D**-0.5 / SCALE) ** 0.5 if case.scale else SCORE_STD**0.5

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * s).to(device=device, dtype=dtype)

    q, k, v = rnd(b, HEADS, sq, D, s=std), rnd(b, hk, S, D, s=std), rnd(b, hk, S, D)
    grad_out = rnd(b, HEADS, sq, D)
    ctx = AttnContext(causal=case.causal, scale=SCALE if case.scale else None,
                      window=WINDOW if case.window else None, softcap=SOFTCAP if case.softcap else None)
    real_BS = torch.ones(b, sq, dtype=torch.bool, device=device)
    if case.padding:
        pos = torch.arange(S, device=device)
        kpm = torch.stack([pos < S - PADDING, pos >= PADDING])  # one row right-padded, one left-padded
        ctx.key_padding_mask = kpm
        real_BS = kpm[:, S - sq:]
    if case.packed:
        ctx.cu_seqlens = torch.tensor([0, *torch.tensor(PACKED_LENS).cumsum(0).tolist()], dtype=torch.int32,
                                      device=device)
        ctx.max_seqlen = max(PACKED_LENS)
    grad_out = grad_out * real_BS[:, None, :, None]  # padding queries' outputs are never used
    return Draw(q, k, v, grad_out, ctx, real_BS)


def _allowed(ctx: AttnContext, b: int, sq: int, sk: int, device) -> torch.Tensor | None:
    """[b, 1, sq, sk] which keys each query sees, from the contract's words (fastzoo.attention.base)."""
    i = torch.arange(sq, device=device).view(1, 1, sq, 1) + (sk - sq)  # a query's position among the keys
    j = torch.arange(sk, device=device).view(1, 1, 1, sk)
    allowed = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=device)
    if ctx.causal:
        allowed = allowed & (j <= i)
    if ctx.window is not None:
        allowed = allowed & (i - j < ctx.window)
    if ctx.key_padding_mask is not None:
        allowed = allowed & ctx.key_padding_mask.to(device).view(b, 1, 1, sk)
    if ctx.cu_seqlens is not None:  # self-attention over packed sequences: each token in its own document
        ends = ctx.cu_seqlens.to(device=device, dtype=torch.long)[1:]
        doc = torch.bucketize(torch.arange(sk, device=device), ends, right=True)
        allowed = allowed & (doc.view(1, 1, sk, 1) == doc.view(1, 1, 1, sk))
    # a row that sees nothing (a padding query of a left-padded row) is never compared: let it see every key
    return allowed | ~allowed.any(-1, keepdim=True)


def reference_attention(q_BHSD, k_BHSD, v_BHSD, ctx: AttnContext) -> torch.Tensor:
    """Attention in fp64 as the contract defines it (``fastzoo.attention.base``), written apart from
    the masks the backends share."""
    q, k, v = (x.double() for x in (q_BHSD, k_BHSD, v_BHSD))
    b, hq, sq, d = q.shape
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # query head h reads h // groups
    scale = ctx.scale if ctx.scale is not None else d**-0.5
    scores = (q @ k.transpose(-2, -1)) * scale
    if ctx.softcap is not None:
        scores = ctx.softcap * torch.tanh(scores / ctx.softcap)
    scores = scores.masked_fill(~_allowed(ctx, b, sq, k.shape[-2], q.device), float("-inf"))
    return scores.softmax(-1) @ v


@dataclass
class Errors:
    """One draw's errors in units of the dtype's rounding: per compared tensor (``out``, ``dq``, ``dk``,
    ``dv``) the largest, ``max|x - ref| / (u * max|ref|)``, and the root mean square,
    ``rms(x - ref) / (u * rms(ref))``."""

    largest: dict[str, float]
    rms: dict[str, float]


def _units(x: torch.Tensor, ref: torch.Tensor, u: float) -> tuple[float, float]:
    diff = x.double() - ref
    if not bool(torch.isfinite(diff).all()):
        return math.inf, math.inf
    top, mean = ref.abs().max().item(), ref.square().mean().sqrt().item()
    err, rms = diff.abs().max().item(), diff.square().mean().sqrt().item()
    if not top:
        return (0.0, 0.0) if err == 0 else (math.inf, math.inf)
    return err / (u * top), rms / (u * mean)


def run_draw(backend, d: Draw, *, grads: bool) -> Errors:
    """The backend on one draw against the fp64 reference on the same rounded values."""
    u = UNIT_ROUNDOFF[d.q.dtype]
    q, k, v = (x.detach().clone().requires_grad_(grads) for x in (d.q, d.k, d.v))
    with torch.set_grad_enabled(grads):
        out = backend(q, k, v, d.ctx)
    qr, kr, vr = (x.detach().double().requires_grad_(grads) for x in (d.q, d.k, d.v))
    with torch.set_grad_enabled(grads):
        ref = reference_attention(qr, kr, vr, d.ctx)
    rows = d.real_BS[:, None, :, None].expand_as(ref)
    pairs = {"out": (out.detach()[rows], ref.detach()[rows])}
    if grads:
        out.backward(d.grad_out)
        ref.backward(d.grad_out.double())
        pairs.update(dq=(q.grad, qr.grad), dk=(k.grad, kr.grad), dv=(v.grad, vr.grad))
    units = {n: _units(x, r, u) for n, (x, r) in pairs.items()}
    return Errors({n: e[0] for n, e in units.items()}, {n: e[1] for n, e in units.items()})


QUANTITIES = ("out", "grad")  # the output; dq, dk, dv (the worst of the three)
STATS = ("largest", "rms")


def backend_label(name: str, options: dict | None = None) -> str:
    """``sdpa:sdpa_backend=math``: a backend and its options as ``fastzoo check --attn`` spells it."""
    return name + "".join(f":{k}={v}" for k, v in (options or {}).items())


def _measured() -> dict:
    return json.loads(BOUNDS_FILE.read_text())


def bounds(label: str | None, dtype: torch.dtype) -> dict[tuple[str, str], float]:
    """``(quantity, stat) -> bound`` in units for backend ``label`` on CPU in ``dtype``: ``BOUND_MARGIN``
    times what this backend measured (:func:`measure`), or for a backend not measured (a user's; None: any
    backend on another device, whose kernels differ) the worst of every measured backend."""
    table = _measured()["units"][dtype_name(dtype)]
    rows = [table[label]] if label in table else list(table.values())
    return {(q, st): BOUND_MARGIN * max(r[q][st] for r in rows if r.get(q)) for q in QUANTITIES for st in STATS
            if any(r.get(q) for r in rows)}


def _worst(errs: Errors) -> dict[tuple[str, str], tuple[float, str]]:
    """``(quantity, stat) -> (units, which tensor)`` of one draw."""
    found = {}
    for st, per in (("largest", errs.largest), ("rms", errs.rms)):
        found["out", st] = (per["out"], "out")
        grads = {n: e for n, e in per.items() if n != "out"}
        if grads:
            g = max(grads, key=lambda n: grads[n] if math.isfinite(grads[n]) else math.inf)
            found["grad", st] = (grads[g], g)
    return found


def check_backend(name: str, options: dict | None = None, *, dtype: torch.dtype, device="cpu",
                  request: AttnRequest | None = None, grads: bool = True, draws: int = CHECK_DRAWS,
                  seed: int = 0) -> list[Comparison]:
    """The op-level check of backend ``name`` (with ``options``) in ``dtype`` on ``device``: every
    case it serves that a model asking ``request`` uses (None: every case), ``draws`` draws each.
    Returns one comparison per quantity (the output; dq/dk/dv where the backend has a backward on
    ``device`` and ``grads``) and statistic (the largest error; the root mean square), each the worst
    case's, in units of the dtype's rounding, against :func:`bounds`."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: the op-level check is for bf16 / fp16, got {dtype_name(dtype)}")
    device = torch.device(device)
    backend = get_backend(name, **(options or {}))
    caps = backend.capabilities
    grads = grads and device.type in caps.backward
    todo = cases(caps, request, device.type)
    label = dtype_name(dtype)
    if not todo:
        return [Comparison(f"attention op vs fp64 ({label}): no case served on {device.type}", math.inf, 0.0)]
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    for case in todo:
        for n in range(draws):
            for key, (e, which) in _worst(run_draw(backend, draw(case, dtype, seed + n, device), grads=grads)).items():
                if key not in worst or not e <= worst[key][0]:  # NaN and inf are kept as the worst
                    worst[key] = (e, f"{case.name}: {which}")
    limit = bounds(backend_label(name, options) if device.type == "cpu" else None, dtype)
    what = {"out": "output", "grad": "dq/dk/dv"}
    return [Comparison(f"attention op vs fp64: {what[q]} {st}, {label} units", e, limit[q, st],
                       worst=where)
            for (q, st), (e, where) in sorted(worst.items())]


def cpu_backends() -> list[tuple[str, dict]]:
    """Every backend and pinned kernel this machine runs on CPU, as ``(name, options)``."""
    from fastzoo.attention import backend_class, list_attention

    found = []
    for name in list_attention(available_only=True):
        for opts in ({},) + tuple(backend_class(name).variants):
            try:
                backend = get_backend(name, **opts)
            except ValueError:  # a variant this torch cannot build
                continue
            if "cpu" in backend.capabilities.devices and backend.unavailable_reason() is None:
                found.append((name, dict(opts)))
    return found


def measure(dtype: torch.dtype, draws: int = MEASURE_DRAWS) -> dict[str, dict]:
    """Per CPU backend, the largest of each statistic over ``draws`` draws of every case it serves
    (units; seeds apart from the check's): what :func:`bounds` reads."""
    table = {}
    for name, opts in cpu_backends():
        backend = get_backend(name, **opts)
        grads = "cpu" in backend.capabilities.backward
        top: dict[str, dict[str, float]] = {}
        for case in cases(backend.capabilities, None, "cpu"):
            for n in range(draws):
                for (q, st), (e, _) in _worst(run_draw(backend, draw(case, dtype, 10_000 + n), grads=grads)).items():
                    top.setdefault(q, {})[st] = max(top.get(q, {}).get(st, 0.0), e)
        table[backend_label(name, opts)] = {q: top.get(q) for q in QUANTITIES}
    return table
