"""Model names -> the family spec and variant that build them, and ``fastzoo.create``.

Every family folder under ``fastzoo/models/`` exports ``SPECS`` from its ``spec.py`` (see
:mod:`fastzoo.models.spec`); the registry collects them and knows no family itself. ``create``
builds the model, checks the attention request, loads weights all-or-nothing, and moves it to
device/dtype.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import os
import pkgutil
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch

from fastzoo import models, weights
from fastzoo.attention import backend_class
from fastzoo.errors import CheckpointError, ConfigError, UnknownModelError
from fastzoo.models.spec import ModelSpec, Variant
from fastzoo.models.timm_api import timm_pretrained_cfg
from fastzoo.text import DTYPES


@dataclass(frozen=True)
class ModelEntry:
    """A registered name: the family spec and the variant it picks."""

    name: str
    spec: ModelSpec
    variant: Variant

    @property
    def model_class(self) -> type:
        return self.spec.model

    @property
    def config(self) -> dict:
        return dict(self.variant.config)

    @property
    def peer(self) -> str:
        return self.variant.peer

    @property
    def description(self) -> str:
        return self.variant.description

    @property
    def timm(self) -> str | None:
        return self.variant.timm


@lru_cache(maxsize=1)
def specs() -> tuple[ModelSpec, ...]:
    """Every family's spec, from each ``fastzoo/models/<family>/spec.py``."""
    out = []
    for info in pkgutil.iter_modules(models.__path__):
        if info.ispkg:
            module = importlib.import_module(f"{models.__name__}.{info.name}.spec")
            out += list(module.SPECS)
    return tuple(out)


@lru_cache(maxsize=1)
def _entries() -> dict[str, ModelEntry]:
    out: dict[str, ModelEntry] = {}
    for spec in specs():
        for variant in spec.variants:
            for name in (variant.name, *variant.aliases):
                if name in out:
                    raise RuntimeError(f"model name {name!r} is registered twice ({out[name].spec.family}, {spec.family})")
                out[name] = ModelEntry(variant.name, spec, variant)
    return out


def list_models(pattern: str | None = None) -> list[str]:
    """Every model name, its aliases included; ``pattern`` filters with shell wildcards as
    ``timm.list_models`` does (``"resnet*"``), ignoring case as the hub's ids do (``"qwen*"``)."""
    names = sorted(_entries())
    return names if pattern is None else [n for n in names if fnmatch.fnmatchcase(n.lower(), pattern.lower())]


def get_entry(name: str) -> ModelEntry:
    """The entry of ``name``, its case ignored where no name differs from it in case alone (a hub id,
    ``Qwen/Qwen3-0.6b``, is the hub's ``Qwen/Qwen3-0.6B``)."""
    entries = _entries()
    if name not in entries and isinstance(name, str):
        same = [n for n in entries if n.lower() == name.lower()]
        name = same[0] if len(same) == 1 else name
    if name not in entries:
        reason = next((s.refused[name] for s in specs() if name in s.refused), "") or next(
            (why for s in specs() if s.why_not is not None and (why := s.why_not(name))), "")
        raise UnknownModelError(name, entries, reason)
    return entries[name]


def spec_of(model) -> ModelSpec:
    """The spec of a built fastzoo model (its family)."""
    for spec in specs():
        if spec.family == getattr(model, "family", None):
            return spec
    raise ValueError(f"{type(model).__name__} is not a fastzoo model (no registered family {getattr(model, 'family', None)!r})")


def load_pretrained(model, source) -> None:
    """Load ``source`` (any form ``pretrained=`` takes) into ``model``, strictly; see
    :func:`fastzoo.weights.load_pretrained`."""
    weights.load_pretrained(model, source, spec_of(model))


def export_state_dict(model, format: str) -> dict:
    """The model's weights in ``format`` (e.g. "timm", "hf", "torchvision"), ready for that library."""
    return weights.export_state_dict(model, spec_of(model), format)


