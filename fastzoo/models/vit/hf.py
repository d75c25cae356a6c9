"""transformers' vision transformers as checkpoints of fastzoo's ViT, both ways: ``ViTModel`` /
``ViTForImageClassification``, ``DeiTModel`` / ``DeiTForImageClassification(WithTeacher)``,
``Dinov2Model`` / ``Dinov2ForImageClassification``, ``CLIPVisionModel`` (and the vision tower of a
whole ``CLIPModel``), ``SiglipVisionModel`` (and ``SiglipModel``'s tower).

They are one architecture with small differences, each a config field of fastzoo's ViT (timm's
module names), so conversion is key renaming plus joining transformers' separate q, k, v
projections into timm's ``qkv``:

- ViT / DeiT: LayerNorm eps 1e-12; DeiT's distillation token and second head (``dist_token``,
  ``distilled_head``); ViTModel's pooler (``pooler``).
- DINOv2: LayerScale (``init_values``), the mask token (``mask_token``), the packed SwiGLU MLP of
  the giant model (``mlp_layer``), the classifier on the class and mean patch token
  (``global_pool='token_avg'``).
- CLIP: a LayerNorm before the blocks (``pre_norm``), QuickGELU, no patch bias, and the final norm
  on the pooled class token only (``fc_norm=True``): ``last_hidden_state`` is un-normed.
- SigLIP: no class token, tanh-GELU, the attention-pooling head (``global_pool='map'``).

Checkpoint keys are read in transformers 5's names and in the older ones the hub's files carry
(``encoder.layer.N.attention.attention.query``, ``vision_model.`` prefixes); written in the names of
the installed transformers (what its ``load_state_dict`` and ``from_pretrained`` take); their configs
both ways: :mod:`fastzoo.models.vit.hf_config`.
"""
from __future__ import annotations

import math
import re

import torch

from fastzoo.errors import CheckpointError
from fastzoo.models.vit.convert import _mlp_ratio
from fastzoo.models.vit.hf_config import (_MODEL_TYPES, ARCHITECTURES, _hf_config_object, architecture_of,
                                          config_from_json, hf_config_dict)

_WHOLE_MODEL = ("text_model.", "text_projection.", "visual_projection.", "logit_scale", "logit_bias")  # CLIPModel / SiglipModel, not the tower
# the hub files' names (transformers 4) -> transformers 5's, for ViT and DeiT
_OLD_VIT = [(r"encoder\.layer\.(\d+)\.", r"layers.\1."), (r"attention\.attention\.query\.", "attention.q_proj."),
            (r"attention\.attention\.key\.", "attention.k_proj."), (r"attention\.attention\.value\.", "attention.v_proj."),
            (r"attention\.output\.dense\.", "attention.o_proj."), (r"intermediate\.dense\.", "mlp.fc1."),
            (r"output\.dense\.", "mlp.fc2.")]
