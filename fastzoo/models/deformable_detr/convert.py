"""transformers' Deformable DETR checkpoints, both ways. fastzoo's model has
``DeformableDetrForObjectDetection``'s module names, so a transformers 5.x state dict loads key for key;
older names are renamed as transformers' ``conversion_mapping`` does (DETR's renames: ``backbone.conv_encoder``,
the decoder self-attention's ``out_proj``, a layer's ``fc1`` / ``fc2`` outside its ``mlp``), and BatchNorm step
counters are dropped. The config: from a ``config.json`` / a live model's config, or from the keys of a bare
state dict (the heads' counts, activation and tying keep transformers' defaults unless the tensors show them).
The backbone's reading (timm's ResNet by name, transformers' ``ResNetConfig``) is DETR's
(``fastzoo.models.detr.convert``).
"""
from __future__ import annotations

import torch

from fastzoo.errors import CheckpointError
from fastzoo.models.deformable_detr.config import DeformableDetrConfig
from fastzoo.models.detr.config import TIMM_RESNETS, TIMM_WIDTHS
from fastzoo.models.detr.convert import (HF as DETR_HF, HF_FIELDS, _backbone_from_config, _backbone_from_keys,
                                         fields_from_json, layer_counts)
from fastzoo.models.detr.convert import hf_config as detr_hf_config
from fastzoo.models.detr.hf_detector import HfDetectorConverter, check_model_type, out_indices, sampling_points

FIELDS = ("num_feature_levels", "encoder_n_points", "decoder_n_points", "two_stage", "two_stage_num_proposals",
          "with_box_refine", "focal_alpha", "tie_word_embeddings")


class HfDeformableDetrConverter(HfDetectorConverter):
    """``DeformableDetrForObjectDetection`` state dicts (transformers 5.x names and the older ones)."""

    @staticmethod
    def matches(state: dict) -> bool:
        return "class_embed.0.weight" in state and "model.level_embed" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return DETR_HF.to_fastzoo(state)

    @staticmethod
    def config_from_keys(s: dict) -> dict:
        layers = layer_counts(s)
        levels, d = s["model.level_embed"].shape
        # the tensors show heads x points per level, not each: with transformers' default heads where they divide
        heads = DeformableDetrConfig.encoder_attention_heads
        weights = {w: s[f"model.{w}.layers.0.{a}.attention_weights.weight"].shape[0]
                   for w, a in (("encoder", "self_attn"), ("decoder", "encoder_attn"))}
        points = {f"{w}_n_points": p for w, n in weights.items() if (p := sampling_points(n, heads, levels)) is not None}
        two_stage = "model.enc_output.weight" in s
        n_pred = layers["decoder_layers"] + two_stage
        backbone = _backbone_from_keys(s)
        # the backbone stages feeding the encoder: the 1x1 input projections' input widths
        widths = [s[f"model.input_proj.{i}.0.weight"].shape[1] for i in range(levels)
                  if f"model.input_proj.{i}.0.weight" in s and s[f"model.input_proj.{i}.0.weight"].shape[-1] == 1]
        hidden = backbone.get("hidden_sizes") or TIMM_WIDTHS[TIMM_RESNETS[backbone["backbone"]][0]]
        backbone_out_indices = tuple(hidden.index(w) + 1 for w in widths)
        num_queries = s["model.query_position_embeddings.weight"].shape[0] if not two_stage else 300
        return {
            "num_labels": s["class_embed.0.weight"].shape[0], "d_model": d, "num_queries": num_queries,
            "two_stage_num_proposals": num_queries, **layers,
            "encoder_ffn_dim": s["model.encoder.layers.0.mlp.fc1.weight"].shape[0],
            "decoder_ffn_dim": s["model.decoder.layers.0.mlp.fc1.weight"].shape[0],
            "num_feature_levels": levels, "backbone_out_indices": backbone_out_indices,
            **points,
            "two_stage": two_stage, "with_box_refine": "model.decoder.bbox_embed.0.layers.0.weight" in s,
            "tie_word_embeddings": _heads_tied(s, n_pred, two_stage, "model.decoder.bbox_embed.0.layers.0.weight" in s),
            **backbone,
        }

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo's fields from a transformers ``DeformableDetrConfig`` dict (``config.json``, ``config.to_dict()``)."""
        check_model_type(cfg, "Deformable DETR", "deformable_detr")
        if cfg.get("position_embedding_type", "sine") != "sine":
            raise CheckpointError(f"config.json: position_embedding_type={cfg['position_embedding_type']!r}; fastzoo's "
                                  f"Deformable DETR builds the sine embedding")
        names = tuple(n for n in HF_FIELDS if n != "num_labels") + FIELDS + ("gradient_checkpointing",)
        out = fields_from_json(cfg, names)
        if cfg.get("two_stage"):
            out["num_queries"] = cfg.get("two_stage_num_proposals", 300)
        bb = cfg.get("backbone_config") or {}
        levels = cfg.get("num_feature_levels", 4)
        if bb.get("model_type") == "resnet":
            outs = out_indices(bb) or [4]
            fixed = {**bb, "out_features": [f"stage{len(bb.get('depths', (3, 4, 6, 3)))}"]}  # DETR's reading: the sizes
            backbone = _backbone_from_config({**cfg, "backbone_config": fixed})
        else:
            outs = bb.get("out_indices") or ([2, 3, 4] if levels > 1 else [4])
            backbone = _backbone_from_config(cfg)
        return {**out, **backbone, "backbone_out_indices": tuple(outs)}


def _heads_tied(s: dict, n: int, two_stage: bool, refine: bool) -> bool:
    """Whether the heads transformers ties (``tie_word_embeddings``) hold one tensor for every layer."""
    heads = ([] if two_stage else ["class_embed.{}.weight"]) + ([] if refine else ["bbox_embed.{}.layers.0.weight"])
    return all(torch.equal(s[h.format(i)], s[h.format(0)]) for h in heads for i in range(1, n))


def hf_config(cfg: DeformableDetrConfig):
    """``cfg`` as a ``transformers.DeformableDetrConfig`` (which builds the same network on random weights)."""
    return detr_hf_config(cfg, "DeformableDetrConfig", HF_FIELDS + FIELDS, cfg.backbone_out_indices)


HF = HfDeformableDetrConverter()
