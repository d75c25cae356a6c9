"""Reading a checkpoint *source* into tensors: a file (``.safetensors``, ``.bin``, ``.pt``,
``.pth``), a directory written by ``save_pretrained`` (fastzoo's or Hugging Face's: ``config.json``
+ weights, sharded or not), a state dict, or a live timm / transformers / torchvision module.
Wrappers (DDP, ``torch.compile``, ``{"state_dict": ...}``) are unwrapped; pickled code never runs;
a shard index and its shards must agree key for key; a file named by an index must lie inside
the checkpoint directory.
"""
from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fastzoo.errors import CheckpointError

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
    config_origin: str | None = None  # that config.json's path, said in errors about its fields


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
    if _is_fastzoo_model(inner):
        config = {"fastzoo_model": inner.model_name, "family": inner.family, **config.to_dict()}
    else:
        config = config.to_dict() if hasattr(config, "to_dict") else None
        if config is not None:  # the class it was built as, where transformers' save_pretrained writes it
            config["architectures"] = [type(inner).__name__]
    return Source(_clean(dict(inner.state_dict()), origin), origin, config, inner)


def _is_fastzoo_model(module: nn.Module) -> bool:
    """A fastzoo model, told by what every one has (a family and a dataclass config) rather than
    by importing ``fastzoo.models``, which sits above this module."""
    import dataclasses

    return isinstance(getattr(type(module), "family", None), str) and dataclasses.is_dataclass(getattr(module, "config", None))


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
        if "Unsupported global" not in str(e):  # not a pickle of objects: damaged bytes
            reason = next((line.strip() for line in str(e).splitlines() if line.strip().startswith("Unsupported")),
                          "not a torch.save file")
            raise CheckpointError(f"{path}: cannot read this checkpoint ({reason})") from e
        raise CheckpointError(
            f"{path}: refused, it needs arbitrary pickled code to load (torch.load weights_only=True failed: "
            f"{str(e).splitlines()[0]}). Re-save it as a plain state dict or as .safetensors."
        ) from e
    except Exception as e:  # truncated, corrupt, or not a checkpoint at all
        raise CheckpointError(f"{path}: cannot read this checkpoint ({type(e).__name__}: {e})") from e
    raise CheckpointError(f"{path}: unknown checkpoint extension {suffix!r}; use .safetensors, .bin, .pt or .pth")


def _read_dir(path: Path) -> Source:
    config = read_config_json(path / "config.json") if (path / "config.json").is_file() else None
    config_origin = str(path / "config.json") if config is not None else None
    for index_name in INDEX_FILES:
        if (path / index_name).is_file():
            return Source(_clean(_read_shards(path, path / index_name), str(path)), str(path), config, config_origin=config_origin)
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            file = _inside(path, name, "weights file")
            return Source(_clean(read_file(file), str(path / name)), str(path / name), config,
                          config_origin=config_origin)
    raise CheckpointError(f"{path}: no weights found (looked for {', '.join(INDEX_FILES + WEIGHT_FILES)})")


def stale_shard_files(path: Path, keep=("model.safetensors", "config.json")) -> list[Path]:
    """The shard indexes in directory ``path`` and the shard files they name there except
    ``keep`` (for a writer replacing them with one weights file)."""
    out = []
    for index_name in INDEX_FILES:
        index = path / index_name
        if not index.is_file():
            continue
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            names = set()  # unreadable: the index still goes
        out += [path / n for n in sorted(names, key=str) if isinstance(n, str) and n not in keep
                and (path / n).parent.resolve() == path.resolve()]
        out.append(index)
    return out


def read_config_json(file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(config).__name__}, not an object of config fields")
    return config


def _read_shards(path: Path, index_path: Path) -> dict:
    """Every shard an index names, read only when the index and the shards agree key for key."""
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: not valid JSON ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: not a shard index (needs a non-empty 'weight_map' object of "
                              f"tensor name -> shard file name)")
    bad = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise CheckpointError(f"{index_path}: weight_map[{bad!r}] is {weight_map[bad]!r}; each value must be a "
                              f"shard file name")
    state, problems = {}, []
    for shard in sorted(set(weight_map.values())):
        tensors = read_file(_inside(path, shard, f"shard named by {index_path.name}"))
        for k, v in tensors.items():
            if weight_map.get(k) != shard:  # also how a key held by two shards shows
                where = f"maps it to {weight_map[k]!r}" if k in weight_map else "does not list it"
                problems.append(f"{shard} holds {k!r}, but the index {where}")
            else:
                state[k] = v
    problems += [f"the index maps {k!r} to {s!r}, which does not hold it" for k, s in weight_map.items() if k not in state]
    if problems:
        raise CheckpointError(f"{index_path} and its shards disagree ({len(problems)}): {name_list(problems, 6)}; "
                              f"nothing was loaded")
    return state


def _inside(root: Path, name: str, what: str) -> Path:
    """``root / name``, refused unless it is a file inside ``root`` once every ``..`` and
    symlink is resolved: an index (or a planted link) must not make fastzoo read another
    model's weights. The one outside place allowed is the Hugging Face hub cache's layout,
    where ``<repo>/snapshots/<rev>/<file>`` links to ``<repo>/blobs/<hash>``."""
    file = root / name
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{root}: {what} {name!r} is not a plain file name inside the checkpoint directory; refused")
    real, allowed = file.resolve(), [root.resolve()]
    if root.resolve().parent.name == "snapshots":
        allowed.append(root.resolve().parent.parent / "blobs")
    if not any(real.is_relative_to(a) for a in allowed):
        raise CheckpointError(f"{root}: {what} {name!r} resolves to {real}, outside the checkpoint directory; refused")
    if not file.is_file():
        raise CheckpointError(f"{root}: {what} {name!r} is missing")
    return file


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
    odd = [f"{k}: {why}" for k, v in obj.items() if (why := storage_problem(v))]
    if odd:  # refused before any converter touches them (a transpose of a meta tensor is still no data)
        raise CheckpointError(f"{origin}: tensors without plain data ({len(odd)}): {name_list(odd)}; nothing was loaded")
    out = {}
    for k, v in obj.items():
        while k.startswith(_PREFIXES):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def storage_problem(value: torch.Tensor) -> str | None:
    """Why ``value`` is not a dense tensor holding its values, or None."""
    if value.is_meta:
        return "a meta tensor (no data: saved from a model built on the meta device)"
    if value.is_quantized:
        return f"a quantized tensor ({value.dtype}); dequantize it first (tensor.dequantize())"
    if value.is_nested:
        return "a nested tensor"
    if value.layout != torch.strided:
        return f"a {str(value.layout).replace('torch.', '')} tensor; make it dense first (tensor.to_dense())"
    return None


def name_list(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")

