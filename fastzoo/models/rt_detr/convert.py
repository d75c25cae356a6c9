"""transformers' RT-DETR and RT-DETRv2 checkpoints, both ways. fastzoo's model has their module names, so a
state dict loads key for key; an RT-DETRv2 file that stores its shared heads once (``class_embed.N`` or
``model.decoder.class_embed.N``, the same modules) gets the other name filled in. The config: from a
``config.json`` / a live model's config (``RTDetrConfig`` / ``RTDetrV2Config`` with an ``rt_detr_resnet``
backbone), or from the keys of a bare state dict (heads, points and activations keep transformers'
defaults unless given: the tensors show their products only).
"""
from __future__ import annotations

import dataclasses
import re

from fastzoo.errors import CheckpointError
from fastzoo.models.detr.hf_detector import (HfDetectorConverter, check_model_type, count, labels_from_json, labels_to_hf,
                                             out_indices, rows, sampling_points)
from fastzoo.models.rt_detr.config import RTDetrConfig

BACKBONE = ("layer_type", "depths", "hidden_sizes", "embedding_size", "num_channels", "hidden_act",
            "downsample_in_first_stage", "downsample_in_bottleneck")
V2_ONLY = ("decoder_n_levels", "decoder_offset_scale", "decoder_method")
FASTZOO_ONLY = ("model_type", "id2label", "backbone_out_indices", "giou_impl", *BACKBONE)
READ_ONLY = ("gradient_checkpointing",)  # transformers' legacy field: read, never written
_HEADS = re.compile(r"^(model\.decoder\.)?(class_embed|bbox_embed)\.")


def _fields(v2: bool) -> tuple[str, ...]:
    names = [f.name for f in dataclasses.fields(RTDetrConfig) if f.name not in FASTZOO_ONLY]
    return tuple(n for n in names if v2 or n not in V2_ONLY)


def heads_under_both_names(state: dict) -> dict:
    """``state`` with the decoder's shared heads under both of transformers' names (``class_embed.N`` and
    ``model.decoder.class_embed.N``, the same modules), for a file that stores them once."""
    out = dict(state)
    for k, v in state.items():
        m = _HEADS.match(k)
        if m:
            out.setdefault(k[len(m[1]):] if m[1] else "model.decoder." + k, v)
    return out


def hybrid_fields_from_keys(s: dict, stage_widths: tuple[int, ...]) -> dict:
    """What a hybrid detector's state dict (RT-DETR's, D-FINE's) shows of its encoder, query selection and
    decoder; ``stage_widths``: the backbone stages' output widths, whose matches with the encoder's input
    projections give the stages it reads."""
    widths = [s[f"model.encoder_input_proj.{i}.0.weight"].shape[1] for i in range(count(s, r"model\.encoder_input_proj\.(\d+)\."))]
    aifi = count(s, r"model\.encoder\.aifi\.(\d+)\.")
    return {
        "num_labels": s["model.enc_score_head.weight"].shape[0], "d_model": s["model.enc_score_head.weight"].shape[1],
        "backbone_out_indices": tuple(stage_widths.index(w) + 1 for w in widths), "encoder_in_channels": tuple(widths),
        "encoder_hidden_dim": s["model.encoder_input_proj.0.0.weight"].shape[0],
        "encoder_layers": count(s, r"model\.encoder\.aifi\.0\.layers\.(\d+)\."),
        "encode_proj_layers": tuple(range(len(widths) - aifi, len(widths))),
        "decoder_layers": count(s, r"model\.decoder\.layers\.(\d+)\."),
        "num_denoising": 100 if "model.denoising_class_embed.weight" in s else 0,
    }


def hybrid_backbone_config(cfg: dict, name: str, model_type: str, builds: str) -> dict:
    """A hybrid detector's ``backbone_config`` dict, refused unless of ``model_type`` (the one backbone fastzoo's
    ``name`` ``builds``), as is a timm backbone and a backbone named to load (``backbone='microsoft/resnet-18'``, no
    ``backbone_config``: transformers loads that one by name)."""
    if cfg.get("backbone") and not cfg.get("backbone_config"):
        raise CheckpointError(f"config.json: backbone={cfg['backbone']!r} without a backbone_config (a backbone "
                              f"transformers loads by name); fastzoo's {name} builds transformers' {builds} from "
                              f"backbone_config ({model_type!r})")
    bb = cfg.get("backbone_config") or {}
    if bb.get("model_type", model_type) != model_type or cfg.get("use_timm_backbone"):
        raise CheckpointError(f"config.json: backbone_config model_type={bb.get('model_type')!r}; fastzoo's {name} "
                              f"builds transformers' {builds} ({model_type!r})")
    return bb


