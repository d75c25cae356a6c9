"""Model names -> builder + default config, read from ``fastzoo/configs/<name>.yaml``.

Each YAML names the model class (``model: module:Class``), the peer it reproduces and
the config fields that make the variant. ``create`` builds the model, checks the
attention request, loads weights all-or-nothing, and moves it to device/dtype.
"""
from __future__ import annotations

import dataclasses
import importlib
import warnings
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import torch
import yaml

from fastzoo.attention import backend_class
from fastzoo.errors import CheckpointError, UnknownModelError
from fastzoo import weights


@dataclass(frozen=True)
class ModelEntry:
    name: str
    model: str  # "module:Class"
    config: dict
    peer: str
    description: str

    @property
    def model_class(self):
        module, cls = self.model.split(":")
        return getattr(importlib.import_module(module), cls)


@lru_cache(maxsize=1)
def _entries() -> dict[str, ModelEntry]:
    out = {}
    for path in sorted(resources.files("fastzoo.configs").iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".yaml"):
            continue
        text = path.read_text()
        data = yaml.safe_load(text)
        first = text.splitlines()[0].lstrip("# ").strip() if text.startswith("#") else ""
        name = path.name[: -len(".yaml")]
        out[name] = ModelEntry(name, data["model"], dict(data.get("config") or {}), data.get("peer", ""), first)
    return out


def list_models() -> list[str]:
    return sorted(_entries())


def get_entry(name: str) -> ModelEntry:
    entries = _entries()
    if name not in entries:
        raise UnknownModelError(name, entries)
    return entries[name]


def create(
    name: str,
    *,
    attn: str = "sdpa",
    attn_options: dict | None = None,
    pretrained=None,
    device=None,
    dtype: torch.dtype | None = None,
    **overrides,
):
    """Build model ``name`` with attention backend ``attn``.

    ``overrides`` use the original library's field names (timm's for ViT, HF's for GPT-2).
    ``pretrained`` is any source :func:`fastzoo.load_pretrained` takes; fields the weights
    decide (e.g. ``num_classes``) are read from them unless overridden. Overriding
    ``num_classes`` against a checkpoint gives a fresh head (with a warning).
    """
    entry = get_entry(name)
    backend_class(attn)  # an unknown backend name fails before anything is built
    cls = entry.model_class
    src = weights.read_source(pretrained) if pretrained is not None else None
    values = dict(entry.config)
    from_weights = _config_from_source(cls.family, src) if src is not None else {}
    values.update(from_weights)
    values.update(overrides)
    cfg = cls.config_class.from_dict(values)
    changed = _overridden_fields(cls.config_class, {**entry.config, **from_weights}, cfg, overrides) if src else set()

    model = cls(cfg)
    model.model_name = name
    model.set_attention(attn, device=device, dtype=dtype, **(attn_options or {}))
    if src is not None:
        state = weights.to_fastzoo(cls.family, src)
        state, fresh, notes = model.adapt_checkpoint(state, changed)
        for note in notes:
            warnings.warn(f"{src.origin}: {note}", stacklevel=2)
        weights.load_into(model, state, src.origin, allow_missing=fresh)
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    return model


def _config_from_source(family: str, src: weights.Source) -> dict:
    if src.config and src.config.get("fastzoo_model") is not None:
        return {k: v for k, v in src.config.items() if k not in ("fastzoo_model", "family")}
    conv = weights.find_converter(family, src)
    if src.config and hasattr(conv, "config_from_json"):
        return conv.config_from_json(src.config)
    try:
        return conv.infer_config(src.state_dict, src.module)
    except (KeyError, IndexError) as e:
        raise CheckpointError(f"{src.origin}: cannot read the architecture from the weights (no {e})") from e


def _overridden_fields(config_class, from_checkpoint: dict, cfg, overrides: dict) -> set[str]:
    """Override names whose value differs from what the checkpoint implies."""
    ckpt_cfg = config_class.from_dict(from_checkpoint, what="checkpoint field")
    return {
        f.name
        for f in dataclasses.fields(cfg)
        if f.name in overrides and getattr(cfg, f.name) != getattr(ckpt_cfg, f.name)
    }
