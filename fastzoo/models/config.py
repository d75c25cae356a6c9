"""Model configs that describe themselves.

A model's config is a dataclass whose every field says, where it is declared, what it is:

- :func:`weights_decide`: part of the architecture that a checkpoint's tensors fix (a width,
  a depth, a vocabulary): read from the weights when loading, never free to differ.
- :func:`changes_function`: part of the function that the tensors cannot show (heads, an
  activation, a norm epsilon): must agree with a checkpoint that states it.
- :func:`free`: a runtime choice that leaves the function of the weights alone (dropout,
  init, ``channels_last``, loss settings): a checkpoint may differ in it.

Each declaration also carries the field's meaning and its constraint (``ge``/``gt``/``le``/
``choices``, and ``multiple_of``: the name of another field whose value this one's must be a
multiple of), and the annotation gives its type; a tuple's constraint holds for each element.
:class:`ModelConfig` checks every field against its type and constraint (and every float for being finite) exactly once, when a config is made (from overrides, a
YAML, a config.json or a checkpoint), and raises :class:`~fastzoo.errors.ConfigError`
naming the field; a subclass adds the checks that tie fields together in ``validate``.
Code that compares configs (``fastzoo.weights``) reads the declarations, not tables of
its own.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing

from fastzoo.errors import ConfigError, UnknownFieldError, did_you_mean

WEIGHTS, FUNCTION, FREE = "weights", "function", "free"
# the most repeated blocks a depth field may ask for (GPT-3 has 96, the deepest ResNets ~200 per
# stage): each is a Python module built before any size check could run (``registry.create``)
MAX_BLOCKS = 1024
KINDS = {
    WEIGHTS: "the checkpoint's tensors fix it",
    FUNCTION: "changes the function; a checkpoint cannot show it",
    FREE: "a runtime choice; the function of the weights stays the same",
}


def _field(kind, default, doc, *, ge=None, gt=None, le=None, choices=None, multiple_of=None, compare=None):
    meta = {"kind": kind, "doc": doc, "ge": ge, "gt": gt, "le": le,
            "choices": tuple(choices) if choices is not None else None, "multiple_of": multiple_of, "compare": compare}
    return dataclasses.field(default=default, metadata=meta)


def weights_decide(default, doc: str, *, ge=None, gt=None, le=None, choices=None, multiple_of=None, compare=None):
    """A field the checkpoint's tensors decide (see the module docstring). ``compare``: the part
    of the value that matters when comparing with a checkpoint (default: the whole value).
    ``multiple_of``: the name of the field this one's value (each element of a tuple) must be a
    multiple of (None in that field: no constraint)."""
    return _field(WEIGHTS, default, doc, ge=ge, gt=gt, le=le, choices=choices, multiple_of=multiple_of, compare=compare)


def changes_function(default, doc: str, *, ge=None, gt=None, le=None, choices=None, multiple_of=None, compare=None):
    """A field that changes the function but that the tensors cannot show."""
    return _field(FUNCTION, default, doc, ge=ge, gt=gt, le=le, choices=choices, multiple_of=multiple_of, compare=compare)


def free(default, doc: str, *, ge=None, gt=None, le=None, choices=None):
    """A runtime choice: a checkpoint may differ in it."""
    return _field(FREE, default, doc, ge=ge, gt=gt, le=le, choices=choices)


class ModelConfig:
    """Base of every model's config dataclass: fields declared with :func:`weights_decide`,
    :func:`changes_function` or :func:`free`, checked once here when the config is made."""

    # -- making one --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict, *, what: str = "override"):
        """The config from ``values`` (field names checked; every value checked by ``__post_init__``)."""
        cls.check_names(values, what=what)
        return cls(**values)

    @classmethod
    def check_names(cls, values, *, what: str = "override", where: str = "") -> None:
        """UnknownFieldError for the first name in ``values`` that is not a field
        (``where``: the file the names were read from, said first in the message)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for k in values:
            if k not in names:
                raise UnknownFieldError(
                    f"{where + ': ' if where else ''}unknown {what} {k!r} for {cls.__name__}."
                    f"{did_you_mean(k, names)} Valid fields: {', '.join(names)}", field=k)

    def __post_init__(self):
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(type(self), f, hints[f.name], getattr(self, f.name)))
        for f in dataclasses.fields(self):
            _check_multiple(self, f)
        self.validate()

    def validate(self) -> None:
        """Checks that tie fields together (e.g. width divisible by heads); raise
        :class:`ConfigError` with ``fields=`` naming all of them. Each field's own type and
        range are checked already."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # -- what it says about itself -------------------------------------------------------------
    @classmethod
    def field_kind(cls, name: str) -> str:
        """``"weights"``, ``"function"`` or ``"free"`` (an undeclared field counts as ``"function"``)."""
        f = {f.name: f for f in dataclasses.fields(cls)}[name]
        return f.metadata.get("kind", FUNCTION)

    @classmethod
    def fields_of_kind(cls, kind: str) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if cls.field_kind(f.name) == kind)

    def compared(self, name: str):
        """The part of field ``name`` that matters when comparing with a checkpoint's config."""
        f = {f.name: f for f in dataclasses.fields(self)}[name]
        compare = f.metadata.get("compare")
        return compare(self) if compare is not None else getattr(self, name)

    @classmethod
    def describe(cls) -> list[dict]:
        """One row per field: name, kind, type, default, constraint, meaning (``fastzoo list --config``)."""
        hints = _hints(cls)
        return [
            {"field": f.name, "kind": cls.field_kind(f.name), "type": _type_text(hints[f.name]),
             "default": repr(f.default), "constraint": _constraint_text(f.metadata) or "-",
             "meaning": f.metadata.get("doc", "")}
            for f in dataclasses.fields(cls)
        ]


