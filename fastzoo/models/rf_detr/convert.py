"""transformers' RF-DETR checkpoints, both ways. Outside the DINOv2 fastzoo's model has transformers' module names
(a key for key copy); the DINOv2 (``model.backbone.backbone.``) is fastzoo's ViT, whose keys the ViT family's
transformers converter renames (``encoder.layer.N.attention.attention.query`` ... joined into ``blocks.N.attn.qkv``).
The config: from a ``config.json`` / a live model's config (``RfDetrConfig`` with an ``rf_detr_dinov2`` backbone),
or from the keys of a bare state dict (heads, windows and the output blocks keep transformers' defaults unless
given: the tensors cannot show them).
"""
from __future__ import annotations

import dataclasses
import re

from fastzoo.errors import CheckpointError
from fastzoo.models.detr.hf_detector import (HfDetectorConverter, check_model_type, count, labels_from_json, labels_to_hf,
                                             out_indices, sampling_points)
from fastzoo.models.rf_detr.config import RfDetrConfig
from fastzoo.models.rt_detr.convert import READ_ONLY
from fastzoo.models.vit import hf as vit_hf

BACKBONE = "model.backbone.backbone."
# fastzoo's field -> the backbone config's (RfDetrDinov2Config)
BACKBONE_FIELDS = {"hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
                   "num_attention_heads": "num_attention_heads", "mlp_ratio": "mlp_ratio", "hidden_act": "hidden_act",
                   "image_size": "image_size", "patch_size": "patch_size", "num_channels": "num_channels",
                   "qkv_bias": "qkv_bias", "layerscale_value": "layerscale_value", "use_mask_token": "use_mask_token",
                   "num_windows": "num_windows", "backbone_layer_norm_eps": "layer_norm_eps",
                   "apply_layernorm": "apply_layernorm"}
FASTZOO_ONLY = ("id2label", "backbone_out_indices", "giou_impl", *BACKBONE_FIELDS)


def _top_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(RfDetrConfig) if f.name not in FASTZOO_ONLY)


def _split(state: dict) -> tuple[dict, dict]:
    """The DINOv2's keys (prefix stripped) and the rest."""
    inner = {k[len(BACKBONE):]: v for k, v in state.items() if k.startswith(BACKBONE)}
    return inner, {k: v for k, v in state.items() if not k.startswith(BACKBONE)}


class HfRfDetrConverter(HfDetectorConverter):
    """``RfDetrForObjectDetection`` state dicts."""

    @staticmethod
    def matches(state: dict) -> bool:
        # two keys every state and every gradient dict has
        return ("model.backbone.projector.projector_layer.conv1.conv.weight" in state
                and "model.decoder.ref_point_head.layers.0.weight" in state)

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        inner, rest = _split(state)
        return {**rest, **{BACKBONE + k: v for k, v in vit_hf.to_fastzoo(inner).items()}}

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        from fastzoo.models.rf_detr.backbone import vit_config

        inner, rest = _split(state)
        return {**rest, **{BACKBONE + k: v for k, v in vit_hf.from_fastzoo(inner, vit_config(config)).items()}}

    @staticmethod
    def config_from_keys(s: dict) -> dict:
        D, C, P, _ = s[BACKBONE + "patch_embed.proj.weight"].shape
        side = int(round((s[BACKBONE + "pos_embed"].shape[1] - 1) ** 0.5))
        groups = count(s, r"model\.enc_output\.(\d+)\.")
        d = s["model.query_feat.weight"].shape[1]
        conv1 = s["model.backbone.projector.projector_layer.conv1.conv.weight"]
        out = {
            "num_labels": s["class_embed.weight"].shape[0], "hidden_size": D, "num_channels": C, "patch_size": P,
            "image_size": side * P, "num_hidden_layers": count(s, re.escape(BACKBONE) + r"blocks\.(\d+)\."),
            "mlp_ratio": s[BACKBONE + "blocks.0.mlp.fc1.weight"].shape[0] // D,
            "qkv_bias": BACKBONE + "blocks.0.attn.qkv.bias" in s, "use_mask_token": BACKBONE + "mask_token" in s,
            "hidden_expansion": conv1.shape[0] / 2 / d, "c2f_num_blocks": count(s, r"model\.backbone\.projector\."
                                                                              r"projector_layer\.bottlenecks\.(\d+)\."),
            "d_model": d, "group_detr": groups, "num_queries": s["model.query_feat.weight"].shape[0] // groups,
            "decoder_layers": count(s, r"model\.decoder\.layers\.(\d+)\."),
            "decoder_ffn_dim": s["model.decoder.layers.0.mlp.fc1.weight"].shape[0],
        }
        points = sampling_points(s["model.decoder.layers.0.cross_attn.attention_weights.weight"].shape[0],
                                 RfDetrConfig.decoder_cross_attention_heads)
        if points is not None:
            out["decoder_n_points"] = points
        return out

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo's fields from a transformers ``RfDetrConfig`` dict."""
        check_model_type(cfg, "RF-DETR", "rf_detr")
        bb = cfg.get("backbone_config") or {}
        if bb.get("model_type", "rf_detr_dinov2") != "rf_detr_dinov2":
            raise CheckpointError(f"config.json: backbone_config model_type={bb.get('model_type')!r}; fastzoo's RF-DETR "
                                  f"builds transformers' windowed DINOv2 ('rf_detr_dinov2')")
        for key, ok in (("use_swiglu_ffn", False), ("reshape_hidden_states", True)):
            if bb.get(key, ok) != ok:
                raise CheckpointError(f"config.json: backbone_config {key}={bb[key]!r}: fastzoo's RF-DETR builds {key}={ok} "
                                      f"(as every RF-DETR checkpoint)")
        out = {k: cfg[k] for k in _top_fields() if k in cfg}
        out.update(labels_from_json(cfg, 91))
        out.update({ours: bb[theirs] for ours, theirs in BACKBONE_FIELDS.items() if theirs in bb})
        outs = out_indices(bb)
        if outs:
            out["backbone_out_indices"] = tuple(outs)
        return out


def hf_config(cfg: RfDetrConfig):
    """``cfg`` as a ``transformers.RfDetrConfig`` (which builds the same network)."""
    import transformers

    backbone = {"model_type": "rf_detr_dinov2", **{theirs: getattr(cfg, ours) for ours, theirs in BACKBONE_FIELDS.items()},
                "out_indices": list(cfg.backbone_out_indices)}
    fields = {k: getattr(cfg, k) for k in _top_fields() if k != "num_labels" and k not in READ_ONLY}
    return transformers.RfDetrConfig(backbone_config=backbone, **fields, **labels_to_hf(cfg))


HF = HfRfDetrConverter()
