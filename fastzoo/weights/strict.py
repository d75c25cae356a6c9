"""Strict, all-or-nothing loading into a model: every key present, none unexpected, every
shape and kind of value right, tied weights given one value, and a checkpoint's stated
architecture equal to the model's on every field that changes the function; else
:class:`CheckpointError` names every problem and nothing is copied.
"""
from __future__ import annotations

import torch
from torch import nn

from fastzoo.errors import CheckpointError
from fastzoo.weights.sources import name_list, storage_problem


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
        problems.append(f"missing keys ({len(missing)}): {name_list(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {name_list(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches ({len(shapes)}): {name_list(shapes)}")
    if values:
        problems.append(f"values that cannot load ({len(values)}): {name_list(values)}")
    if untied:
        problems.append(f"tied weights given different values ({len(untied)}): {name_list(untied)}")
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
    if why := storage_problem(value):
        return why
    if _kind(value.dtype) != _kind(target.dtype):
        return f"{str(value.dtype).replace('torch.', '')} values for a {str(target.dtype).replace('torch.', '')} tensor"
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


def load_into(model: nn.Module, state: dict, origin: str, allow_missing=()) -> None:
    check_state_dict(model, state, origin, allow_missing)
    own = model_state(model)
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


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


def untied(state: dict) -> dict:
    """safetensors refuses tensors that share memory (tied weights): store a copy of each repeat."""
    seen, out = set(), {}
    for k, v in state.items():
        ptr = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else None
        out[k] = v.clone() if ptr in seen else v
        if ptr is not None:
            seen.add(ptr)
    return out