def create(
    name: str | None = None,
    *,
    attn: str | None = None,
    attn_options: dict | None = None,
    pretrained=None,
    device=None,
    dtype: torch.dtype | None = None,
    **overrides,
):
    """Build model ``name`` with attention backend ``attn`` (None: SDPA, or where SDPA cannot serve
    the model, such as Gemma 2's soft-capped scores, the first of varlen, eager that can).

    Without a name, ``pretrained`` names the model, as transformers' ``AutoModel.from_pretrained``
    does: a live timm / transformers / torchvision / fastzoo module or a directory with a
    config.json states its family and every size (see :func:`entry_of_source`); a bare state
    dict or weights file does not, and is a :class:`CheckpointError` asking for the name.

    ``overrides`` use the original library's field names (timm's for ViT, HF's for GPT-2).
    ``pretrained`` is any source :func:`fastzoo.load_pretrained` takes; the fields it decides
    are read from it unless overridden: all of them from a config.json or a live module
    (unwrapped from DDP / torch.compile), what the keys fix from a bare state dict.
    Overriding ``num_classes`` against a checkpoint gives a fresh head (with a warning).
    Train/eval mode follows the original library: GPT-2 loaded from ``pretrained`` is in eval
    mode (transformers' ``from_pretrained``); ViT, ResNet and the detector stay in train mode
    (``timm.create_model`` and torchvision's constructors).
    A ``device`` this machine cannot allocate on is a ValueError before anything is built.
    ``dtype`` is a torch dtype or its name (``"bfloat16"``, ``"bf16"``; ``"auto"``: the
    checkpoint's own, as transformers' ``from_pretrained``).
    ``device="meta"`` (or building inside ``with torch.device("meta"):``) allocates nothing:
    the big-model idiom, ``model.to_empty(device=...)`` then ``fastzoo.load_pretrained``.

    Image classifiers carry timm's ``pretrained_cfg``: the source's own (a live timm model's,
    a ``save_pretrained`` directory's) else timm's default for the variant (the variant's
    ``timm``). ``features_only=True`` (with ``out_indices=``, ``feature_cls=``) returns timm's
    feature wrapper around the model, as ``timm.create_model(..., features_only=True)``.
    """
    if name is None and pretrained is None:
        raise TypeError("create() needs a model name (fastzoo.list_models() lists them), or pretrained= a live "
                        "module or a directory with a config.json, which names the model itself")
    dtype = _dtype_arg(dtype)
    features = {k: overrides.pop(k) for k in ("features_only", "out_indices", "feature_cls") if k in overrides}
    if attn is not None:
        backend_class(attn)  # an unknown backend name fails before anything is built
    on_meta = _placement(device, pretrained)
    src = weights.read_source(pretrained) if pretrained is not None else None
    entry = get_entry(name) if name is not None else entry_of_source(src)
    if dtype == "auto":  # transformers': the checkpoint's own dtype (none given: the model's default)
        dtype = next((t.dtype for t in (src.state_dict.values() if src else ()) if t.is_floating_point()), None)
    model, changed = _build(entry, src, overrides, device, dtype, on_meta)
    model.model_name = entry.name
    if entry.spec.task.pretrained_cfg:
        known = weights.pretrained_cfg_of(src) if src is not None else None
        model.pretrained_cfg = known or timm_pretrained_cfg(entry.timm or model.timm_architecture)
    model.set_attention(attn, device=device, dtype=dtype, **(attn_options or {}))
    if src is not None:
        _load(model, entry.spec, src, changed)
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    return _as_features(model, entry.name or entry.spec.family, features)


def entry_of_source(src) -> ModelEntry:
    """The family and variant a source states (a live module, a config.json directory): the
    family whose converters read its keys and config, and the registered variant with exactly its
    sizes if there is one (transformers' sources prefer their hub names), else the family with no
    variant (``model_name`` None: every field comes from the source)."""
    if not weights.states_config(src):
        raise CheckpointError(f"{src.origin}: a bare state dict (or weights file) does not say which architecture it "
                              f"is; pass the name: fastzoo.create(name, pretrained=...) (fastzoo.list_models() lists "
                              f"them), or give a live module or a directory with its config.json")
    fastzoo_name = (src.config or {}).get("fastzoo_model")
    if fastzoo_name in _entries():
        return _entries()[fastzoo_name]
    tried = []
    for spec in specs():
        if src.config and "family" in src.config and "fastzoo_model" in src.config and src.config["family"] != spec.family:
            continue
        try:
            values = weights.config_from_source(spec, src)
            cfg = spec.config_class.from_dict({**values}, what="checkpoint field")
        except (CheckpointError, ConfigError, TypeError, ValueError) as e:
            tried.append(f"{spec.family}: {str(e).splitlines()[0][:160]}")
            continue
        return _matching_variant(spec, cfg) or ModelEntry(None, spec, Variant(
            spec.family, {}, f"{spec.family} with the sizes of {src.origin}", src.origin))
    raise CheckpointError(f"{src.origin}: no fastzoo family reads it ({'; '.join(tried)})")


