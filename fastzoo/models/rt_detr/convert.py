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
from fastzoo.models.rt_detr.config import RTDetrConfig

BACKBONE = {"layer_type": "layer_type", "depths": "depths", "hidden_sizes": "hidden_sizes",
            "embedding_size": "embedding_size", "num_channels": "num_channels", "hidden_act": "hidden_act",
            "downsample_in_first_stage": "downsample_in_first_stage", "downsample_in_bottleneck": "downsample_in_bottleneck"}
V2_ONLY = ("decoder_n_levels", "decoder_offset_scale", "decoder_method")
FASTZOO_ONLY = ("model_type", "id2label", "backbone_out_indices", "giou_impl", *BACKBONE)
READ_ONLY = ("gradient_checkpointing",)  # transformers' legacy field: read, never written
_HEADS = re.compile(r"^(model\.decoder\.)?(class_embed|bbox_embed)\.")


def _fields(v2: bool) -> tuple[str, ...]:
    names = [f.name for f in dataclasses.fields(RTDetrConfig) if f.name not in FASTZOO_ONLY]
    return tuple(n for n in names if v2 or n not in V2_ONLY)


def refuse_named_backbone(cfg: dict, builds: str) -> None:
    """A transformers detector config naming a backbone to load (``backbone='microsoft/resnet-18'``, no
    ``backbone_config``) is refused by name: fastzoo builds its family's own backbone (``builds`` says which)."""
    if cfg.get("backbone") and not cfg.get("backbone_config"):
        raise CheckpointError(f"config.json: backbone={cfg['backbone']!r} without a backbone_config (a backbone "
                              f"transformers loads by name); fastzoo's {builds}")