# per layout: (transformers' block prefix, {its name in a block: timm's}, {its name outside blocks: timm's})
_NAMES = {
    "vit": ("layers.{i}.", {"layernorm_before": "norm1", "layernorm_after": "norm2", "attention.o_proj": "attn.proj",
                            "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"},
            {"embeddings.cls_token": "cls_token", "embeddings.distillation_token": "dist_token",
             "embeddings.mask_token": "mask_token", "embeddings.position_embeddings": "pos_embed",
             "embeddings.patch_embeddings.projection": "patch_embed.proj", "layernorm": "norm", "pooler.dense": "pooler",
             "classifier": "head", "cls_classifier": "head", "distillation_classifier": "head_dist"}),
    "dinov2": ("encoder.layer.{i}.", {"norm1": "norm1", "norm2": "norm2", "attention.output.dense": "attn.proj",
                                      "layer_scale1.lambda1": "ls1.gamma", "layer_scale2.lambda1": "ls2.gamma",
                                      "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "mlp.weights_in": "mlp.fc1",
                                      "mlp.weights_out": "mlp.fc2"},
               {"embeddings.cls_token": "cls_token", "embeddings.mask_token": "mask_token",
                "embeddings.position_embeddings": "pos_embed", "embeddings.patch_embeddings.projection": "patch_embed.proj",
                "layernorm": "norm", "classifier": "head"}),
    "clip": ("encoder.layers.{i}.", {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
                                     "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"},
             {"embeddings.class_embedding": "cls_token", "embeddings.patch_embedding": "patch_embed.proj",
              "embeddings.position_embedding.weight": "pos_embed", "pre_layrnorm": "norm_pre",
              "post_layernorm": "fc_norm"}),
    "siglip": ("encoder.layers.{i}.", {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
                                       "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"},
               {"embeddings.patch_embedding": "patch_embed.proj", "embeddings.position_embedding.weight": "pos_embed",
                "post_layernorm": "norm", "head.probe": "attn_pool.latent", "head.attention.out_proj": "attn_pool.proj",
                "head.layernorm": "attn_pool.norm", "head.mlp.fc1": "attn_pool.mlp.fc1",
                "head.mlp.fc2": "attn_pool.mlp.fc2"}),
}
_QKV = {"vit": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
        "dinov2": ("attention.attention.query", "attention.attention.key", "attention.attention.value"),
        "clip": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "siglip": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}


def _layout(state: dict) -> str | None:
    keys = set(state)
    if any(k.endswith("embeddings.class_embedding") for k in keys):
        return "clip"
    if any(k.endswith("embeddings.patch_embedding.weight") for k in keys):
        return "siglip"
    if any(re.search(r"encoder\.layer\.\d+\.norm1\.weight$", k) for k in keys):
        return "dinov2"
    if any(k.endswith("embeddings.patch_embeddings.projection.weight") for k in keys):
        return "vit"
    return None


def _strip(state: dict, layout: str) -> tuple[dict, str]:
    """The base model's keys without the class prefix (``vit.``, ``vision_model.``...), transformers 5's
    names, a whole CLIP / SigLIP model's text half dropped; and the prefix that was found."""
    if any(k.startswith("text_model.") for k in state):
        state = {k: v for k, v in state.items() if not k.startswith(_WHOLE_MODEL)}
    prefix = next((p for p in ("vit.", "deit.", "dinov2.", "vision_model.")
                   if any(k.startswith(p + "embeddings.") for k in state)), "")
    out = {}
    for k, v in state.items():
        k = k[len(prefix):] if k.startswith(prefix) else k
        if layout == "vit":
            for old, new in _OLD_VIT:
                k = re.sub(old, new, k)
        out[k] = v
    return out, prefix


def _sub(name: str, table: dict) -> str | None:
    """``table``'s rename of ``name`` (a parameter name, or a module name + ``.weight`` / ``.bias``)."""
    if name in table:
        return table[name]
    module, _, leaf = name.rpartition(".")
    return f"{table[module]}.{leaf}" if module in table else None


