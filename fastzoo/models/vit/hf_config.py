"""transformers' config.json of each vision transformer class fastzoo's ViT stands in for, both ways:
which class a fastzoo config is written as (:func:`architecture_of`), its config.json
(:func:`hf_config_dict`), and fastzoo's fields from a config.json (:func:`config_from_json`).

A config is written as a transformers class only where that class is the same network:
:func:`hf_config_dict` reads what it wrote back through :func:`config_from_json` and refuses,
naming them, the fields that come back different (a DINOv2 has LayerScale, a CLIP tower norms
the pooled class token only, a ``ViTModel`` has no classifier...). The same rule refuses an
``hf_config`` its config cannot have when the config is made (:func:`check`), not when it is
written.
"""
from __future__ import annotations

import dataclasses

from fastzoo.errors import CheckpointError, ConfigError
from fastzoo.models.vit.convert import _mlp_ratio

# architecture -> (layout, key prefix of its base model in the state dict)
ARCHITECTURES = {
    "ViTForImageClassification": ("vit", "vit."), "ViTModel": ("vit", ""),
    "DeiTForImageClassification": ("vit", "deit."), "DeiTForImageClassificationWithTeacher": ("vit", "deit."),
    "DeiTModel": ("vit", ""),
    "Dinov2ForImageClassification": ("dinov2", "dinov2."), "Dinov2Model": ("dinov2", ""),
    "CLIPVisionModel": ("clip", ""), "SiglipVisionModel": ("siglip", ""),
}
_MODEL_TYPES = {"vit": "vit", "dinov2": "dinov2", "clip": "clip_vision_model", "siglip": "siglip_vision_model"}
_ACT_IN = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_ACT_OUT = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_tanh": "gelu_pytorch_tanh"}

def architecture_of(config) -> str:
    """The transformers class a fastzoo ViT config is written as: its ``hf_config``'s, else the one its
    fields point to (whether that class is the same network: :func:`hf_config_dict`)."""
    arch = ((config.hf_config or {}).get("architectures") or [None])[0]
    if arch in ARCHITECTURES:
        return arch
    if config.pre_norm:
        return "CLIPVisionModel"
    if not config.class_token:
        return "SiglipVisionModel"
    if config.init_values is not None:
        return "Dinov2ForImageClassification" if config.num_classes else "Dinov2Model"
    if config.dist_token:
        return "DeiTForImageClassificationWithTeacher" if config.distilled_head else (
            "DeiTForImageClassification" if config.num_classes else "DeiTModel")
    return "ViTForImageClassification" if config.num_classes else "ViTModel"


def _swiglu_hidden(dim: int, mlp_ratio: float) -> int:
    """transformers' DINOv2 SwiGLU width: 2/3 of the MLP's, rounded up to a multiple of 8."""
    return (int(int(dim * mlp_ratio) * 2 / 3) + 7) // 8 * 8


def _hf_config_object(cfg: dict):
    """transformers' config object for a config dict (its defaults for absent fields); the vision
    config of a whole CLIP / SigLIP model."""
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"config.json has model_type={model_type!r}; fastzoo's ViT reads "
                              f"{', '.join(sorted(set(_MODEL_TYPES.values()) | {'deit', 'clip', 'siglip'}))}")
    from huggingface_hub.errors import StrictDataclassError

    try:
        obj = CONFIG_MAPPING[model_type](**{k: v for k, v in cfg.items() if k not in ("model_type", "problem_type")})
    except (StrictDataclassError, TypeError, ValueError) as e:  # transformers' config class refuses a value
        raise CheckpointError(f"transformers' {model_type} config refuses it: {' '.join(str(e).split())}") from None
    obj.problem_type = cfg.get("problem_type")  # as a live config holds it (its constructor checks it against the labels)
    return obj.vision_config if model_type in ("clip", "siglip") else obj