def _matching_variant(spec: ModelSpec, cfg) -> ModelEntry | None:
    """The variant of ``spec`` whose config gives ``cfg``'s function and sizes (free fields aside);
    one named after the same original library when there are several (transformers' hub ids for a
    config from transformers)."""
    hf = getattr(cfg, "hf_config", None) is not None
    found = []
    for variant in spec.variants:
        try:
            mine = spec.config_class.from_dict(dict(variant.config))
        except (ConfigError, TypeError, ValueError):
            continue
        if all(mine.compared(f.name) == cfg.compared(f.name) for f in dataclasses.fields(cfg)
               if cfg.field_kind(f.name) != "free"):
            found.append(variant)
    found.sort(key=lambda v: (getattr(spec.config_class.from_dict(dict(v.config)), "hf_config", None) is not None) != hf)
    return ModelEntry(found[0].name, spec, found[0]) if found else None


def _placement(device, pretrained) -> bool:
    """Check ``device`` (and that ``pretrained`` has storage to go into); True for the meta device."""
    if device is not None:
        check_device(device)
    on_meta = torch.device(device).type == "meta" if device is not None else False
    if pretrained is not None and torch.get_default_device().type == "meta":
        raise ValueError("pretrained= inside a torch.device('meta') context: the model would be built without storage, "
                         "so there is nothing to load into; create it outside the context (or build on meta, "
                         "model.to_empty(device=...), then fastzoo.load_pretrained(model, source))")
    if on_meta and pretrained is not None:
        raise ValueError("device='meta' builds a model without storage, so there is nothing to load pretrained= into: "
                         "call model.to_empty(device=...) and then fastzoo.load_pretrained(model, source)")
    return on_meta


def _build(entry: ModelEntry, src, overrides: dict, device, dtype, on_meta: bool):
    """The model of the variant's config, updated by what the source decides, then by
    ``overrides``; and the overridden fields where they differ from what the source implies."""
    cls = entry.model_class
    values = dict(entry.config)
    from_weights = weights.config_from_source(entry.spec, src) if src is not None else {}
    values.update(from_weights)
    if src is not None and src.config_origin:  # a config.json: its names are checked as fields of that file
        cls.config_class.check_names(from_weights, what="field", where=src.config_origin)
    values.update(overrides)
    with _blame_checkpoint(src, from_weights, overrides):  # sizes read from a checkpoint that do not fit the rest
        cfg = cls.config_class.from_dict(values)
        if not on_meta:
            check_fits(cls, cfg, device, dtype)
        with torch.device("meta") if on_meta else nullcontext():  # meta: no storage is ever allocated
            model = cls(cfg)
    implied = {**entry.config, **{k: v for k, v in overrides.items() if k not in from_weights}, **from_weights}
    changed = _overridden_fields(cls.config_class, implied, cfg, overrides) if src else set()
    return model, changed


def _load(model, spec: ModelSpec, src, changed: set[str]) -> None:
    """The source's weights into ``model``, all or nothing, fitted to the fields the user changed."""
    state = weights.to_fastzoo(spec, src)
    state, fresh, notes = model.adapt_checkpoint(state, changed)
    for note in notes:
        warnings.warn(f"{src.origin}: {note}", stacklevel=3)
    weights.load_into(model, state, src.origin, allow_missing=fresh)
    model.train(not weights.loads_in_eval(spec, src))


def _as_features(model, name: str, features: dict):
    """timm's feature wrapper around ``model`` when ``features_only=True``, else the model."""
    if features.pop("features_only", False):
        if not hasattr(model, "as_features"):
            raise ValueError(f"features_only=True: {name} has no feature maps to return (image classifiers have)")
        return model.as_features(**features)
    if features:
        raise ValueError(f"{', '.join(features)} go with features_only=True")
    return model