class HfRTDetrConverter:
    """``RTDetrForObjectDetection`` / ``RTDetrV2ForObjectDetection`` state dicts."""

    format = "hf"

    @staticmethod
    def matches(state: dict) -> bool:
        # two keys every state and every gradient dict has (the encoder's scores reach no loss through top-k)
        # (D-FINE's have them too, and its initial box head: its own converter's)
        return ("model.encoder_input_proj.0.0.weight" in state and "model.decoder.query_pos_head.layers.0.weight" in state
                and "model.decoder.pre_bbox_head.layers.0.weight" not in state)

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        out = dict(state)
        if any(k.endswith("encoder_attn.n_points_scale") for k in state):  # RT-DETRv2: its heads under both names
            for k, v in state.items():
                m = _HEADS.match(k)
                if m:
                    other = k[len(m[1] or ""):] if m[1] else "model.decoder." + k
                    out.setdefault(other, v)
        return out

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return dict(state)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        if module is not None and hasattr(module, "config") and hasattr(module.config, "to_dict"):
            return HfRTDetrConverter.config_from_json(module.config.to_dict())
        s = HfRTDetrConverter.to_fastzoo(state)

        def count(pattern):
            return len({m[1] for k in s for m in [re.match(pattern, k)] if m})

        bb = "model.backbone.model."
        stages = count(re.escape(bb) + r"encoder\.stages\.(\d+)\.")
        depths = tuple(count(re.escape(bb) + rf"encoder\.stages\.{i}\.layers\.(\d+)\.") for i in range(stages))
        bottleneck = f"{bb}encoder.stages.0.layers.0.layer.2.convolution.weight" in s
        last = 2 if bottleneck else 1
        hidden = tuple(s[f"{bb}encoder.stages.{i}.layers.0.layer.{last}.convolution.weight"].shape[0] for i in range(stages))
        widths = [s[f"model.encoder_input_proj.{i}.0.weight"].shape[1] for i in range(count(r"model\.encoder_input_proj\.(\d+)\."))]
        d = s["model.enc_score_head.weight"].shape[1]
        enc_d = s["model.encoder_input_proj.0.0.weight"].shape[0]
        levels = count(r"model\.decoder_input_proj\.(\d+)\.")
        v2 = "model.decoder.layers.0.encoder_attn.n_points_scale" in s
        out = {
            "model_type": "rt_detr_v2" if v2 else "rt_detr", "num_labels": s["model.enc_score_head.weight"].shape[0],
            "layer_type": "bottleneck" if bottleneck else "basic", "depths": depths, "hidden_sizes": hidden,
            "embedding_size": s[f"{bb}embedder.embedder.2.convolution.weight"].shape[0],
            "num_channels": s[f"{bb}embedder.embedder.0.convolution.weight"].shape[1],
            "backbone_out_indices": tuple(hidden.index(w) + 1 for w in widths), "encoder_in_channels": tuple(widths),
            "encoder_hidden_dim": enc_d, "d_model": d,
            "decoder_in_channels": tuple(s[f"model.decoder_input_proj.{i}.0.weight"].shape[1] for i in range(levels)
                                         if s[f"model.decoder_input_proj.{i}.0.weight"].shape[-1] == 1),  # the 1x1 ones
            "encoder_layers": count(r"model\.encoder\.aifi\.0\.layers\.(\d+)\."),
            "encode_proj_layers": tuple(range(len(widths) - count(r"model\.encoder\.aifi\.(\d+)\."), len(widths))),
            "hidden_expansion": s["model.encoder.fpn_blocks.0.conv1.conv.weight"].shape[0] / enc_d,
            "decoder_layers": count(r"model\.decoder\.layers\.(\d+)\."), "num_feature_levels": levels,
            "num_denoising": 100 if "model.denoising_class_embed.weight" in s else 0,
        }
        if count(r"model\.encoder\.aifi\.(\d+)\.") == 0:
            out["encode_proj_layers"] = ()
        for prefix, key in (("encoder", "model.encoder.aifi.0.layers.0.mlp.fc1.weight"),
                            ("decoder", "model.decoder.layers.0.mlp.fc1.weight")):
            if key in s:
                out[f"{prefix}_ffn_dim"] = s[key].shape[0]
        if v2:
            out["decoder_n_levels"] = levels
        # heads x points per level is one product in the tensors: points from transformers' default heads where they divide
        rows = s["model.decoder.layers.0.encoder_attn.attention_weights.weight"].shape[0]
        heads = RTDetrConfig.decoder_attention_heads
        if rows % (heads * levels) == 0:
            out["decoder_n_points"] = rows // (heads * levels)
        return out

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo's fields from a transformers ``RTDetrConfig`` / ``RTDetrV2Config`` dict."""
        model_type = cfg.get("model_type", "rt_detr")
        if model_type not in ("rt_detr", "rt_detr_v2"):
            raise CheckpointError(f"config.json has model_type={model_type!r}; fastzoo's RT-DETR reads 'rt_detr' and "
                                  f"'rt_detr_v2'")
        bb = cfg.get("backbone_config") or {}
        refuse_named_backbone(cfg, "RT-DETR builds transformers' ResNet-vd from backbone_config ('rt_detr_resnet')")
        if bb.get("model_type", "rt_detr_resnet") != "rt_detr_resnet" or cfg.get("use_timm_backbone"):
            raise CheckpointError(f"config.json: backbone_config model_type={bb.get('model_type')!r}; fastzoo's RT-DETR "
                                  f"builds transformers' ResNet-vd ('rt_detr_resnet')")
        v2 = model_type == "rt_detr_v2"
        out = {k: cfg[k] for k in _fields(v2) if k in cfg}
        out["model_type"] = model_type
        labels = cfg.get("id2label")
        out["num_labels"] = len(labels) if labels else cfg.get("num_labels", 80)
        if labels:
            out["id2label"] = {int(k): v for k, v in labels.items()}
        out.update({ours: bb[theirs] for ours, theirs in BACKBONE.items() if theirs in bb})
        stages = len(bb.get("depths", RTDetrConfig.depths))
        outs = bb.get("out_indices") or [int(f[len("stage"):]) for f in bb.get("out_features") or []] or [2, 3, 4]
        out["backbone_out_indices"] = tuple(i for i in outs if 1 <= i <= stages)
        return out


def hf_config(cfg: RTDetrConfig):
    """``cfg`` as a ``transformers.RTDetrConfig`` / ``RTDetrV2Config`` (which builds the same network)."""
    import transformers

    backbone = {"model_type": "rt_detr_resnet", **{theirs: getattr(cfg, ours) for ours, theirs in BACKBONE.items()},
                "out_indices": list(cfg.backbone_out_indices)}
    backbone["depths"], backbone["hidden_sizes"] = list(cfg.depths), list(cfg.hidden_sizes)
    fields = {k: getattr(cfg, k) for k in _fields(cfg.v2) if k not in READ_ONLY}
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
    labels = {"id2label": {int(k): v for k, v in cfg.id2label.items()}} if cfg.id2label else {"num_labels": cfg.num_labels}
    fields.pop("num_labels")
    cls = transformers.RTDetrV2Config if cfg.v2 else transformers.RTDetrConfig
    return cls(backbone_config=backbone, **fields, **labels)


HF = HfRTDetrConverter()
