"""What the converters of transformers' detectors share (DETR, Deformable DETR, RT-DETR v1 / v2, D-FINE,
RF-DETR; each family's ``convert.py`` imports it from here, the family's lowest folder): the converter's frame
(a live model's config read as its ``config.json``, else the architecture from a bare state dict's keys;
fastzoo's state dict written key for key), the ``model_type`` refusal, the labels both ways, the backbone
stages a ``backbone_config`` hands on, and what a state dict's keys and shapes show (layer counts, sampling
points, widths); and the kernels the originals' users get (``on_users_attention``).
"""
from __future__ import annotations

import re

from fastzoo.errors import CheckpointError
from fastzoo.models.spec import SameKeys


def on_users_attention(model):
    """A transformers detector on the attention its users get by default, SDPA (eager is the reference the
    specs build). A detector whose backbone declares no attention (ResNet, HGNetV2) refuses the switch, and its
    attention layers read the top config's choice per call."""
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:
        model.config._attn_implementation = "sdpa"
    return model


class HfDetectorConverter(SameKeys):
    """The frame of a transformers detector's converter: a family gives ``matches``, ``config_from_json`` and
    ``config_from_keys`` (the fields a bare state dict, already under fastzoo's names, decides) and, where its
    names differ from transformers', ``to_fastzoo`` / ``from_fastzoo``."""

    format = "hf"

    def infer_config(self, state: dict, module=None) -> dict:
        """A live transformers model states its whole architecture, as its config.json does; a bare state dict
        what its keys fix."""
        if module is not None and hasattr(module, "config") and hasattr(module.config, "to_dict"):
            return self.config_from_json(module.config.to_dict())
        return self.config_from_keys(self.to_fastzoo(state))


def check_model_type(cfg: dict, name: str, *model_types: str) -> str:
    """A config dict's ``model_type`` (the first of ``model_types`` where it states none), refused unless it is
    one of ``model_types``, the ones fastzoo's ``name`` reads."""
    model_type = cfg.get("model_type", model_types[0])
    if model_type not in model_types:
        raise CheckpointError(f"config.json has model_type={model_type!r}; fastzoo's {name} reads "
                              + " and ".join(repr(t) for t in model_types))
    return model_type


def labels_from_json(cfg: dict, default: int) -> dict:
    """``num_labels`` as transformers reads a config dict (``id2label``'s length where it has one, else
    ``num_labels``, else the class's ``default``) and ``id2label`` with int keys."""
    labels = cfg.get("id2label")
    if not labels:
        return {"num_labels": cfg.get("num_labels", default)}
    return {"num_labels": len(labels), "id2label": {int(k): v for k, v in labels.items()}}


def labels_to_hf(cfg) -> dict:
    """The labels as a transformers config takes them: ``id2label`` where the config names its classes, else
    their count."""
    return {"id2label": {int(k): v for k, v in cfg.id2label.items()}} if cfg.id2label else {"num_labels": cfg.num_labels}


def out_indices(bb: dict) -> list[int]:
    """The stages a ``backbone_config`` dict hands on: its ``out_indices``, else its ``out_features``' stage
    numbers; empty where it names neither (each family has its own default)."""
    return bb.get("out_indices") or [int(f[len("stage"):]) for f in bb.get("out_features") or []]


def count(state: dict, pattern: str) -> int:
    """How many distinct values ``pattern``'s group takes over ``state``'s keys (layers, stages, levels)."""
    return len({m[1] for k in state for m in [re.match(pattern, k)] if m})


def rows(state: dict, **keys: str) -> dict:
    """Each field's value as the number of rows (output width) of its key's tensor, for the keys ``state`` has."""
    return {field: state[key].shape[0] for field, key in keys.items() if key in state}


def sampling_points(weights_rows: int, heads: int, levels: int = 1) -> int | None:
    """Sampling points per head and level of a deformable attention whose ``attention_weights`` projection has
    ``weights_rows`` rows: the tensors show heads x levels x points as one product, so the points are read with
    the config's ``heads`` (transformers' default), None where they do not divide."""
    return weights_rows // (heads * levels) if weights_rows % (heads * levels) == 0 else None
