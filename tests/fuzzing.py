"""What the property-based tests (``tests/test_fuzz_*.py``) share: hypothesis profiles, strategies
read from the specs and the configs' own declarations, and the long profile's results file.

- Configs: every field of a family's config class is drawn from its declaration (type, ``ge`` /
  ``gt`` / ``le``, ``choices``, ``multiple_of``: :mod:`fastzoo.models.config`), kept small by
  the spec's ``tiny`` config (an int field ranges up to its tiny or default value, at most
  :data:`SMALL` where the family gives no size), each field half the time its tiny value; the
  checks that tie fields together (``validate``) are the config's own: a config they refuse is
  redrawn on the fields the error names. A new family, field or layout is fuzzed without a line
  here.
- Just outside: for each declared bound or choice, the nearest value that breaks it.
- Profiles: ``ci`` (the default: a bounded number of examples per property, minutes in all on
  a 2-core CPU) and ``long`` (``FASTZOO_FUZZ=long``: thousands, and a results file under
  ``benchmarks/results/<machine>/fuzz.json``). ``ci`` is derandomized: the same examples on every
  run, so CI passes or fails the same way on the same code; ``long`` draws anew each run. The
  example database and shrinking stay on: a failure found once is replayed first next time, then shrunk.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
import types
import typing
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

from fastzoo.errors import ConfigError

PROFILE = os.environ.get("FASTZOO_FUZZ", "ci")
SMALL = 16  # the largest int a field without a tiny value is drawn up to (a size, an id, a window)

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                      HealthCheck.function_scoped_fixture])
# CI draws the same examples on every run (a gate that passes or fails the same way on the same code); the
# long profile explores anew each time
settings.register_profile("ci", max_examples=10, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=1000, derandomize=False, **_COMMON)
settings.load_profile(PROFILE if PROFILE in ("ci", "long") else "ci")


def examples(ci: int, long: int):
    """The property's example budget in the current profile (``settings(max_examples=...)``);
    ``FASTZOO_FUZZ_EXAMPLES=N`` sets every property's."""
    n = os.environ.get("FASTZOO_FUZZ_EXAMPLES")
    return settings(max_examples=int(n) if n else long if PROFILE == "long" else ci)


# -- configs -----------------------------------------------------------------------------------
def _optional(tp) -> tuple[bool, list]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return len(rest) < len(args), rest
    return False, [tp]


def _bounds(meta) -> tuple[float | None, float | None, bool]:
    lo = meta.get("ge") if meta.get("ge") is not None else meta.get("gt")
    return lo, meta.get("le"), meta.get("gt") is not None


def _int_range(meta, base) -> tuple[int, int]:
    lo, hi, strict = _bounds(meta)
    lo = 0 if lo is None else (math.floor(lo) + 1 if strict else math.ceil(lo))
    small = base if isinstance(base, int) and not isinstance(base, bool) else SMALL
    top = max(lo + 1, min(small, SMALL) if base is None else small)
    return lo, int(min(top, hi) if hi is not None else top)


