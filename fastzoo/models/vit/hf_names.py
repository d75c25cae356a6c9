"""The Hugging Face hub ids of transformers' vision transformers, as fastzoo ViT variants.

Each id's architecture fields are its hub config.json's (the fields transformers' defaults do not
give), written out here so that naming a model imports no transformers: ``hf_config`` holds them as
transformers reads them, the other fields are the same sizes in timm's names (``tests/test_hf_vision``
reads every ``hf_config`` through transformers' own config classes and compares). The CLIP and
SigLIP ids name whole image-text models: fastzoo builds their vision tower (``CLIPVisionModel``,
``SiglipVisionModel``), which reads the tower's half of the hub's checkpoint.
"""
from __future__ import annotations

from fastzoo.models.spec import Variant
from fastzoo.models.vit.convert import _mlp_ratio
from fastzoo.models.vit.hf_config import _swiglu_hidden

# the defaults of transformers' config classes that the fields below rely on, per model type
_EPS = {"vit": 1e-12, "deit": 1e-12, "dinov2": 1e-6, "clip_vision_model": 1e-5, "siglip_vision_model": 1e-6}
_ACT = {"vit": "gelu", "deit": "gelu", "dinov2": "gelu", "clip_vision_model": "quick_gelu",
        "siglip_vision_model": "gelu_tanh"}


def _variant(hub_id: str, arch: str, model_type: str, timm: str, D: int, depth: int, heads: int, *, img: int = 224,
             patch: int = 16, hidden: int | None = None, labels: int = 0, what: str = "") -> Variant:
    hidden = hidden or 4 * D
    hf = {"architectures": [arch], "model_type": model_type, "hidden_size": D, "num_hidden_layers": depth,
          "num_attention_heads": heads, "image_size": img, "patch_size": patch}
    fields = dict(img_size=img, patch_size=patch, embed_dim=D, depth=depth, num_heads=heads,
                  norm_eps=_EPS[model_type], act_layer=_ACT[model_type], num_classes=labels)
    if model_type == "dinov2":
        swiglu = D >= 1536  # the giant model
        hf.update(use_swiglu_ffn=swiglu)
        fields.update(init_values=1.0, mask_token=True, mlp_layer="swiglu_packed" if swiglu else "mlp",
                      mlp_ratio=_mlp_ratio(D, 2 * _swiglu_hidden(D, 4.0)) if swiglu else 4.0,
                      global_pool="token_avg" if labels else "token")
    else:
        hf.update(intermediate_size=hidden)
        fields.update(mlp_ratio=_mlp_ratio(D, hidden))
    if model_type == "clip_vision_model":
        fields.update(pre_norm=True, fc_norm=True)
    if model_type == "siglip_vision_model":
        fields.update(class_token=False, global_pool="map")
    if model_type in ("vit", "deit"):
        fields.update(pooler=arch in ("ViTModel", "DeiTModel"), dist_token=arch.startswith("DeiT"),
                      distilled_head=arch == "DeiTForImageClassificationWithTeacher")
    if labels:
        hf["num_labels"] = labels
    fields["hf_config"] = hf
    side = f"{img} px"
    description = (f"{what or arch} D={D} x {depth} blocks, {heads} heads, patch {patch}, {side}: transformers' "
                   f"{hub_id}")
    return Variant(hub_id, fields, description, f"transformers {arch} ({hub_id})", timm=timm)


_VIT_SIZES = {"base": (768, 12, 12), "large": (1024, 24, 16), "huge": (1280, 32, 16)}
_DEIT_SIZES = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12)}
_DINO_SIZES = {"small": (384, 12, 6), "base": (768, 12, 12), "large": (1024, 24, 16), "giant": (1536, 40, 24)}


