"""transformers' D-FINE checkpoints, both ways. fastzoo's model has their module names, so a state dict loads key
for key; a file that stores the shared heads once (``class_embed.N`` or ``model.decoder.class_embed.N``, the same
modules) gets the other name filled in. The config: from a ``config.json`` / a live model's config (``DFineConfig``
with an ``hgnet_v2`` backbone), or from the keys of a bare state dict (activations and the weighting function's
constants keep transformers' defaults: the tensors cannot show them).
"""
from __future__ import annotations

import dataclasses
import re

from fastzoo.errors import CheckpointError
from fastzoo.models.d_fine.config import DFineConfig
from fastzoo.models.detr.hf_detector import HfDetectorConverter, check_model_type, count, rows
from fastzoo.models.rt_detr.convert import (heads_under_both_names, hybrid_backbone_config, hybrid_fields_from_json,
                                            hybrid_fields_from_keys, hybrid_hf_config)

BACKBONE = ("num_channels", "hidden_act", "stem_channels", "stage_in_channels", "stage_mid_channels", "stage_out_channels",
            "stage_num_blocks", "stage_downsample", "stage_light_block", "stage_kernel_size", "stage_numb_of_layers",
            "use_learnable_affine_block")
# HGNetV2's strides that fastzoo builds only at transformers' defaults (the stem's branches must keep one size)
FIXED_STRIDES = {"stem_strides": [2, 1, 1, 2, 1], "stage_downsample_strides": [2, 2, 2, 2]}
FASTZOO_ONLY = ("model_type", "id2label", "backbone_out_indices", "giou_impl", *BACKBONE)


def _fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(DFineConfig) if f.name not in FASTZOO_ONLY)


class HfDFineConverter(HfDetectorConverter):
    """``DFineForObjectDetection`` state dicts."""

    @staticmethod
    def matches(state: dict) -> bool:
        # two keys every state and every training gradient dict has
        return "model.encoder_input_proj.0.0.weight" in state and "model.decoder.pre_bbox_head.layers.0.weight" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return heads_under_both_names(state)

    @staticmethod
    def config_from_keys(s: dict) -> dict:
        bb = re.escape("model.backbone.model.encoder.stages.")
        stages = count(s, bb + r"(\d+)\.")
        blocks = tuple(count(s, bb + rf"{i}\.blocks\.(\d+)\.") for i in range(stages))
        layers = tuple(count(s, bb + rf"{i}\.blocks\.0\.layers\.(\d+)\.") for i in range(stages))
        st = "model.backbone.model.encoder.stages."
        light = tuple(f"{st}{i}.blocks.0.layers.0.conv1.convolution.weight" in s for i in range(stages))
        first = [s[f"{st}{i}.blocks.0.layers.0.{'conv2.' if light[i] else ''}convolution.weight"] for i in range(stages)]
        out_ch = tuple(s[f"{st}{i}.blocks.0.aggregation.1.convolution.weight"].shape[0] for i in range(stages))
        stem = "model.backbone.model.embedder."
        out = hybrid_fields_from_keys(s, out_ch)
        enc_d = out["encoder_hidden_dim"]
        scale = s["model.decoder.layers.0.encoder_attn.num_points_scale"].tolist()
        points, i = [], 0
        while i < len(scale):
            points.append(round(1 / scale[i]))
            i += points[-1]
        elan = s["model.encoder.fpn_blocks.0.conv2.conv.weight"].shape[0]
        lqe = "model.decoder.lqe_layers.0.reg_conf.layers."
        out.update({
            "stem_channels": (s[f"{stem}stem1.convolution.weight"].shape[1], s[f"{stem}stem1.convolution.weight"].shape[0],
                              s[f"{stem}stem4.convolution.weight"].shape[0]),
            "stage_in_channels": tuple(s[f"{st}{i}.blocks.0.aggregation.0.convolution.weight"].shape[1] - layers[i] * first[i].shape[0]
                                       for i in range(stages)),
            "stage_mid_channels": tuple(t.shape[0] for t in first), "stage_out_channels": out_ch,
            "stage_num_blocks": blocks, "stage_numb_of_layers": layers, "stage_light_block": light,
            "stage_downsample": tuple(f"{st}{i}.downsample.convolution.weight" in s for i in range(stages)),
            "stage_kernel_size": tuple(t.shape[-1] for t in first),
            "use_learnable_affine_block": f"{stem}stem1.lab.scale" in s,
            "decoder_in_channels": (enc_d,) * len(out["encoder_in_channels"]),
            "hidden_expansion": (2 * elan + 1) / enc_d,
            "depth_mult": count(s, r"model\.encoder\.fpn_blocks\.0\.csp_rep1\.bottlenecks\.(\d+)\.") / 3,
            "num_feature_levels": len(points), "decoder_n_points": tuple(points),
            "decoder_attention_heads": s["model.decoder.layers.0.encoder_attn.attention_weights.weight"].shape[0] // sum(points),
            "max_num_bins": s["model.decoder.bbox_embed.0.layers.2.weight"].shape[0] // 4 - 1,
            "top_prob_values": s[f"{lqe}0.weight"].shape[1] // 4 - 1, "lqe_hidden_dim": s[f"{lqe}0.weight"].shape[0],
            "lqe_layers": count(s, r"model\.decoder\.lqe_layers\.0\.reg_conf\.layers\.(\d+)\."),
            **rows(s, encoder_ffn_dim="model.encoder.aifi.0.layers.0.mlp.layers.0.weight",
                   decoder_ffn_dim="model.decoder.layers.0.mlp.layers.0.weight"),
        })
        return out

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo's fields from a transformers ``DFineConfig`` dict."""
        check_model_type(cfg, "D-FINE", "d_fine")
        bb = hybrid_backbone_config(cfg, "D-FINE", "hgnet_v2", "HGNetV2")
        for key, default in FIXED_STRIDES.items():
            if key in bb and list(bb[key]) != default:
                raise CheckpointError(f"config.json: backbone_config {key}={bb[key]}; fastzoo's HGNetV2 builds {default}")
        stages = len(bb.get("stage_out_channels", DFineConfig.stage_out_channels))
        out = hybrid_fields_from_json(cfg, _fields(), BACKBONE, stages)
        levels = cfg.get("num_feature_levels", DFineConfig.num_feature_levels)
        if isinstance(out.get("decoder_n_points"), int):
            out["decoder_n_points"] = (out["decoder_n_points"],) * levels
        if out.get("eval_idx") == cfg.get("decoder_layers", DFineConfig.decoder_layers) - 1:
            out["eval_idx"] = -1
        return out


def hf_config(cfg: DFineConfig):
    """``cfg`` as a ``transformers.DFineConfig`` (which builds the same network)."""
    import transformers

    backbone = {"model_type": "hgnet_v2", **{k: getattr(cfg, k) for k in BACKBONE},
                "hidden_sizes": cfg.stage_out_channels, "depths": cfg.stage_num_blocks}
    return hybrid_hf_config(transformers.DFineConfig, cfg, _fields(), backbone)


HF = HfDFineConverter()
