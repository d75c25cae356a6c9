"""Reading checkpoints and translating foreign state dicts, both directions.

A *source* is a file (``.safetensors``, ``.bin``, ``.pt``, ``.pth``), a directory written
by ``save_pretrained`` (fastzoo's or Hugging Face's: ``config.json`` + weights, sharded or
not), a state dict, or a live timm / transformers / torchvision module. The format is
detected from the keys by the converters of the model's family. Loading is all or
nothing: any missing, unexpected or mis-shaped key raises :class:`CheckpointError`
naming the keys, and nothing is copied into the model. A source that states its
architecture (a ``config.json``, a live module) must also agree with the model's config
on every field that changes the function, or :func:`load_pretrained` refuses it.
"""
from __future__ import annotations

import importlib
import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fastzoo.errors import CheckpointError

# family -> converters ("module:object"), tried in order; each knows one foreign format.
CONVERTERS = {
    "vit": ["fastzoo.weights.timm:VIT"],
    "gpt2": ["fastzoo.weights.hf:GPT2", "fastzoo.weights.hf:GPT2_FASTZOO"],
    "resnet": ["fastzoo.weights.torchvision:RESNET", "fastzoo.weights.timm:RESNET"],
    "boxdet": ["fastzoo.weights.torchvision:BOXDET", "fastzoo.weights.torchvision:BOXDET_BACKBONE"],
}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt", "model.pth")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict", "module")
_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
# Config fields a model may set freely against a checkpoint: they change training or the
# initialisation, not the function the weights compute. Every other field is compared.
FREE_FIELDS = {
    "vit": {"drop_rate", "pos_drop_rate", "attn_drop_rate", "proj_drop_rate", "drop_path_rate", "patch_embed"},
    "gpt2": {"resid_pdrop", "embd_pdrop", "attn_pdrop", "initializer_range"},
}
# Fields compared through the part of their value that changes the function.
_FUNCTION_OF = {
    "vit": {
        "init_values": lambda c: c.init_values is not None,  # LayerScale or not; its init value is overwritten
        "fc_norm": lambda c: c.use_fc_norm,  # None is timm's rule: compare where the norm ends up
    },
    "gpt2": {"n_inner": lambda c: c.n_inner or 4 * c.n_embd},  # None: 4 * n_embd
}


@dataclass
class Source:
    state_dict: dict[str, torch.Tensor]
    origin: str  # said in every error about this source
    config: dict | None = None  # config.json of a save_pretrained directory
    module: nn.Module | None = None  # the live module, when one was given


# -- reading ---------------------------------------------------------------------------
def read_source(source) -> Source:
    if isinstance(source, Source):
        return source
    if isinstance(source, nn.Module):
        return _read_module(source)
    if isinstance(source, Mapping):
        return Source(_clean(dict(source), "the state dict"), "the state dict")
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            return _read_dir(path)
        if path.is_file():
            return Source(_clean(read_file(path), str(path)), str(path))
        raise CheckpointError(f"pretrained={str(source)!r}: no such file or directory")
    raise CheckpointError(
        f"pretrained= takes a path, a directory, a state dict or a module, not {type(source).__name__}"
    )