def config_from_json(cfg: dict) -> dict:
    """fastzoo ViT fields from a transformers config (config.json, or a live model's ``to_dict()``
    with its class as ``architectures``); ``hf_config`` keeps the config itself."""
    whole = cfg.get("model_type") in ("clip", "siglip")
    c = _hf_config_object(cfg)
    model_type = c.model_type
    arch = (cfg.get("architectures") or [None])[0]
    if whole or arch not in ARCHITECTURES:
        arch = {"vit": "ViTForImageClassification", "deit": "DeiTForImageClassificationWithTeacher",
                "dinov2": "Dinov2Model", "clip_vision_model": "CLIPVisionModel",
                "siglip_vision_model": "SiglipVisionModel"}.get(model_type, arch)
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"config.json: architectures={cfg.get('architectures')!r}, model_type={model_type!r}: "
                              f"fastzoo's ViT reads {', '.join(ARCHITECTURES)}")
    layout = ARCHITECTURES[arch][0]
    if c.hidden_act not in _ACT_IN:
        raise CheckpointError(f"config.json: hidden_act={c.hidden_act!r}; fastzoo's ViT has {', '.join(_ACT_IN)}")
    D = c.hidden_size
    size = c.image_size if isinstance(c.image_size, int) else tuple(c.image_size)
    patch = c.patch_size if isinstance(c.patch_size, int) else c.patch_size[0]
    classifier = arch.endswith(("ImageClassification", "WithTeacher"))
    out = dict(img_size=size, patch_size=patch, in_chans=c.num_channels, embed_dim=D, depth=c.num_hidden_layers,
               num_heads=c.num_attention_heads, norm_eps=c.layer_norm_eps, act_layer=_ACT_IN[c.hidden_act],
               num_classes=c.num_labels if classifier else 0, class_token=layout != "siglip", global_pool="token",
               qkv_bias=getattr(c, "qkv_bias", True), fc_norm=None, pre_norm=False, init_values=None,
               dist_token=False, distilled_head=False, mask_token=False, pooler=False, mlp_layer="mlp",
               reg_tokens=0, no_embed_class=False)
    if layout == "vit":
        if arch in ("ViTModel", "DeiTModel") and (c.pooler_act != "tanh" or c.pooler_output_size != D):
            raise CheckpointError(f"config.json: pooler_act={c.pooler_act!r}, pooler_output_size={c.pooler_output_size}; "
                                  f"fastzoo's ViT has the tanh pooler of width hidden_size={D}")
        out.update(mlp_ratio=_mlp_ratio(D, c.intermediate_size), dist_token=arch.startswith("DeiT"),
                   distilled_head=arch == "DeiTForImageClassificationWithTeacher", pooler=arch in ("ViTModel", "DeiTModel"),
                   proj_drop_rate=c.hidden_dropout_prob, pos_drop_rate=c.hidden_dropout_prob,
                   attn_drop_rate=c.attention_probs_dropout_prob)
    elif layout == "dinov2":
        swiglu = c.use_swiglu_ffn
        out.update(mlp_ratio=_mlp_ratio(D, 2 * _swiglu_hidden(D, c.mlp_ratio)) if swiglu else _mlp_ratio(D, int(D * c.mlp_ratio)),
                   mlp_layer="swiglu_packed" if swiglu else "mlp", init_values=float(c.layerscale_value),
                   mask_token=bool(c.use_mask_token), global_pool="token_avg" if classifier else "token",
                   proj_drop_rate=c.hidden_dropout_prob, pos_drop_rate=c.hidden_dropout_prob,
                   attn_drop_rate=c.attention_probs_dropout_prob, drop_path_rate=c.drop_path_rate)
    elif layout == "clip":
        out.update(mlp_ratio=_mlp_ratio(D, c.intermediate_size), pre_norm=True, fc_norm=True,
                   attn_drop_rate=float(c.attention_dropout))
    else:
        out.update(mlp_ratio=_mlp_ratio(D, c.intermediate_size), attn_drop_rate=float(c.attention_dropout),
                   global_pool="map" if getattr(c, "vision_use_head", True) in (True, None) else "")
    hf = c.to_dict()
    hf["architectures"] = [arch]
    out["hf_config"] = hf
    return out


