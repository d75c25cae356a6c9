"""The ViT family as the rest of fastzoo reads it: variants, converters, tiny config, the original.

The variants are timm's names for the ``VisionTransformer`` architectures fastzoo reproduces,
derived from timm's registry (:mod:`fastzoo.models.vit.timm_names`); the timm names it does
not reproduce are refused with the timm options they would need."""
from __future__ import annotations

from functools import partial

from torch import nn

from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload
from fastzoo.models.vit import hf, hf_names, timm_names
from fastzoo.models.vit.config import ViTConfig
from fastzoo.models.vit.convert import VIT
from fastzoo.models.vit.model import VisionTransformer
from fastzoo.tasks import IMAGE_CLASSIFICATION


def timm_vit(cfg: dict) -> nn.Module:
    """timm's VisionTransformer on fastzoo config fields, attention in plain PyTorch (the reference);
    for a config from transformers (``hf_config``), its transformers class with eager attention."""
    if cfg.get("hf_config") is not None:
        return hf.build(ViTConfig.from_dict(dict(cfg)))
    from timm.layers import LayerNorm
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    kwargs = {k: v for k, v in cfg.items() if k not in ("patch_embed", "norm_eps", "hf_config")}  # patch_embed: fastzoo's choice
    if "norm_eps" in cfg:  # timm takes the epsilon inside its norm layer
        kwargs["norm_layer"] = partial(LayerNorm, eps=cfg["norm_eps"])
    model = TimmViT(**kwargs)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


class _FusedMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` on torch's fused path (no attention weights asked for: it calls
    ``F.scaled_dot_product_attention``)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **{**kwargs, "need_weights": False})


def as_users_run_it(model: nn.Module) -> nn.Module:
    """The attention the original's users get by default: timm's fused one, transformers' SDPA (a
    transformers original, built from an ``hf_config``, is built on its eager reference kernels).
    SigLIP's attention-pooling head (transformers' ``nn.MultiheadAttention``, which no attention
    implementation reaches) runs on torch's fused attention too, as timm's SigLIP (``AttentionPoolLatent``)
    runs the same head for its users: with 4 heads of width 1 its query's bf16 gradient is rounding noise
    on either path (tests/test_fuzz_found_rule.py), which the weights path's error alone does not bound."""
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
        if type(m) is nn.MultiheadAttention:
            m.__class__ = _FusedMultiheadAttention
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    return model

SHORT = {"vit_small_patch16_224": "vit_s16", "vit_base_patch16_224": "vit_b16", "vit_large_patch16_224": "vit_l16"}


def _describe(name: str, cfg: ViTConfig) -> str:
    """One line from the config: sizes, then what sets it apart from the original ViT."""
    side = cfg.img_size[0] if cfg.img_size[0] == cfg.img_size[1] else "x".join(map(str, cfg.img_size))
    traits = [t for t, on in (("pre-norm", cfg.pre_norm), ("QuickGELU", cfg.act_layer == "quick_gelu"),
                              (f"{cfg.reg_tokens} registers", cfg.reg_tokens), ("LayerScale", cfg.init_values is not None),
                              ("no class token", not cfg.class_token), (f"{cfg.global_pool or 'no'} pooling", cfg.global_pool != "token"),
                              ("no head", not cfg.num_classes)) if on]
    return (f"ViT D={cfg.embed_dim} x {cfg.depth} blocks, {cfg.num_heads} heads, patch {cfg.patch_size}, {side} px"
            f"{'; ' + ', '.join(traits) if traits else ''}: timm's {name}")


def _timm_variant(name: str, derived: dict) -> Variant:
    config = derived["config"]
    return Variant(name, config, _describe(name, ViTConfig.from_dict(dict(config))), f"timm {name}",
                   aliases=(SHORT[name],) if name in SHORT else (), timm=name)


_TIMM = timm_names.load()


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
    task=IMAGE_CLASSIFICATION,
    model=VisionTransformer,
    variants=tuple(_timm_variant(name, derived) for name, derived in _TIMM["variants"].items()) + hf_names.variants(),
    refused={name: "; ".join(reasons) for name, reasons in _TIMM["refused"].items()},
    why_not=timm_names.why_not,
    converters=(VIT, hf.HF_VIT),
    tiny=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10),
    original=Original(timm_vit, "timm VisionTransformer (eager attention)", "attn_drop_rate", users=as_users_run_it),
    shallow=lambda cfg: {**cfg, "depth": 1, "img_size": 2 * cfg.get("patch_size", 16)},  # 4 patches
    flops=flops,
    bench=BenchSettings(
        variant="vit_small_patch16_224", library="timm", peer_attention="sdpa",
        sizes={"bench": Workload("", batch=8),
               "tour": Workload("ViT-S/16 224, 4 of 12 layers", dict(depth=4), batch=8),
               "quick": Workload("tiny ViT", dict(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4,
                                                  num_classes=10), batch=4)}),
)
SPECS = (SPEC,)