def _read_module(module: nn.Module) -> Source:
    """A live module, unwrapped from DDP / DataParallel / torch.compile; its config is read from
    the inner module (a fastzoo model's as save_pretrained writes it, an HF model's ``to_dict``)."""
    inner = _unwrap(module)
    origin = f"live {type(inner).__name__} module"
    if inner is not module:
        origin += f" (inside {type(module).__name__})"
    config = getattr(inner, "config", None)
    from fastzoo.models.base import FastzooModel

    if isinstance(inner, FastzooModel):
        config = {"fastzoo_model": inner.model_name, "family": inner.family, **config.to_dict()}
    else:
        config = config.to_dict() if hasattr(config, "to_dict") else None
    return Source(_clean(dict(inner.state_dict()), origin), origin, config, inner)


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside wrappers (torch.compile's ``_orig_mod``, DDP's and DataParallel's
    ``module``): a wrapper is a module whose whole state lives under that one attribute."""
    while True:
        for attr in ("_orig_mod", "module"):
            inner = getattr(module, attr, None)
            if isinstance(inner, nn.Module) and all(k.startswith(attr + ".") for k in module.state_dict()):
                module = inner
                break
        else:
            return module


def read_file(path: Path) -> dict:
    """Tensors of one checkpoint file. Never runs pickled code."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        if suffix in (".bin", ".pt", ".pth", ".ckpt"):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused, it needs arbitrary pickled code to load (torch.load weights_only=True failed: "
            f"{str(e).splitlines()[0]}). Re-save it as a plain state dict or as .safetensors."
        ) from e
    except Exception as e:  # truncated, corrupt, or not a checkpoint at all
        raise CheckpointError(f"{path}: cannot read this checkpoint ({type(e).__name__}: {e})") from e
    raise CheckpointError(f"{path}: unknown checkpoint extension {suffix!r}; use .safetensors, .bin, .pt or .pth")


def _read_dir(path: Path) -> Source:
    config = None
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path / 'config.json'}: not valid JSON ({e})") from e
    for index_name in INDEX_FILES:
        index_path = path / index_name
        if index_path.is_file():
            try:
                shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: not a shard index with a 'weight_map' ({e})") from e
            state = {}
            for shard in shards:
                if not (path / shard).is_file():
                    raise CheckpointError(f"{index_path} names the shard {shard!r}, which is missing from {path}")
                state.update(read_file(path / shard))
            return Source(_clean(state, str(path)), str(path), config)
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return Source(_clean(read_file(path / name), str(path / name)), str(path / name), config)
    raise CheckpointError(f"{path}: no weights found (looked for {', '.join(INDEX_FILES + WEIGHT_FILES)})")


def _clean(obj, origin: str) -> dict:
    """Unwrap {'state_dict': ...} style containers and DDP/compile prefixes, in any nesting
    (``module._orig_mod.``, ``_orig_mod.module.``)."""
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            if key in obj and isinstance(obj[key], Mapping) and not isinstance(obj[key], torch.Tensor):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{origin}: not a state dict (a mapping of names to tensors)")
    out = {}
    for k, v in obj.items():
        while k.startswith(_PREFIXES):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


