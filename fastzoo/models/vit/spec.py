"""The ViT family as the rest of fastzoo reads it: variants, converters, tiny config, the original."""
from __future__ import annotations

from torch import nn

from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload
from fastzoo.models.vit.convert import VIT
from fastzoo.models.vit.model import VisionTransformer


def timm_vit(cfg: dict) -> nn.Module:
    """timm's VisionTransformer on fastzoo config fields, attention in plain PyTorch (the reference)."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    model = TimmViT(**{k: v for k, v in cfg.items() if k != "patch_embed"})  # fastzoo's choice of projection, same function
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


def timm_as_users_run_it(model: nn.Module) -> nn.Module:
    """timm's default attention: fused (``F.scaled_dot_product_attention``)."""
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
    return model


def _variant(name: str, timm: str, embed_dim: int, depth: int, num_heads: int, what: str) -> Variant:
    return Variant(name, dict(img_size=224, patch_size=16, embed_dim=embed_dim, depth=depth, num_heads=num_heads),
                   f"{what} at 224x224, as timm's {timm}", f"timm {timm}", timm=timm)


def flops(cfg, *, batch: int, img_size: int | None = None, train: bool = True) -> int:
    """Matmul FLOPs of one step on ``batch`` images (2 per multiply-add; a backward is twice a forward);
    the images' side is the config's (``img_size``, when given, must equal it)."""
    side = (cfg.img_size,) * 2 if isinstance(cfg.img_size, int) else tuple(cfg.img_size)
    patches = (side[0] // cfg.patch_size) * (side[1] // cfg.patch_size)
    S, D = patches + int(cfg.class_token) + cfg.reg_tokens, cfg.embed_dim
    hidden = int(D * cfg.mlp_ratio)
    per_block = 2 * S * D * (3 * D + D + 2 * hidden) + 2 * 2 * S * S * D  # projections and MLP; q k^T and p v
    forward = batch * (cfg.depth * per_block + 2 * patches * cfg.in_chans * cfg.patch_size**2 * D
                       + 2 * D * cfg.num_classes)
    return forward * (3 if train else 1)


SPEC = ModelSpec(
    family="vit",
    task="image-classification",
    model=VisionTransformer,
    variants=(
        _variant("vit_s16", "vit_small_patch16_224", 384, 12, 6, "ViT-S/16"),
        _variant("vit_b16", "vit_base_patch16_224", 768, 12, 12, "ViT-B/16"),
        _variant("vit_l16", "vit_large_patch16_224", 1024, 24, 16, "ViT-L/16"),
    ),
    converters=(VIT,),
    tiny=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10),
    original=Original(timm_vit, "timm VisionTransformer (eager attention)", "attn_drop_rate"),
    shallow=lambda cfg: {**cfg, "depth": 1, "img_size": 2 * cfg.get("patch_size", 16)},  # 4 patches
    flops=flops,
    bench=BenchSettings(
        variant="vit_s16", library="timm", peer=timm_as_users_run_it, peer_attention="sdpa",
        sizes={"bench": Workload("", batch=8),
               "tour": Workload("ViT-S/16 224, 4 of 12 layers", dict(depth=4), batch=4),
               "quick": Workload("tiny ViT", dict(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4,
                                                  num_classes=10), batch=4)}),
)
SPECS = (SPEC,)
