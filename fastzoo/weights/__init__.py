"""Reading checkpoints and translating foreign state dicts, both directions.

A *source* is a file (``.safetensors``, ``.bin``, ``.pt``, ``.pth``), a directory written
by ``save_pretrained`` (fastzoo's or Hugging Face's: ``config.json`` + weights, sharded or
not), a state dict, or a live timm / transformers / torchvision module. The format is
detected from the keys by the converters of the model's family. Loading is all or
nothing: any missing, unexpected or mis-shaped key raises :class:`CheckpointError`
naming the keys, and nothing is copied into the model.
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
        config = getattr(source, "config", None)
        config = config.to_dict() if hasattr(config, "to_dict") else None
        return Source(dict(source.state_dict()), f"live {type(source).__name__} module", config, source)
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
    """Unwrap {'state_dict': ...} style containers and DDP/compile prefixes."""
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            if key in obj and isinstance(obj[key], Mapping) and not isinstance(obj[key], torch.Tensor):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{origin}: not a state dict (a mapping of names to tensors)")
    out = {}
    for k, v in obj.items():
        for prefix in _PREFIXES:
            if k.startswith(prefix):
                k = k[len(prefix):]
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


def to_fastzoo(family: str, source: Source) -> dict:
    if source.config and source.config.get("fastzoo_model") is not None:
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
    """Load ``source`` (any form ``pretrained=`` takes) into ``model``, strictly."""
    src = read_source(source)
    load_into(model, to_fastzoo(model.family, src), src.origin)
