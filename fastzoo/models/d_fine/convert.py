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
from fastzoo.models.rt_detr.convert import refuse_named_backbone

BACKBONE = ("num_channels", "hidden_act", "stem_channels", "stage_in_channels", "stage_mid_channels", "stage_out_channels",
            "stage_num_blocks", "stage_downsample", "stage_light_block", "stage_kernel_size", "stage_numb_of_layers",
            "use_learnable_affine_block")
# HGNetV2's strides that fastzoo builds only at transformers' defaults (the stem's branches must keep one size)
FIXED_STRIDES = {"stem_strides": [2, 1, 1, 2, 1], "stage_downsample_strides": [2, 2, 2, 2]}
FASTZOO_ONLY = ("model_type", "id2label", "backbone_out_indices", "giou_impl", *BACKBONE)
_HEADS = re.compile(r"^(model\.decoder\.)?(class_embed|bbox_embed)\.")


def _fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(DFineConfig) if f.name not in FASTZOO_ONLY)


class HfDFineConverter:
    """``DFineForObjectDetection`` state dicts."""

    format = "hf"

    @staticmethod
    def matches(state: dict) -> bool:
        # two keys every state and every training gradient dict has
        return "model.encoder_input_proj.0.0.weight" in state and "model.decoder.pre_bbox_head.layers.0.weight" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        out = dict(state)
        for k, v in state.items():
            m = _HEADS.match(k)
            if m:
                out.setdefault(k[len(m[1]):] if m[1] else "model.decoder." + k, v)
        return out

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return dict(state)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        if module is not None and hasattr(module, "config") and hasattr(module.config, "to_dict"):
            return HfDFineConverter.config_from_json(module.config.to_dict())
        s = HfDFineConverter.to_fastzoo(state)

        def count(pattern):
            return len({m[1] for k in s for m in [re.match(pattern, k)] if m})

        bb = re.escape("model.backbone.model.encoder.stages.")
        stages = count(bb + r"(\d+)\.")
        blocks = tuple(count(bb + rf"{i}\.blocks\.(\d+)\.") for i in range(stages))
        layers = tuple(count(bb + rf"{i}\.blocks\.0\.layers\.(\d+)\.") for i in range(stages))
        st = "model.backbone.model.encoder.stages."
        light = tuple(f"{st}{i}.blocks.0.layers.0.conv1.convolution.weight" in s for i in range(stages))
        first = [s[f"{st}{i}.blocks.0.layers.0.{'conv2.' if light[i] else ''}convolution.weight"] for i in range(stages)]
        out_ch = tuple(s[f"{st}{i}.blocks.0.aggregation.1.convolution.weight"].shape[0] for i in range(stages))
        stem = "model.backbone.model.embedder."
        widths = [s[f"model.encoder_input_proj.{i}.0.weight"].shape[1] for i in range(count(r"model\.encoder_input_proj\.(\d+)\."))]
        d, enc_d = s["model.enc_score_head.weight"].shape[1], s["model.encoder_input_proj.0.0.weight"].shape[0]
        scale = s["model.decoder.layers.0.encoder_attn.num_points_scale"].tolist()
        points, i = [], 0
        while i < len(scale):
            points.append(round(1 / scale[i]))
            i += points[-1]
        elan = s["model.encoder.fpn_blocks.0.conv2.conv.weight"].shape[0]
        lqe = "model.decoder.lqe_layers.0.reg_conf.layers."
        out = {
            "num_labels": s["model.enc_score_head.weight"].shape[0],
            "stem_channels": (s[f"{stem}stem1.convolution.weight"].shape[1], s[f"{stem}stem1.convolution.weight"].shape[0],
                              s[f"{stem}stem4.convolution.weight"].shape[0]),
            "stage_in_channels": tuple(s[f"{st}{i}.blocks.0.aggregation.0.convolution.weight"].shape[1] - layers[i] * first[i].shape[0]
                                       for i in range(stages)),
            "stage_mid_channels": tuple(t.shape[0] for t in first), "stage_out_channels": out_ch,
            "stage_num_blocks": blocks, "stage_numb_of_layers": layers, "stage_light_block": light,
            "stage_downsample": tuple(f"{st}{i}.downsample.convolution.weight" in s for i in range(stages)),
            "stage_kernel_size": tuple(t.shape[-1] for t in first),
            "use_learnable_affine_block": f"{stem}stem1.lab.scale" in s,
            "backbone_out_indices": tuple(out_ch.index(w) + 1 for w in widths), "encoder_in_channels": tuple(widths),
            "encoder_hidden_dim": enc_d, "decoder_in_channels": (enc_d,) * len(widths), "d_model": d,
            "encoder_layers": count(r"model\.encoder\.aifi\.0\.layers\.(\d+)\."),
            "encode_proj_layers": tuple(range(len(widths) - count(r"model\.encoder\.aifi\.(\d+)\."), len(widths))),
            "hidden_expansion": (2 * elan + 1) / enc_d,
            "depth_mult": count(r"model\.encoder\.fpn_blocks\.0\.csp_rep1\.bottlenecks\.(\d+)\.") / 3,
            "decoder_layers": count(r"model\.decoder\.layers\.(\d+)\."), "num_feature_levels": len(points),
            "decoder_n_points": tuple(points),
            "decoder_attention_heads": s["model.decoder.layers.0.encoder_attn.attention_weights.weight"].shape[0] // sum(points),
            "num_denoising": 100 if "model.denoising_class_embed.weight" in s else 0,
            "max_num_bins": s["model.decoder.bbox_embed.0.layers.2.weight"].shape[0] // 4 - 1,
            "top_prob_values": s[f"{lqe}0.weight"].shape[1] // 4 - 1, "lqe_hidden_dim": s[f"{lqe}0.weight"].shape[0],
            "lqe_layers": count(r"model\.decoder\.lqe_layers\.0\.reg_conf\.layers\.(\d+)\."),
        }
        for prefix, key in (("encoder", "model.encoder.aifi.0.layers.0.mlp.layers.0.weight"),
                            ("decoder", "model.decoder.layers.0.mlp.layers.0.weight")):
            if key in s:
                out[f"{prefix}_ffn_dim"] = s[key].shape[0]
        return out

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo's fields from a transformers ``DFineConfig`` dict."""
        if cfg.get("model_type", "d_fine") != "d_fine":
            raise CheckpointError(f"config.json has model_type={cfg.get('model_type')!r}; fastzoo's D-FINE reads 'd_fine'")
        bb = cfg.get("backbone_config") or {}
        refuse_named_backbone(cfg, "D-FINE builds transformers' HGNetV2 from backbone_config ('hgnet_v2')")
        if bb.get("model_type", "hgnet_v2") != "hgnet_v2" or cfg.get("use_timm_backbone"):
            raise CheckpointError(f"config.json: backbone_config model_type={bb.get('model_type')!r}; fastzoo's D-FINE "
                                  f"builds transformers' HGNetV2 ('hgnet_v2')")
        for key, default in FIXED_STRIDES.items():
            if key in bb and list(bb[key]) != default:
                raise CheckpointError(f"config.json: backbone_config {key}={bb[key]}; fastzoo's HGNetV2 builds {default}")
        out = {k: cfg[k] for k in _fields() if k in cfg}
        levels = cfg.get("num_feature_levels", DFineConfig.num_feature_levels)
        if isinstance(out.get("decoder_n_points"), int):
            out["decoder_n_points"] = (out["decoder_n_points"],) * levels
        if out.get("eval_idx") == cfg.get("decoder_layers", DFineConfig.decoder_layers) - 1:
            out["eval_idx"] = -1
        labels = cfg.get("id2label")
        out["num_labels"] = len(labels) if labels else cfg.get("num_labels", 80)
        if labels:
            out["id2label"] = {int(k): v for k, v in labels.items()}
        out.update({k: bb[k] for k in BACKBONE if k in bb})
        stages = len(bb.get("stage_out_channels", DFineConfig.stage_out_channels))
        outs = bb.get("out_indices") or [int(f[len("stage"):]) for f in bb.get("out_features") or []] or [2, 3, 4]
        out["backbone_out_indices"] = tuple(i for i in outs if 1 <= i <= stages)
        return out


def hf_config(cfg: DFineConfig):
    """``cfg`` as a ``transformers.DFineConfig`` (which builds the same network)."""
    import transformers

    def plain(v):
        return list(v) if isinstance(v, tuple) else v

    backbone = {"model_type": "hgnet_v2", **{k: plain(getattr(cfg, k)) for k in BACKBONE},
                "hidden_sizes": list(cfg.stage_out_channels), "depths": list(cfg.stage_num_blocks),
                "out_indices": list(cfg.backbone_out_indices)}
    fields = {k: plain(getattr(cfg, k)) for k in _fields()}
    labels = {"id2label": {int(k): v for k, v in cfg.id2label.items()}} if cfg.id2label else {"num_labels": cfg.num_labels}
    fields.pop("num_labels")
    return transformers.DFineConfig(backbone_config=backbone, **fields, **labels)


HF = HfDFineConverter()
