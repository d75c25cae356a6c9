"""transformers' DETR checkpoints, both ways. fastzoo's DETR has ``DetrForObjectDetection``'s module
names, so a transformers 5.x state dict loads key for key; the names older checkpoints carry (the hub's
``facebook/detr-resnet-50`` files: ``backbone.conv_encoder.model``, ``self_attn.out_proj``, a layer's
``fc1`` / ``fc2`` outside its ``mlp``) are renamed as transformers' own ``conversion_mapping`` does,
and BatchNorm step counters (``num_batches_tracked``) are dropped (the backbone's BatchNorm is frozen).

The config: from a transformers ``config.json`` or a live model's config (both backbone paths:
timm's ResNet by name, transformers' ``ResNetConfig``; DC5, ``dilation``, from the output stride
transformers asks of timm), or from the keys of a bare state dict (everything but the heads'
counts, the activation and ``dilation``, which keep transformers' defaults).
"""
from __future__ import annotations

import re

from fastzoo.errors import CheckpointError
from fastzoo.models.detr.config import TIMM_RESNETS, TIMM_WIDTHS, DetrConfig
from fastzoo.models.detr.hf_detector import HfDetectorConverter, check_model_type, count, labels_from_json

# transformers 5.x's renames of DETR's older keys (conversion_mapping.py, "DetrModel")
_RENAMES = ((re.compile(r"backbone\.conv_encoder\."), "backbone."),
            (re.compile(r"\.out_proj\."), ".o_proj."),
            (re.compile(r"layers\.(\d+)\.fc([12])\."), r"layers.\1.mlp.fc\2."))
_DETR_PARTS = ("class_labels_classifier.", "bbox_predictor.", "model.query_position_embeddings.", "model.input_projection.")


def layer_counts(state: dict) -> dict:
    """The encoder's and the decoder's layer counts a transformers detector's state dict holds."""
    return {f"{part}_layers": count(state, rf"model\.{part}\.layers\.(\d+)\.") for part in ("encoder", "decoder")}


class HfDetrConverter(HfDetectorConverter):
    """``DetrForObjectDetection`` state dicts (transformers 5.x names and the older ones)."""

    @staticmethod
    def matches(state: dict) -> bool:
        """DETR's keys: any of its heads or transformer parts (a state dict missing one key is still
        DETR's, and strict loading names the key)."""
        return any(k.startswith(_DETR_PARTS) for k in state)

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        out = {}
        for k, v in state.items():
            if k.endswith("num_batches_tracked"):
                continue
            for pattern, new in _RENAMES:
                k = pattern.sub(new, k)
            out[k] = v
        return out

    @staticmethod
    def config_from_keys(s: dict) -> dict:
        return {
            "num_labels": s["class_labels_classifier.weight"].shape[0] - 1,
            "num_queries": s["model.query_position_embeddings.weight"].shape[0],
            "d_model": s["model.query_position_embeddings.weight"].shape[1],
            **layer_counts(s),
            "encoder_ffn_dim": s["model.encoder.layers.0.mlp.fc1.weight"].shape[0],
            "decoder_ffn_dim": s["model.decoder.layers.0.mlp.fc1.weight"].shape[0],
            "num_channels": _stem(s).shape[1],
            **_backbone_from_keys(s),
        }

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo's fields from a transformers ``DetrConfig`` dict (``config.json``, ``config.to_dict()``)."""
        check_model_type(cfg, "DETR", "detr")
        names = tuple(n for n in HF_FIELDS if n not in ("num_labels", "init_std")) + ("gradient_checkpointing",)
        return {**fields_from_json(cfg, names), **_backbone_from_config(cfg)}


def fields_from_json(cfg: dict, names: tuple[str, ...]) -> dict:
    """The ``names`` a DETR-like config dict gives, and its labels (transformers' default: COCO's 91)."""
    return {**{k: cfg[k] for k in names if k in cfg}, **labels_from_json(cfg, 91)}


def _stem(s: dict):
    return s.get("model.backbone.model.conv1.weight", s.get("model.backbone.model.embedder.embedder.convolution.weight"))