# -- formats ---------------------------------------------------------------------------
def converters(family: str) -> list:
    out = []
    for path in CONVERTERS.get(family, []):
        module, name = path.split(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


def find_converter(family: str, source: Source):
    """The converter whose format these keys are in, or a CheckpointError saying what was seen."""
    found = converters(family)
    for conv in found:
        if conv.matches(source.state_dict):
            return conv
    sample = ", ".join(list(source.state_dict)[:6])
    names = ", ".join(c.format for c in found) or "none"
    raise CheckpointError(
        f"{source.origin}: not a {family} checkpoint in any format fastzoo reads ({names}); its first keys are: {sample}"
    )


def _is_fastzoo(config: dict | None) -> bool:
    """A config written by save_pretrained (or read from a live fastzoo model)."""
    return bool(config) and "fastzoo_model" in config


# keys timm's hub format adds to a save_pretrained config.json (timm reads the directory too)
TIMM_HUB_KEYS = ("architecture", "pretrained_cfg", "model_args", "num_features", "label_names", "label_descriptions")


def pretrained_cfg_of(src: Source) -> dict | None:
    """The timm ``pretrained_cfg`` a source carries (a live timm or fastzoo model's, a
    save_pretrained directory's config.json), or None: preprocessing goes with the weights."""
    cfg = getattr(src.module, "pretrained_cfg", None) if src.module is not None else None
    if not cfg and src.config:
        cfg = src.config.get("pretrained_cfg")
    # JSON has no tuples; timm's configs hold sizes and mean/std as tuples
    return {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()} if cfg else None


def config_from_source(family: str, src: Source) -> dict:
    """The config fields the source decides: all of them from a config.json or a live module
    that states its architecture, what the keys fix from a bare state dict."""
    if _is_fastzoo(src.config):
        if src.config.get("family", family) != family:
            raise CheckpointError(f"{src.origin}: a {src.config['family']} checkpoint, not a {family} one")
        return {k: v for k, v in src.config.items() if k not in ("fastzoo_model", "family") + TIMM_HUB_KEYS}
    conv = find_converter(family, src)
    if src.config and hasattr(conv, "config_from_json"):
        return conv.config_from_json(src.config)
    try:
        return conv.infer_config(src.state_dict, src.module)
    except (KeyError, IndexError) as e:
        raise CheckpointError(f"{src.origin}: cannot read the architecture from the weights (no {e})") from e


def states_config(src: Source) -> bool:
    """Whether the source states its whole architecture (config.json, a live module)
    rather than leaving fields the keys cannot decide to the model's YAML."""
    return bool(src.config) or src.module is not None


def to_fastzoo(family: str, source: Source) -> dict:
    if _is_fastzoo(source.config):
        return dict(source.state_dict)  # written by save_pretrained: already fastzoo keys
    conv = find_converter(family, source)
    if source.module is not None and hasattr(conv, "check_module"):
        conv.check_module(source.module)  # what the keys cannot show (e.g. a ResNet's dilation)
    return conv.to_fastzoo(source.state_dict)


def export_state_dict(model, format: str) -> dict:
    """The model's weights in ``format`` (e.g. "timm", "hf", "torchvision"), ready for that library."""
    for conv in converters(model.family):
        if conv.format == format:
            return conv.from_fastzoo(model.state_dict(), model.config)
    names = ", ".join(c.format for c in converters(model.family))
    raise ValueError(f"format={format!r}: {model.family} models export to {names}")


# -- loading ----------------------------------------------------------------------------
def check_state_dict(model: nn.Module, state: dict, origin: str, allow_missing=()) -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped key."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and k not in allow_missing]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_names(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches ({len(shapes)}): {_names(shapes)}")
    if problems:
        raise CheckpointError(f"{origin} does not fit {type(model).__name__}; nothing was loaded. " + "; ".join(problems))


def _names(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")


def load_into(model: nn.Module, state: dict, origin: str, allow_missing=()) -> None:
    check_state_dict(model, state, origin, allow_missing)
    own = model.state_dict()
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def load_pretrained(model, source) -> None:
    """Load ``source`` (any form ``pretrained=`` takes) into ``model``, strictly.

    A source that states its architecture (config.json, a live module) must agree with
    ``model.config`` on every field that changes the function (all but ``FREE_FIELDS``),
    else :class:`CheckpointError` names each differing field. A bare state dict is checked
    by its keys and shapes only. To build a model that fits a checkpoint, use
    ``fastzoo.create(name, pretrained=source)``.
    """
    src = read_source(source)
    if states_config(src):
        check_config(model, config_from_source(model.family, src), src.origin)
    load_into(model, to_fastzoo(model.family, src), src.origin)


def check_config(model, implied: dict, origin: str) -> None:
    """Raise CheckpointError naming every function-changing field where ``implied`` (the
    checkpoint's config fields) and ``model.config`` differ."""
    try:
        ckpt = model.config_class.from_dict({**model.config.to_dict(), **implied}, what="checkpoint field")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{origin}: its config does not describe a {type(model).__name__} ({e})") from e
    free = FREE_FIELDS.get(model.family, set())
    view = _FUNCTION_OF.get(model.family, {})
    diffs = []
    for name in implied:
        if name in free:
            continue
        of = view.get(name, lambda c, n=name: getattr(c, n))
        if of(ckpt) != of(model.config):
            diffs.append(f"{name}: checkpoint {getattr(ckpt, name)!r} vs model {getattr(model.config, name)!r}")
    if diffs:
        raise CheckpointError(
            f"{origin} was built with a different architecture than this {type(model).__name__}; nothing was loaded. "
            f"Differing fields ({len(diffs)}): {'; '.join(diffs)}. Build the model from the checkpoint instead: "
            f"fastzoo.create(name, pretrained=...) reads these fields from it."
        )
