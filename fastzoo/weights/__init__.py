"""Reading checkpoints and translating foreign state dicts, both directions.

A *source* is a file (``.safetensors``, ``.bin``, ``.pt``, ``.pth``), a directory written
by ``save_pretrained`` (fastzoo's or Hugging Face's: ``config.json`` + weights, sharded or
not), a state dict, or a live timm / transformers / torchvision module. The format is
detected from the keys by the converters of the model's family (its spec's
``converters``: this package knows no family). Loading is all or
nothing: any missing, unexpected or mis-shaped key raises :class:`CheckpointError`
naming the keys, and nothing is copied into the model. A source that states its
architecture (a ``config.json``, a live module) must also agree with the model's config
on every field that changes the function, or :func:`load_pretrained` refuses it.
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
        raise CheckpointError(f"{index_path} and its shards disagree ({len(problems)}): {_names(problems, 6)}; "
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
    odd = [f"{k}: {why}" for k, v in obj.items() if (why := _storage_problem(v))]
    if odd:  # refused before any converter touches them (a transpose of a meta tensor is still no data)
        raise CheckpointError(f"{origin}: tensors without plain data ({len(odd)}): {_names(odd)}; nothing was loaded")
    out = {}
    for k, v in obj.items():
        while k.startswith(_PREFIXES):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


# -- formats ---------------------------------------------------------------------------
def find_converter(spec, source: Source):
    """The converter of ``spec`` (a family's :class:`~fastzoo.models.spec.ModelSpec`) whose format
    these keys are in, or a CheckpointError saying what was seen."""
    for conv in spec.converters:
        if conv.matches(source.state_dict):
            return conv
    sample = ", ".join(list(source.state_dict)[:6])
    names = ", ".join(c.format for c in spec.converters) or "none"
    raise CheckpointError(
        f"{source.origin}: not a {spec.family} checkpoint in any format fastzoo reads ({names}); its first keys are: {sample}"
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


def config_from_source(spec, src: Source) -> dict:
    """The config fields the source decides: all of them from a config.json or a live module
    that states its architecture, what the keys fix from a bare state dict."""
    if _is_fastzoo(src.config):
        if src.config.get("family", spec.family) != spec.family:
            raise CheckpointError(f"{src.config_origin or src.origin}: a {src.config['family']} checkpoint, not a {spec.family} one")
        return {k: v for k, v in src.config.items() if k not in ("fastzoo_model", "family") + TIMM_HUB_KEYS}
    conv = find_converter(spec, src)
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


def to_fastzoo(spec, source: Source) -> dict:
    if _is_fastzoo(source.config):
        return dict(source.state_dict)  # written by save_pretrained: already fastzoo keys
    conv = find_converter(spec, source)
    if source.module is not None and hasattr(conv, "check_module"):
        conv.check_module(source.module)  # what the keys cannot show (e.g. a ResNet's dilation)
    return conv.to_fastzoo(source.state_dict)


def export_state_dict(model, spec, format: str) -> dict:
    """The model's weights in ``format`` (e.g. "timm", "hf", "torchvision"), ready for that library."""
    return spec.converter(format).from_fastzoo(model_state(model), model.config)


# -- loading ----------------------------------------------------------------------------
def model_state(model: nn.Module) -> dict:
    """The model's state dict with every tied alias too (GPT-2's ``state_dict()`` stores its tied
    head once, as HF's files do; converters and checks see both names of the one tensor)."""
    own = model.state_dict()
    params = model.named_parameters(remove_duplicate=False)
    return {**own, **{k: p.detach() for k, p in params if k not in own}}


def check_state_dict(model: nn.Module, state: dict, origin: str, allow_missing=()) -> None:
    """Raise CheckpointError naming every key that would not load faithfully: missing,
    unexpected, mis-shaped, of another kind of value (integers, bools or complex numbers for
    float weights...), without data (meta), not a dense tensor (sparse, quantized, nested),
    or a tied weight given two different values. A key tied to one that is present (GPT-2's
    ``lm_head.weight``, one tensor with ``transformer.wte.weight``) may be absent."""
    own = model_state(model)
    tied = _tied_keys(own)
    missing = [k for k in own if k not in state and k not in allow_missing and not any(t in state for t in tied.get(k, ()))]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and isinstance(state[k], torch.Tensor) and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    values = [f"{k}: {why}" for k in own if k in state and (why := _value_problem(state[k], own[k]))]
    untied = [] if shapes or values else _tie_problems(state, tied)
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_names(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches ({len(shapes)}): {_names(shapes)}")
    if values:
        problems.append(f"values that cannot load ({len(values)}): {_names(values)}")
    if untied:
        problems.append(f"tied weights given different values ({len(untied)}): {_names(untied)}")
    if problems:
        raise CheckpointError(f"{origin} does not fit {type(model).__name__}; nothing was loaded. " + "; ".join(problems))


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def _value_problem(value, target: torch.Tensor) -> str | None:
    """Why ``value`` cannot be copied faithfully into ``target``, or None. Precision may
    change within a kind (fp16 -> fp32), the kind may not: an int8 tensor copied into a
    float weight gives small integers, not the weights that were quantized."""
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor"
    if why := _storage_problem(value):
        return why
    if _kind(value.dtype) != _kind(target.dtype):
        return f"{str(value.dtype).replace('torch.', '')} values for a {str(target.dtype).replace('torch.', '')} tensor"
    return None


def _storage_problem(value: torch.Tensor) -> str | None:
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


def _tied_keys(own: dict) -> dict[str, list[str]]:
    """key -> the other keys of the model's state dict that are the same tensor."""
    groups: dict[tuple, list[str]] = {}
    for k, v in own.items():
        if v.numel():
            groups.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.stride()), []).append(k)
    return {k: [t for t in g if t != k] for g in groups.values() if len(g) > 1 for k in g}