def _backbone_from_keys(s: dict) -> dict:
    pre = "model.backbone.model."
    if pre + "conv1.weight" in s:  # timm's ResNet (torchvision's names)
        depth: dict[int, int] = {}
        for k in s:
            m = re.match(rf"^{re.escape(pre)}layer(\d+)\.(\d+)\.conv1\.weight$", k)
            if m:
                depth[int(m[1])] = max(depth.get(int(m[1]), 0), int(m[2]) + 1)
        stages = sorted(depth)
        bottleneck = f"{pre}layer1.0.conv3.weight" in s
        last = "conv3" if bottleneck else "conv2"
        sizes = ("bottleneck" if bottleneck else "basic", tuple(depth[i] for i in stages),
                 tuple(s[f"{pre}layer{i}.0.{last}.weight"].shape[0] for i in stages), s[pre + "conv1.weight"].shape[0])
        for name, (block, depths) in TIMM_RESNETS.items():
            if sizes == (block, depths, TIMM_WIDTHS[block], 64):
                return {"use_timm_backbone": True, "backbone": name}
        raise CheckpointError(f"a DETR checkpoint whose timm backbone (layer_type, depths, hidden_sizes, embedding_size = "
                              f"{sizes}) is none of timm's {', '.join(TIMM_RESNETS)}, which transformers builds by name")
    if pre + "embedder.embedder.convolution.weight" in s:  # transformers' ResNetBackbone
        depth = {}
        for k in s:
            m = re.match(rf"^{re.escape(pre)}encoder\.stages\.(\d+)\.layers\.(\d+)\.", k)
            if m:
                depth[int(m[1])] = max(depth.get(int(m[1]), 0), int(m[2]) + 1)
        stages = sorted(depth)
        bottleneck = f"{pre}encoder.stages.0.layers.0.layer.2.convolution.weight" in s
        last = 2 if bottleneck else 1
        return {"use_timm_backbone": False, "backbone": None, "layer_type": "bottleneck" if bottleneck else "basic",
                "depths": tuple(depth[i] for i in stages),
                "embedding_size": s[pre + "embedder.embedder.convolution.weight"].shape[0],
                "hidden_sizes": tuple(s[f"{pre}encoder.stages.{i}.layers.0.layer.{last}.convolution.weight"].shape[0]
                                      for i in stages)}
    raise CheckpointError("a DETR checkpoint whose backbone is neither timm's ResNet (model.backbone.model.conv1) "
                          "nor transformers' ResNetBackbone (model.backbone.model.embedder): not a backbone fastzoo builds")


def _timm_name(name: str) -> str:
    base = name.split("/")[-1].split(".")[0]  # "timm/resnet50.a1_in1k" -> "resnet50"
    if base not in TIMM_RESNETS:
        raise CheckpointError(f"backbone={name!r}: fastzoo's DETR builds timm's {', '.join(TIMM_RESNETS)} (torchvision's "
                              f"stem; not the deep-stem -c / -d variants)")
    return base


def _timm_output_stride(cfg: dict):
    """The output stride transformers asks of timm's backbone: its ``backbone_config``'s, else (the
    hub's config.json files) ``backbone_kwargs``' if given, else 16 with ``dilation`` (DC5), else timm's own."""
    bb = cfg.get("backbone_config")
    if bb is not None:
        return bb.get("output_stride")
    if cfg.get("backbone_kwargs"):
        return cfg["backbone_kwargs"].get("output_stride")
    return 16 if cfg.get("dilation") else None