def check_fits(cls, cfg, device=None, dtype: torch.dtype | None = None) -> None:
    """A config whose weights alone exceed the memory of the device they go to is a
    :class:`ConfigError` naming its size fields, before anything is allocated (else a huge
    value means an allocator error deep inside, or the kernel killing the process). The model
    is built on the meta device to count them: its own arithmetic, no formula to keep in step."""
    sizes = [f.name for f in dataclasses.fields(cfg) if cfg.field_kind(f.name) == "weights"]
    given = ", ".join(f"{n}={getattr(cfg, n)!r}" for n in sizes)
    try:
        with torch.device("meta"):
            probe = cls(cfg)
    except (RuntimeError, TypeError, OverflowError) as e:  # a tensor size past int64: torch's errors for it vary
        raise ConfigError(f"{cls.__name__} with {given}: a tensor of this size cannot exist ({str(e).splitlines()[0]}); "
                          f"check these sizes", fields=tuple(sizes)) from e
    tensors = {id(t): t for t in (*probe.parameters(), *probe.buffers())}.values()
    built = sum(t.numel() * t.element_size() for t in tensors)  # as built: on the CPU, in the config's dtypes
    moved = sum(t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
                for t in tensors)  # then moved to device / dtype
    target = torch.device(device) if device is not None else torch.device("cpu")
    for where, need in ((torch.device("cpu"), built), (target, moved)):
        have = _memory_of(where)
        if have is not None and need > have:
            raise ConfigError(f"{cls.__name__} with {given}: its weights alone need {need / 2**30:.1f} GiB on "
                              f"{where}, more than the {have / 2**30:.1f} GiB this machine's {where.type} has; "
                              f"check these sizes", fields=tuple(sizes))


def _memory_of(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes, where torch or the OS can tell."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
    except (ValueError, OSError, AttributeError, RuntimeError, AssertionError):  # per platform and build
        return None
    return None


def _dtype_arg(dtype):
    """A torch dtype, or its name as torch / transformers / fastzoo spell it (``"float16"``,
    ``"bf16"``; ``"auto"``: the checkpoint's), or a ValueError naming the argument."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    named = DTYPES.get(dtype, getattr(torch, dtype, None)) if isinstance(dtype, str) else None
    if isinstance(named, torch.dtype) and named.is_floating_point:
        return named
    raise ValueError(f"dtype={dtype!r}: give a floating torch dtype or its name (float32, bfloat16, float16, "
                     f"{', '.join(DTYPES)}, or 'auto' for the checkpoint's)")


def check_device(device, *, what: str = "device") -> None:
    """A device this machine has, or a ValueError naming ``what`` (not a driver error from ``.to``)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:  # torch raises each, per device type and build
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what}={str(device)!r} is not available on this machine ({first}); use {what}='cpu' "
                         f"or a device torch can allocate on") from e


@contextmanager
def _blame_checkpoint(src, from_weights: dict, overrides: dict):
    """Turn a :class:`ConfigError` about fields read from the checkpoint into a CheckpointError
    naming the file they came from (its config.json when it has one) and which other field to pass (e.g. GPT-2's ``n_head``, which a state dict cannot
    tell). The error names its fields (``ConfigError.fields``): no message is parsed."""
    try:
        yield
    except ConfigError as e:
        named = list(e.fields)
        from_ckpt = [n for n in named if n in from_weights and n not in overrides]
        if src is None or not from_ckpt:
            raise
        to_pass = [n for n in named if n not in from_weights and n not in overrides]
        read = ", ".join(f"{n}={from_weights[n]!r}" for n in from_ckpt)
        hint = (f"pass {', '.join(f'{n}=' for n in to_pass)} to fastzoo.create() with the checkpoint's value"
                if to_pass else "the checkpoint's own config is inconsistent")
        raise CheckpointError(f"{src.config_origin or src.origin}: the checkpoint has {read}, which does not fit the rest of the config "
                              f"({e}); {hint}") from e


def _overridden_fields(config_class, from_checkpoint: dict, cfg, overrides: dict) -> set[str]:
    """Override names whose value differs from what the checkpoint implies."""
    try:
        ckpt_cfg = config_class.from_dict(from_checkpoint, what="checkpoint field")
    except ValueError:  # what the checkpoint implies is not a valid config on its own: compare raw values
        return {k for k, v in overrides.items() if k in from_checkpoint and v != from_checkpoint[k]}
    return {
        f.name
        for f in dataclasses.fields(cfg)
        if f.name in overrides and getattr(cfg, f.name) != getattr(ckpt_cfg, f.name)
    }