def _tie_problems(state: dict, tied: dict) -> list[str]:
    """Tied keys that the checkpoint gives different values: loading both would keep
    whichever came last, a model that is neither of the checkpoint's."""
    out = []
    for k, others in tied.items():
        for t in others:
            if k < t and k in state and t in state and not torch.equal(state[k].to(state[t].dtype), state[t]):
                out.append(f"{k} differs from {t}, which this model ties to it (one tensor): the checkpoint has "
                           f"an untied head that this architecture cannot hold")
    return out


def _names(keys: list[str], limit: int = 12) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")


def load_into(model: nn.Module, state: dict, origin: str, allow_missing=()) -> None:
    check_state_dict(model, state, origin, allow_missing)
    own = model_state(model)
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def load_pretrained(model, source, spec) -> None:
    """Load ``source`` (any form ``pretrained=`` takes) into ``model``, strictly.

    A source that states its architecture (config.json, a live module) must agree with
    ``model.config`` on every field that changes the function (every field the config does
    not declare ``free``: see :mod:`fastzoo.models.config`), else :class:`CheckpointError`
    names each differing field. A bare state dict is checked by its keys and shapes only. To
    build a model that fits a checkpoint, use ``fastzoo.create(name, pretrained=source)``.
    """
    src = read_source(source)
    if states_config(src):
        check_config(model, config_from_source(spec, src), src.origin)
    load_into(model, to_fastzoo(spec, src), src.origin)


def check_config(model, implied: dict, origin: str) -> None:
    """Raise CheckpointError naming every field where ``implied`` (the checkpoint's config
    fields) and ``model.config`` differ in the function they give. The config's own
    declarations say which fields those are: free fields (dropout, ``channels_last``, loss
    settings) may differ, and a field is compared through the part of it that matters
    (``ModelConfig.compared``: e.g. LayerScale or not, not its init value)."""
    try:
        ckpt = model.config_class.from_dict({**model.config.to_dict(), **implied}, what="checkpoint field")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{origin}: its config does not describe a {type(model).__name__} ({e})") from e
    diffs = [
        f"{name}: checkpoint {getattr(ckpt, name)!r} vs model {getattr(model.config, name)!r}"
        for name in implied
        if ckpt.field_kind(name) != "free" and ckpt.compared(name) != model.config.compared(name)
    ]
    if diffs:
        raise CheckpointError(
            f"{origin} was built with a different architecture than this {type(model).__name__}; nothing was loaded. "
            f"Differing fields ({len(diffs)}): {'; '.join(diffs)}. Build the model from the checkpoint instead: "
            f"fastzoo.create(name, pretrained=...) reads these fields from it."
        )


# -- writing -------------------------------------------------------------------------------
def untied(state: dict) -> dict:
    """safetensors refuses tensors that share memory (tied weights): store a copy of each repeat."""
    seen, out = set(), {}
    for k, v in state.items():
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        out[k] = v.clone() if ptr in seen else v
        if ptr is not None:
            seen.add(ptr)
    return out