def hf_config_dict(config) -> dict:
    """The transformers config.json of a fastzoo ViT config (its ``hf_config``'s labels and other
    fields kept, the architecture's fields written from the config)."""
    arch = architecture_of(config)
    layout = ARCHITECTURES[arch][0]
    c = config
    if layout == "dinov2" and c.init_values is None:
        raise CheckpointError(f"init_values=None: transformers' {arch} has LayerScale in every block (its "
                              f"layerscale_value); give init_values (1.0: DINOv2's)", fields=("init_values",))
    D = c.embed_dim
    hidden = int(D * c.mlp_ratio)
    base = {k: v for k, v in (c.hf_config or {}).items() if k != "num_labels"}  # the labels come from num_classes
    model_type = "deit" if arch.startswith("DeiT") else _MODEL_TYPES[layout]
    if base.get("model_type") != model_type:
        base = {}
    fields = dict(hidden_size=D, num_hidden_layers=c.depth, num_attention_heads=c.num_heads, num_channels=c.in_chans,
                  image_size=c.img_size[0], patch_size=c.patch_size, hidden_act=_ACT_OUT[c.act_layer],
                  layer_norm_eps=c.norm_eps)
    if layout in ("vit", "dinov2"):
        fields.update(qkv_bias=c.qkv_bias, hidden_dropout_prob=c.proj_drop_rate,
                      attention_probs_dropout_prob=c.attn_drop_rate)
    else:
        fields.update(intermediate_size=hidden, attention_dropout=c.attn_drop_rate)
    if layout == "vit":
        fields.update(intermediate_size=hidden)
    if layout == "dinov2":
        swiglu = c.mlp_layer == "swiglu_packed"
        fields.update(use_swiglu_ffn=swiglu, layerscale_value=c.init_values, use_mask_token=c.mask_token,
                      drop_path_rate=c.drop_path_rate, mlp_ratio=_dinov2_ratio(D, hidden, swiglu))
    if layout == "siglip":
        fields.update(vision_use_head=c.global_pool == "map")
    if arch.endswith(("ImageClassification", "WithTeacher")):
        labels = base.get("id2label") or {}
        if len(labels) != c.num_classes:
            labels = {str(i): f"LABEL_{i}" for i in range(c.num_classes)}
        fields.update(id2label=labels, label2id={v: int(k) for k, v in labels.items()})
    out = {**base, **fields, "model_type": model_type, "architectures": [arch]}
    written = _hf_config_object(out).to_dict() | {"architectures": [arch]}
    _check_read_back(config, written, arch)
    return written


def _check_read_back(config, written: dict, arch: str) -> None:
    """CheckpointError naming each field (free ones aside) that transformers' ``arch`` reads back from
    ``written`` different from ``config``: the network the class builds is not the config's. A
    ``ViTModel``'s pooler is its constructor's ``add_pooling_layer``, which a config.json cannot say."""
    back = type(config).from_dict({**config_from_json(written), "hf_config": None})
    bad = [f.name for f in dataclasses.fields(config) if config.field_kind(f.name) != "free"
           and config.compared(f.name) != back.compared(f.name)
           and not (f.name == "pooler" and arch in ("ViTModel", "DeiTModel"))]
    if bad:
        raise CheckpointError(f"this ViT is not transformers' {arch}: " + "; ".join(
            f"{n}={getattr(config, n)!r} (transformers' {arch} has {getattr(back, n)!r})" for n in bad), fields=bad)


def _dinov2_ratio(D: int, hidden: int, swiglu: bool) -> int:
    """transformers' DINOv2 mlp_ratio (an int: its config's type) that gives fastzoo's fc1 width ``hidden``."""
    if not swiglu and hidden % D == 0:
        return hidden // D
    if swiglu:  # fc1 gives 2 * (int(int(D * r) * 2/3) rounded up to 8), about 4/3 * D * r
        for r in range(1, hidden // D + 2):
            if 2 * _swiglu_hidden(D, r) == hidden:
                return r
    raise CheckpointError(f"mlp_ratio: the fc1 width int(embed_dim * mlp_ratio) = {hidden}"
                          f"{' with mlp_layer=swiglu_packed' if swiglu else ''} is not transformers' DINOv2 of any "
                          f"integer mlp_ratio (its config's type) at hidden_size={D}",
                          fields=("mlp_ratio", "mlp_layer") if swiglu else ("mlp_ratio",))


def check(config) -> None:
    """ConfigError naming ``hf_config`` and the fields its transformers class cannot have, for a config
    with an ``hf_config``: the rule of :func:`hf_config_dict`, applied when the config is made."""
    try:
        hf_config_dict(config)
    except CheckpointError as e:
        raise ConfigError(f"hf_config: {e}. Change those fields, or drop hf_config (hf_config=None: a fastzoo ViT "
                          f"that is no transformers class)", fields=("hf_config", *e.fields)) from None