def variants() -> tuple[Variant, ...]:
    out = []
    for size, patch, img in (("base", 16, 224), ("base", 16, 384), ("base", 32, 384), ("large", 16, 224),
                             ("large", 16, 384), ("large", 32, 384)):
        out.append(_variant(f"google/vit-{size}-patch{patch}-{img}", "ViTForImageClassification", "vit",
                            f"vit_{size}_patch{patch}_{img}", *_VIT_SIZES[size], img=img, patch=patch, labels=1000,
                            what="ViT (ImageNet-1k classifier)"))
    for size, patch in (("base", 16), ("base", 32), ("large", 16), ("large", 32), ("huge", 14)):
        out.append(_variant(f"google/vit-{size}-patch{patch}-224-in21k", "ViTModel", "vit", f"vit_{size}_patch{patch}_224"
                            if size != "base" or patch != 32 else "vit_base_patch32_224", *_VIT_SIZES[size],
                            patch=patch, what="ViT (ImageNet-21k backbone with pooler)"))
    for size in _DEIT_SIZES:
        out.append(_variant(f"facebook/deit-{size}-patch16-224", "ViTForImageClassification", "vit",
                            f"deit_{size}_patch16_224", *_DEIT_SIZES[size], labels=1000, what="DeiT"))
        out.append(_variant(f"facebook/deit-{size}-distilled-patch16-224", "DeiTForImageClassificationWithTeacher",
                            "deit", f"deit_{size}_distilled_patch16_224", *_DEIT_SIZES[size], labels=1000,
                            what="DeiT distilled (class and distillation heads)"))
    out.append(_variant("facebook/deit-base-patch16-384", "ViTForImageClassification", "vit", "deit_base_patch16_384",
                        *_DEIT_SIZES["base"], img=384, labels=1000, what="DeiT"))
    out.append(_variant("facebook/deit-base-distilled-patch16-384", "DeiTForImageClassificationWithTeacher", "deit",
                        "deit_base_distilled_patch16_384", *_DEIT_SIZES["base"], img=384, labels=1000,
                        what="DeiT distilled (class and distillation heads)"))
    for size in _DINO_SIZES:
        out.append(_variant(f"facebook/dinov2-{size}", "Dinov2Model", "dinov2", f"vit_{size}_patch14_dinov2",
                            *_DINO_SIZES[size], img=518, patch=14, what="DINOv2 (LayerScale, mask token)"))
    for name, (D, depth, heads, hidden), patch, img, timm in (
            ("clip-vit-base-patch32", (768, 12, 12, 3072), 32, 224, "vit_base_patch32_clip_224"),
            ("clip-vit-base-patch16", (768, 12, 12, 3072), 16, 224, "vit_base_patch16_clip_224"),
            ("clip-vit-large-patch14", (1024, 24, 16, 4096), 14, 224, "vit_large_patch14_clip_224"),
            ("clip-vit-large-patch14-336", (1024, 24, 16, 4096), 14, 336, "vit_large_patch14_clip_336")):
        out.append(_variant(f"openai/{name}", "CLIPVisionModel", "clip_vision_model", timm, D, depth, heads, img=img,
                            patch=patch, hidden=hidden, what="CLIP vision tower (pre-norm, QuickGELU)"))
    for name, (D, depth, heads, hidden), patch, img, timm in (
            ("siglip-base-patch16-224", (768, 12, 12, 3072), 16, 224, "vit_base_patch16_siglip_224"),
            ("siglip-base-patch16-256", (768, 12, 12, 3072), 16, 256, "vit_base_patch16_siglip_256"),
            ("siglip-base-patch16-384", (768, 12, 12, 3072), 16, 384, "vit_base_patch16_siglip_384"),
            ("siglip-base-patch16-512", (768, 12, 12, 3072), 16, 512, "vit_base_patch16_siglip_512"),
            ("siglip-large-patch16-256", (1024, 24, 16, 4096), 16, 256, "vit_large_patch16_siglip_256"),
            ("siglip-large-patch16-384", (1024, 24, 16, 4096), 16, 384, "vit_large_patch16_siglip_384"),
            ("siglip-so400m-patch14-224", (1152, 27, 16, 4304), 14, 224, "vit_so400m_patch14_siglip_224")):
        out.append(_variant(f"google/{name}", "SiglipVisionModel", "siglip_vision_model", timm, D, depth, heads,
                            img=img, patch=patch, hidden=hidden, what="SigLIP vision tower (attention-pooling head)"))
    return tuple(out)