def to_fastzoo(state: dict) -> dict:
    """timm's names for a transformers state dict (or its gradients) of any of the layouts above."""
    layout = _layout(state)
    if layout is None:
        raise CheckpointError(f"not a transformers ViT / DeiT / DINOv2 / CLIP / SigLIP checkpoint: none of its keys "
                              f"names a layout fastzoo reads ({', '.join(sorted(state)[:8])}{' ...' if len(state) > 8 else ''})")
    hf, _ = _strip(state, layout)
    block, inside, outside = _NAMES[layout]
    qkv = _QKV[layout]
    out, parts, unknown = {}, {}, []
    for k, v in hf.items():
        m = re.match(block.replace(".", r"\.").replace("{i}", r"(\d+)"), k)
        if m:
            rest = k[m.end():]
            hit = next((i for i, name in enumerate(qkv) if rest.startswith(name + ".")), None)
            if hit is not None:
                parts.setdefault((m[1], rest.rsplit(".", 1)[1]), {})[hit] = v
                continue
            new = _sub(rest, inside)
            new = None if new is None else f"blocks.{m[1]}.{new}"
        elif k == "head.attention.in_proj_weight" or k == "head.attention.in_proj_bias":
            D = v.shape[0] // 3
            leaf = k.rsplit("_", 1)[1]
            out[f"attn_pool.q.{leaf}"], out[f"attn_pool.kv.{leaf}"] = v[:D], v[D:]
            continue
        elif k == "embeddings.position_ids":  # a buffer older files saved: recomputed
            continue
        else:
            new = _sub(k, outside)
        if new is None:
            unknown.append(k)
            continue
        out[new] = v
    if unknown:
        raise CheckpointError(f"transformers {layout} checkpoint: keys fastzoo's ViT has no place for ({len(unknown)}): "
                              f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
    for (i, leaf), qkv_parts in parts.items():
        if len(qkv_parts) == 3:
            out[f"blocks.{i}.attn.qkv.{leaf}"] = torch.cat([qkv_parts[0], qkv_parts[1], qkv_parts[2]], dim=0)
        else:  # a gradient dict may lack some (no gradient reached them): keep what is there under timm's name
            raise CheckpointError(f"blocks.{i}: the checkpoint has {len(qkv_parts)} of the q, k, v {leaf} tensors")
    if "cls_token" in out and out["cls_token"].ndim == 1:  # CLIP's class_embedding [D]
        out["cls_token"] = out["cls_token"].reshape(1, 1, -1)
    if "pos_embed" in out and out["pos_embed"].ndim == 2:  # CLIP / SigLIP: an nn.Embedding [S, D]
        out["pos_embed"] = out["pos_embed"].unsqueeze(0)
    if "mask_token" in out and out["mask_token"].ndim == 2:  # DINOv2's [1, D]
        out["mask_token"] = out["mask_token"].unsqueeze(0)
    return out


def from_fastzoo(state: dict, config) -> dict:
    """A state dict that the transformers class of :func:`architecture_of` takes with ``strict=True``."""
    arch = architecture_of(config)
    layout, prefix = ARCHITECTURES[arch]
    block, inside, outside = _NAMES[layout]
    swiglu = config.mlp_layer == "swiglu_packed"  # DINOv2's SwiGLU names its projections weights_in / weights_out
    back_in = {v: k for k, v in inside.items() if not k.startswith("mlp.") or ("weights_" in k) == swiglu}
    back_out = {v: k for k, v in outside.items() if not (layout == "vit" and k == "classifier" and config.distilled_head)}
    if layout == "vit" and not config.distilled_head:
        back_out["head"] = "classifier"
    out = {}
    for k, v in state.items():
        m = re.match(r"blocks\.(\d+)\.(.*)$", k)
        if m and m[2].startswith("attn.qkv."):
            leaf = m[2].rsplit(".", 1)[1]
            for name, part in zip(_QKV[layout], v.chunk(3, dim=0)):
                out[f"{prefix}{block.format(i=m[1])}{name}.{leaf}"] = part
            continue
        if m:
            new = f"{block.format(i=m[1])}{_sub(m[2], back_in)}"
        elif k.startswith("attn_pool.q.") or k.startswith("attn_pool.kv."):
            continue  # joined below
        elif (new := _sub(k, back_out)) is None:
            raise CheckpointError(f"{k}: no place in transformers' {arch}")
        if new.startswith(("classifier", "cls_classifier", "distillation_classifier")):
            out[new] = v  # the head sits outside the base model's prefix
        else:
            out[prefix + new] = v
    if "attn_pool.q.weight" in state:
        for leaf in ("weight", "bias"):
            out[f"head.attention.in_proj_{leaf}"] = torch.cat([state[f"attn_pool.q.{leaf}"], state[f"attn_pool.kv.{leaf}"]])
    p = prefix + "embeddings."
    if layout == "clip":
        out[p + "class_embedding"] = out[p + "class_embedding"].reshape(-1)
    if layout in ("clip", "siglip"):
        out[p + "position_embedding.weight"] = out[p + "position_embedding.weight"][0]
    if layout == "dinov2" and p + "mask_token" in out:
        out[p + "mask_token"] = out[p + "mask_token"][0]
    return out


def build(config):
    """The transformers model of a fastzoo ViT config (its ``hf_config``'s class), eager attention:
    the reference for the equivalence tests (random init)."""
    import transformers

    cfg = hf_config_dict(config)
    arch = cfg["architectures"][0]
    hf = _hf_config_object(cfg)
    hf._attn_implementation = "eager"
    return getattr(transformers, arch)(hf)


def infer_config(state: dict) -> dict:
    """What the keys of a transformers state dict fix (sizes, tokens, heads); the heads' count, the
    norm eps and the activation come from the model's variant or the caller."""
    layout = _layout(state)
    hf, prefix = _strip(state, layout)
    timm = to_fastzoo(state)
    D, C, P, _ = timm["patch_embed.proj.weight"].shape
    depth = 1 + max(int(m[1]) for k in timm if (m := re.match(r"blocks\.(\d+)\.", k)))
    fc1 = timm["blocks.0.mlp.fc1.weight"].shape[0]
    swiglu = "blocks.0.mlp.fc2.weight" in timm and timm["blocks.0.mlp.fc2.weight"].shape[1] * 2 == fc1
    prefix_tokens = int("cls_token" in timm) + int("dist_token" in timm)
    side = math.isqrt(timm["pos_embed"].shape[1] - prefix_tokens)
    head = timm.get("head.weight")
    out = dict(embed_dim=D, in_chans=C, patch_size=P, depth=depth, img_size=side * P, mlp_ratio=_mlp_ratio(D, fc1),
               mlp_layer="swiglu_packed" if swiglu else "mlp", class_token="cls_token" in timm,
               dist_token="dist_token" in timm, distilled_head="head_dist.weight" in timm,
               mask_token="mask_token" in timm, pooler="pooler.weight" in timm, num_classes=0 if head is None else head.shape[0],
               qkv_bias="blocks.0.attn.qkv.bias" in timm, pre_norm="norm_pre.weight" in timm,
               fc_norm=True if layout == "clip" else None, reg_tokens=0, no_embed_class=False,
               init_values=1.0 if "blocks.0.ls1.gamma" in timm else None,
               global_pool="map" if "attn_pool.latent" in timm else (
                   "token_avg" if head is not None and head.shape[1] == 2 * D else ("token" if "cls_token" in timm else "")))
    arch = {"clip": "CLIPVisionModel", "siglip": "SiglipVisionModel"}.get(layout)
    if arch is None:
        base = {"vit.": "ViT", "deit.": "DeiT", "dinov2.": "Dinov2"}.get(prefix)
        if layout == "dinov2":
            arch = "Dinov2ForImageClassification" if head is not None else "Dinov2Model"
        elif out["distilled_head"]:
            arch = "DeiTForImageClassificationWithTeacher"
        else:
            base = base or ("DeiT" if out["dist_token"] else "ViT")
            arch = f"{base}ForImageClassification" if head is not None else f"{base}Model"
    model_type = "deit" if arch.startswith("DeiT") else _MODEL_TYPES[ARCHITECTURES[arch][0]]
    out["hf_config"] = {"architectures": [arch], "model_type": model_type}
    return out


class HfViTConverter:
    """The converter the ViT spec lists for transformers' checkpoints (see :mod:`fastzoo.weights`)."""

    format = "hf"

    @staticmethod
    def matches(state: dict) -> bool:
        return _layout(state) is not None

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return to_fastzoo(state)

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return from_fastzoo(state, config)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return infer_config(state)

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        return config_from_json(cfg)


HF_VIT = HfViTConverter()