def _scalar(tp, meta, base, multiple: int | None = None) -> st.SearchStrategy:
    if meta.get("choices") is not None:
        return st.sampled_from(meta["choices"])
    if tp is bool:
        return st.booleans()
    if tp is int:
        lo, hi = _int_range(meta, base)
        if multiple:
            k_lo, k_hi = max(1, -(-lo // multiple)), max(1, -(-lo // multiple), hi // multiple)
            return st.integers(k_lo, k_hi).map(lambda k: k * multiple)
        return st.integers(lo, hi)
    if tp is float:
        lo, hi, strict = _bounds(meta)
        lo = 0.0 if lo is None else float(lo)
        top = float(hi) if hi is not None else max(2 * abs(base) if isinstance(base, (int, float)) and base else 1.0, lo + 1e-3)
        return st.floats(lo, top, exclude_min=strict, allow_nan=False, allow_infinity=False)
    if tp is str:
        return st.just(base)
    return st.just(base)  # a type the declarations do not describe (a dict of rope settings): the tiny value


def _value(tp, meta, base, multiple: int | None = None) -> st.SearchStrategy:
    """A value of annotation ``tp`` within the declaration ``meta``, sized like ``base``."""
    optional, arms = _optional(tp)
    strategies = []
    for arm in arms:
        origin, args = typing.get_origin(arm), typing.get_args(arm)
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                length = len(base) if isinstance(base, tuple) else None
                elems = base if isinstance(base, tuple) else (None,)
                elem = _scalar(args[0], meta, max(e for e in elems) if None not in elems else None, multiple)
                strategies.append(st.lists(elem, min_size=length or 1, max_size=length or 4).map(tuple))
            else:
                elems = base if isinstance(base, tuple) else (base,) * len(args)
                strategies.append(st.tuples(*(_scalar(a, meta, e, multiple) for a, e in zip(args, elems))))
        else:
            b = base if not isinstance(base, tuple) else max(base)
            strategies.append(_scalar(arm, meta, b, multiple))
    if optional:
        strategies.insert(0, st.none())
    return st.one_of(strategies)


def _described(tp) -> bool:
    """Whether the declarations describe values of annotation ``tp`` (scalars and tuples of them)."""
    for arm in _optional(tp)[1]:
        origin, args = typing.get_origin(arm), typing.get_args(arm)
        if arm not in (int, float, bool, str) and not (origin is tuple and all(a in (int, float, bool, str, Ellipsis)
                                                                             for a in args)):
            return False
    return True


def _variant_base(spec, hints, base: dict):
    """A strategy for the fields a variant brings to the tiny config: none half the time, else those of a
    variant whose fields of a type the declarations do not describe (a ResNet's or ViT's ``hf_config``)
    differ from ``base``'s: that variant's config under ``base``'s sizes (a variant without a head keeps
    none), so that the other fields start as the network the variant's ``hf_config`` names."""
    undescribed = [name for name, tp in hints.items() if not _described(tp)]
    out = []
    for v in spec.variants:
        if any(name in v.config and v.config[name] != base[name] for name in undescribed):
            own = {k: x for k, x in v.config.items() if k not in spec.tiny or k == "num_classes" and x == 0}
            if own not in out:
                out.append(own)
    return st.one_of(st.just({}), st.sampled_from(out)) if out else st.just({})


def _order(fields) -> list:
    """Fields with each ``multiple_of`` target before the fields that refer to it."""
    by_name = {f.name: f for f in fields}
    done, out = set(), []

    def visit(f):
        if f.name in done:
            return
        done.add(f.name)
        target = f.metadata.get("multiple_of")
        if target in by_name:
            visit(by_name[target])
        out.append(f)

    for f in fields:
        visit(f)
    return out


def non_default(spec, cfg: dict) -> dict:
    """The fields of ``cfg`` that differ from the config class's defaults (what an original's
    builder is given: it need not know fields fastzoo adds with their neutral default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(spec.config_class)}
    return {k: v for k, v in cfg.items() if k in spec.tiny or v != defaults.get(k)}


@st.composite
def configs(draw, spec, base: dict | None = None, fixed: dict | None = None, small: bool = False, redraws: int = 30):
    """A valid config (a dict of the original library's field names) of ``spec``'s family: each
    field its ``base`` value (default: the spec's tiny config over the class defaults) or a
    value drawn from its declaration; ``fixed``: fields left as given. ``small``: a size the tiny
    config leaves at a default above :data:`SMALL` (a ResNet's stage widths) is drawn up to
    :data:`SMALL` too (for properties where the original, which may need the default, is not built),
    and only a refused config's redrawn field may take its default again.
    A field of a type the declarations do not describe (a dict of settings) is not drawn: it keeps its
    tiny value, or half the time a variant's, whose fields become the base of the others
    (:func:`_variant_base`; a ResNet's or ViT's ``hf_config``: transformers' class is the original then).
    A config refused naming such a field and others has the others redrawn."""
    cls = spec.config_class
    hints = typing.get_type_hints(cls)
    fields = _order(dataclasses.fields(cls))
    defaults = {f.name: f.default for f in fields}
    base = {**defaults, **dict(spec.tiny), **(base or {})}
    base = {**base, **draw(_variant_base(spec, hints, base), label="variant fields")}
    base = {k: tuple(v) if isinstance(v, list) else v for k, v in base.items()}
    fixed = dict(fixed or {})
    values: dict = {}

    def draw_field(f, redraw=False):
        if f.name in fixed:
            values[f.name] = fixed[f.name]
            return
        if not _described(hints[f.name]):
            values[f.name] = base[f.name]
            return
        target = f.metadata.get("multiple_of")
        multiple = values.get(target) if target else None
        keep = draw(st.booleans())
        b = base[f.name]
        if small and not redraw and f.name not in spec.tiny and any(isinstance(v, int) and not isinstance(v, bool) and v > SMALL
                                                     for v in (b if isinstance(b, tuple) else (b,))):
            keep, b = False, tuple(min(v, SMALL) for v in b) if isinstance(b, tuple) else min(b, SMALL)
        if keep and (multiple is None or b is None or all(v % multiple == 0 for v in (b if isinstance(b, tuple) else (b,)))):
            values[f.name] = b
        else:
            values[f.name] = draw(_value(hints[f.name], f.metadata, b, multiple))

    for f in fields:
        draw_field(f)
    for _ in range(redraws):
        try:
            cls.from_dict(dict(values))
            return dict(values)
        except ConfigError as e:
            named = set(e.fields) or {draw(st.sampled_from([f.name for f in fields]))}
            named = {n for n in named if _described(hints[n])} or named  # hf_config stays: its network is redrawn
            for f in fields:  # a redrawn field's multiples are redrawn after it
                if f.name in named or f.metadata.get("multiple_of") in named:
                    named.add(f.name)
                    draw_field(f, redraw=True)  # its base value too, were it above SMALL (transformers' fixed widths)
    assume(False)


def image_sides(model, lo: int = 32) -> st.SearchStrategy:
    """(height, width) a detector takes alone in train mode: each in [lo, 2 lo] with ``lo`` raised to the
    model's ``min_image_side`` (every feature level keeps two positions), rounded up to its
    ``image_side_multiple`` (RT-DETR: maps that halve exactly)."""
    lo = max(lo, getattr(model, "min_image_side", 0))
    m = getattr(model, "image_side_multiple", None) or 1
    side = st.integers(lo, 2 * lo).map(lambda n: -(-n // m) * m)
    return st.tuples(side, side)


def eval_anchors_free(cfg: dict) -> dict:
    """``cfg`` with RT-DETR's fixed eval anchors off: with ``anchor_image_size`` eval mode takes images of that
    size alone (others are refused by name, tests/test_rt_detr.py), which an eval property's drawn sizes
    cannot meet."""
    return {**cfg, "anchor_image_size": None} if "anchor_image_size" in cfg else cfg


def just_outside(spec) -> list[tuple[str, object]]:
    """``(field, value)``: for every declared bound and choice of ``spec``'s config, the nearest
    value that breaks it (a wrong type too), each to be refused naming the field."""
    cls = spec.config_class
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta, (optional, arms) = f.metadata, _optional(hints[f.name])
        scalar = next((a for a in arms if a in (int, float, bool, str)), None)
        if meta.get("ge") is not None:
            out.append((f.name, meta["ge"] - (1 if scalar is int else 1e-9 * max(1.0, abs(meta["ge"])))))
        if meta.get("gt") is not None:
            out.append((f.name, meta["gt"] if scalar is not int else meta["gt"]))
        if meta.get("le") is not None:
            out.append((f.name, meta["le"] + (1 if scalar is int else 1e-9 * max(1.0, abs(meta["le"])))))
        if meta.get("choices") is not None:
            bad = "definitely_not_a_choice"
            out.append((f.name, (bad,) if any(typing.get_origin(a) is tuple for a in arms) else bad))
        if scalar in (int, float):
            out += [(f.name, float("nan")), (f.name, float("inf")), (f.name, True), (f.name, "1")]
        elif scalar is bool:
            out.append((f.name, 1))
        elif scalar is str:
            out.append((f.name, 1))
        if not optional and f.default is not None:
            out.append((f.name, None))
    return out


def undeclared_refusal(model, name: str, options: dict, error: Exception) -> str:
    """Empty where backend ``name``'s declared capabilities (``capability_problems``) or this machine
    (``unavailable``) say it cannot serve ``model``: a refusal counted as refused. Otherwise the
    failure: a backend refusing what it declares it serves."""
    from fastzoo.attention import get_backend
    from fastzoo.attention.availability import unavailable
    from fastzoo.attention.base import capability_problems

    caps = get_backend(name, **options).capabilities
    if unavailable(caps) or capability_problems(caps, model.attention_request()):
        return ""
    return f"{name}{options or ''}: refused although its declared capabilities serve the model: {error}"


# -- results (long profile) -----------------------------------------------------------------------
_LOCK = threading.Lock()
_COUNTS: dict[str, dict] = {}


def count(prop: str, **n) -> None:
    """Add to property ``prop``'s counters (examples, cases, refusals...)."""
    with _LOCK:
        c = _COUNTS.setdefault(prop, {"examples": 0})
        for k, v in n.items():
            c[k] = c.get(k, 0) + v


def fail(prop: str, kind: str, message: str):
    """Count a failure of ``kind`` (mismatches, bare_exceptions, half_loads, wrong_accepts, hangs)
    for the results file, then fail the example."""
    count(prop, **{kind: 1})
    raise AssertionError(message)


def results_path() -> Path | None:
    """Where the long profile writes its results (``FASTZOO_FUZZ_RESULTS`` overrides; the ci profile: nowhere)."""
    if os.environ.get("FASTZOO_FUZZ_RESULTS"):
        return Path(os.environ["FASTZOO_FUZZ_RESULTS"])
    if PROFILE != "long":
        return None
    from fastzoo.machine import device_name

    return Path(__file__).resolve().parent.parent / "benchmarks" / "results" / device_name("cpu") / "fuzz.json"


FAILURES = ("mismatches", "bare_exceptions", "half_loads", "wrong_accepts", "hangs")
MEANING = {  # what the results file's counters count
    "examples": "hypothesis examples that ran to the end (a config and its inputs; rejected draws not counted)",
    "cases": "equivalence: one config x input compared with the original on one backend (outputs, loss, gradients); "
             "concurrency: one thread's forward compared with the serial result",
    "refused": "requests refused by name as declared (a backend without the capability; a bad input or config)",
    "original_refused": "draws the original library cannot build or run (nothing to compare; not an example)",
    "original_unstable": "low-precision cases where the original's own runs in the dtype give NaN / +inf / -inf at "
                         "other places than its fp32 run (an overflow whose sign is rounding): not compared",
    "non_finite_spread": "packed input whose original output is itself non-finite, on a backend that attends over the "
                         "whole packed row (a NaN reaches the row's other sequences: declared, not compared)",
    "failures": "mismatches, bare_exceptions, half_loads, wrong_accepts, hangs: failing runs, hypothesis's "
                "replays and shrinking steps of one failure included",
}
_WRITTEN: set = set()  # results files this process has started (a run's file holds that run only)


@pytest.fixture(autouse=True)
def fuzz_results():
    """Time each property test and merge the counters it added into the results file (long
    profile); a test module imports it."""
    before = {k: dict(v) for k, v in _COUNTS.items()}
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    for prop in [p for p in _COUNTS if _COUNTS[p] != before.get(p)]:
        count(prop, seconds=elapsed)
        write_results(prop)


def write_results(prop: str) -> None:
    """Merge ``prop``'s counters, time and outcome into the results file."""
    path = results_path()
    if path is None:
        return
    with _LOCK:
        fresh = path not in _WRITTEN or not path.is_file()
        data = {"profile": PROFILE, "properties": {}} if fresh else json.loads(path.read_text())
        _WRITTEN.add(path)
        data["meaning"] = MEANING
        row = {"examples": 0, **{k: 0 for k in FAILURES}, **_COUNTS.get(prop, {})}
        row["seconds"] = round(row.get("seconds", 0.0), 1)
        row["passed"] = not any(row[k] for k in FAILURES)
        data["properties"][prop] = row
        from fastzoo.machine import load_average, versions

        from fastzoo.equivalence import describe

        # each example draws its own seed ("weights seed"), named with the failure it finds
        data["weights"] = describe(0).replace("seed=0", "seed=<each example's weights seed>")
        data.update(threads=os.environ.get("OMP_NUM_THREADS"), versions=versions(), load_average=load_average(),
                    examples_setting=os.environ.get("FASTZOO_FUZZ_EXAMPLES") or PROFILE)
        data["written"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)  # a reader never sees half a file