def hybrid_fields_from_json(cfg: dict, names: tuple[str, ...], backbone: tuple[str, ...], stages: int) -> dict:
    """The ``names`` a hybrid detector's config dict gives, its labels (transformers' default: COCO's 80), the
    ``backbone`` fields its ``backbone_config`` gives, and the stages feeding the encoder (transformers'
    default: 2, 3, 4; those past the backbone's ``stages`` dropped)."""
    bb = cfg.get("backbone_config") or {}
    out = {k: cfg[k] for k in names if k in cfg}
    out.update(labels_from_json(cfg, 80))
    out.update({k: bb[k] for k in backbone if k in bb})
    out["backbone_out_indices"] = tuple(i for i in out_indices(bb) or [2, 3, 4] if 1 <= i <= stages)
    return out


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def hybrid_hf_config(cls, cfg, names: tuple[str, ...], backbone: dict):
    """``cfg`` as the hybrid detector's transformers config class ``cls``: the ``names`` it writes, the labels,
    and ``backbone`` as its ``backbone_config`` with the stages feeding the encoder (tuples as JSON's lists)."""
    fields = {k: _plain(getattr(cfg, k)) for k in names if k != "num_labels"}
    backbone = {**{k: _plain(v) for k, v in backbone.items()}, "out_indices": list(cfg.backbone_out_indices)}
    return cls(backbone_config=backbone, **fields, **labels_to_hf(cfg))


class HfRTDetrConverter(HfDetectorConverter):
    """``RTDetrForObjectDetection`` / ``RTDetrV2ForObjectDetection`` state dicts."""

    @staticmethod
    def matches(state: dict) -> bool:
        # two keys every state and every gradient dict has (the encoder's scores reach no loss through top-k)
        # (D-FINE's have them too, and its initial box head: its own converter's)
        return ("model.encoder_input_proj.0.0.weight" in state and "model.decoder.query_pos_head.layers.0.weight" in state
                and "model.decoder.pre_bbox_head.layers.0.weight" not in state)

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        if any(k.endswith("encoder_attn.n_points_scale") for k in state):  # RT-DETRv2: its heads under both names
            return heads_under_both_names(state)
        return dict(state)

    @staticmethod
    def config_from_keys(s: dict) -> dict:
        bb = "model.backbone.model."
        stages = count(s, re.escape(bb) + r"encoder\.stages\.(\d+)\.")
        depths = tuple(count(s, re.escape(bb) + rf"encoder\.stages\.{i}\.layers\.(\d+)\.") for i in range(stages))
        bottleneck = f"{bb}encoder.stages.0.layers.0.layer.2.convolution.weight" in s
        last = 2 if bottleneck else 1
        hidden = tuple(s[f"{bb}encoder.stages.{i}.layers.0.layer.{last}.convolution.weight"].shape[0] for i in range(stages))
        out = hybrid_fields_from_keys(s, hidden)
        levels = count(s, r"model\.decoder_input_proj\.(\d+)\.")
        v2 = "model.decoder.layers.0.encoder_attn.n_points_scale" in s
        out.update({
            "model_type": "rt_detr_v2" if v2 else "rt_detr",
            "layer_type": "bottleneck" if bottleneck else "basic", "depths": depths, "hidden_sizes": hidden,
            "embedding_size": s[f"{bb}embedder.embedder.2.convolution.weight"].shape[0],
            "num_channels": s[f"{bb}embedder.embedder.0.convolution.weight"].shape[1],
            "decoder_in_channels": tuple(s[f"model.decoder_input_proj.{i}.0.weight"].shape[1] for i in range(levels)
                                         if s[f"model.decoder_input_proj.{i}.0.weight"].shape[-1] == 1),  # the 1x1 ones
            "hidden_expansion": s["model.encoder.fpn_blocks.0.conv1.conv.weight"].shape[0] / out["encoder_hidden_dim"],
            "num_feature_levels": levels,
            **rows(s, encoder_ffn_dim="model.encoder.aifi.0.layers.0.mlp.fc1.weight",
                   decoder_ffn_dim="model.decoder.layers.0.mlp.fc1.weight"),
        })
        if v2:
            out["decoder_n_levels"] = levels
        points = sampling_points(s["model.decoder.layers.0.encoder_attn.attention_weights.weight"].shape[0],
                                 RTDetrConfig.decoder_attention_heads, levels)
        if points is not None:
            out["decoder_n_points"] = points
        return out

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo's fields from a transformers ``RTDetrConfig`` / ``RTDetrV2Config`` dict."""
        model_type = check_model_type(cfg, "RT-DETR", "rt_detr", "rt_detr_v2")
        bb = hybrid_backbone_config(cfg, "RT-DETR", "rt_detr_resnet", "ResNet-vd")
        stages = len(bb.get("depths", RTDetrConfig.depths))
        return {**hybrid_fields_from_json(cfg, _fields(model_type == "rt_detr_v2"), BACKBONE, stages),
                "model_type": model_type}


def hf_config(cfg: RTDetrConfig):
    """``cfg`` as a ``transformers.RTDetrConfig`` / ``RTDetrV2Config`` (which builds the same network)."""
    import transformers

    names = tuple(k for k in _fields(cfg.v2) if k not in READ_ONLY)
    backbone = {"model_type": "rt_detr_resnet", **{k: getattr(cfg, k) for k in BACKBONE}}
    return hybrid_hf_config(transformers.RTDetrV2Config if cfg.v2 else transformers.RTDetrConfig, cfg, names, backbone)


HF = HfRTDetrConverter()