def _backbone_from_config(cfg: dict) -> dict:
    bb = cfg.get("backbone_config")
    if bb is None or bb.get("model_type") == "timm_backbone":
        if bb is None and cfg.get("use_timm_backbone", True) is False:
            raise CheckpointError("config.json: use_timm_backbone=False without a backbone_config; give transformers' "
                                  "ResNetConfig as backbone_config")
        name = _timm_name((bb or {}).get("backbone") or cfg.get("backbone") or "resnet50")
        output_stride = _timm_output_stride(cfg)
        if output_stride not in (None, 32, 16):
            raise CheckpointError(f"backbone output_stride={output_stride}: fastzoo's DETR builds timm's backbone at "
                                  f"output stride 32 or 16 (dilation=True, DC5)")
        return {"use_timm_backbone": True, "backbone": name, "dilation": output_stride == 16, **_stem_channels(bb)}
    if bb.get("model_type") != "resnet":
        raise CheckpointError(f"backbone_config has model_type={bb.get('model_type')!r}; fastzoo's DETR builds ResNet "
                              f"backbones (timm's, or transformers' 'resnet')")
    if bb.get("downsample_in_bottleneck") or bb.get("downsample_in_first_stage"):
        raise CheckpointError("backbone_config: downsample_in_bottleneck / downsample_in_first_stage are not built by "
                              "fastzoo's DETR (transformers' defaults, False, are)")
    outs = bb.get("out_features") or ["stage4"]
    if outs[-1] != f"stage{len(bb.get('depths', (3, 4, 6, 3)))}":
        raise CheckpointError(f"backbone_config: out_features={outs} does not end at the last stage, which DETR reads")
    # transformers builds its ResNetBackbone undilated whatever `dilation` says: that is the function read
    return {"use_timm_backbone": False, "backbone": None, "layer_type": bb.get("layer_type", "bottleneck"),
            "depths": tuple(bb.get("depths", (3, 4, 6, 3))), "hidden_sizes": tuple(bb.get("hidden_sizes", (256, 512, 1024, 2048))),
            "embedding_size": bb.get("embedding_size", 64), "dilation": False, **_stem_channels(bb)}


def _stem_channels(bb: dict | None) -> dict:
    """``num_channels`` as the backbone's stem reads it: its config's (transformers builds the stem from
    ``backbone_config``, which Deformable DETR's config gives 3 channels whatever its own ``num_channels``
    says); none where the config.json has no backbone config (its ``num_channels`` is the stem's)."""
    return {"num_channels": bb["num_channels"]} if bb and bb.get("num_channels") is not None else {}


HF_FIELDS = ("num_queries", "d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "decoder_ffn_dim",
             "encoder_attention_heads", "decoder_attention_heads", "activation_function", "position_embedding_type",
             "dropout", "attention_dropout", "activation_dropout", "auxiliary_loss", "num_channels", "class_cost",
             "bbox_cost", "giou_cost", "bbox_loss_coefficient", "giou_loss_coefficient", "eos_coefficient", "num_labels",
             "init_std")


def hf_config(cfg: DetrConfig, config_class: str = "DetrConfig", names: tuple[str, ...] = HF_FIELDS,
              out_features: tuple[int, ...] | None = None):
    """``cfg`` as a ``transformers.DetrConfig`` (which builds the same network on random weights); a detector
    of the family passes its own transformers config class, the fields it writes and the backbone stages it
    reads (``out_features``; default the last)."""
    fields = {k: getattr(cfg, k) for k in names}
    if cfg.id2label is not None:
        fields.update(id2label=dict(cfg.id2label), label2id={v: k for k, v in cfg.id2label.items()})
    # transformers types the cost and loss weights as int: whole numbers go in as ints, others after
    fractional = {k: v for k, v in fields.items() if k in _INT_WEIGHTS and not float(v).is_integer()}
    fields.update({k: int(v) if k in _INT_WEIGHTS and k not in fractional else v for k, v in fields.items()})
    fields.update({k: 1 for k in fractional})
    hf = _hf_config(cfg, fields, config_class, out_features or (len(cfg.depths),))
    for k, v in fractional.items():
        object.__setattr__(hf, k, v)
    return hf


_INT_WEIGHTS = ("class_cost", "bbox_cost", "giou_cost", "bbox_loss_coefficient", "giou_loss_coefficient")


def _hf_config(cfg: DetrConfig, fields: dict, config_class: str, out_features: tuple[int, ...]):
    import transformers

    make = getattr(transformers, config_class)
    if cfg.use_timm_backbone:
        hf = make(use_timm_backbone=True, backbone=cfg.backbone, use_pretrained_backbone=False, dilation=cfg.dilation,
                  **fields)
        # the stem is built from the backbone config's channels, which DeformableDetrConfig sets to 3 whatever
        # num_channels says (DetrConfig copies num_channels there)
        hf.backbone_config.num_channels = cfg.num_channels
        return hf
    resnet = transformers.ResNetConfig(num_channels=cfg.num_channels, embedding_size=cfg.embedding_size,
                                       hidden_sizes=list(cfg.hidden_sizes), depths=list(cfg.depths),
                                       layer_type=cfg.layer_type, out_features=[f"stage{i}" for i in out_features])
    return make(use_timm_backbone=False, backbone_config=resnet, use_pretrained_backbone=False, **fields)


HF = HfDetrConverter()