# -- checking one field ------------------------------------------------------------------------
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _type_text(tp) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _constraint_text(meta) -> str:
    parts = []
    if meta.get("ge") is not None:
        parts.append(f">= {meta['ge']}")
    if meta.get("gt") is not None:
        parts.append(f"> {meta['gt']}")
    if meta.get("le") is not None:
        parts.append(f"<= {meta['le']}")
    if meta.get("choices"):
        parts.append("one of " + ", ".join(map(repr, meta["choices"])))
    if meta.get("multiple_of"):
        parts.append(f"a multiple of {meta['multiple_of']}")
    return " and ".join(parts)


class _Mismatch(Exception):
    pass


# A bool is an int to Python; to a config it is not (``n_head=True`` is a mistake, not 1).
_SCALARS = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _conform(value, tp):
    """``value`` as type ``tp`` (a list becomes a tuple, an int a float), or _Mismatch."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _conform(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if tp in _SCALARS:
        if not _SCALARS[tp](value):
            raise _Mismatch
        return float(value) if tp is float else value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_conform(v, args[0]) for v in value)
        if len(value) != len(args):
            raise _Mismatch
        return tuple(_conform(v, a) for v, a in zip(value, args))
    return value  # a type this checker does not know: the model's validate() checks it


def _check_range(value, meta) -> bool:
    if value is None or isinstance(value, (str, bool)):
        return True
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if (meta.get("ge") is not None and not v >= meta["ge"]) or (meta.get("gt") is not None and not v > meta["gt"]) \
                or (meta.get("le") is not None and not v <= meta["le"]):
            return False
    return True


def _check_multiple(cfg, f: dataclasses.Field) -> None:
    """The declared ``multiple_of``: ``f``'s value (each element of a tuple) a multiple of another field's."""
    other = f.metadata.get("multiple_of")
    value, divisor = getattr(cfg, f.name), getattr(cfg, other) if other else None
    if divisor is None or value is None:
        return
    if any(v % divisor for v in (value if isinstance(value, tuple) else (value,))):
        raise ConfigError(f"{f.name}={value} is not divisible by {other}={divisor} [{type(cfg).__name__}.{f.name}: "
                          f"{f.metadata.get('doc', '')}]", fields=(f.name, other))


def _checked(cls, f: dataclasses.Field, tp, value):
    meta = f.metadata
    where = f"{cls.__name__}.{f.name}" + (f": {meta['doc']}" if meta.get("doc") else "")
    try:
        value = _conform(value, tp)
    except _Mismatch:
        raise ConfigError(f"{f.name}={value!r}: must be {_type_text(tp)}, got {type(value).__name__} [{where}]",
                          fields=(f.name,)) from None
    if meta.get("choices") is not None and value is not None and any(
            v not in meta["choices"] for v in (value if isinstance(value, tuple) else (value,))):
        raise ConfigError(f"{f.name}={value!r}: choose one of {', '.join(map(repr, meta['choices']))} [{where}]",
                          fields=(f.name,))
    if not all(math.isfinite(v) for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, float)):
        raise ConfigError(f"{f.name}={value!r}: must be a finite number [{where}]", fields=(f.name,))
    if not _check_range(value, meta):
        raise ConfigError(f"{f.name}={value!r}: must be {_constraint_text(meta)} [{where}]", fields=(f.name,))
    return value
