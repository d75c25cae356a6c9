"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Follows timm's ``VisionTransformer`` module for module, with timm's parameter names
(``patch_embed.proj``, ``blocks.N.attn.qkv``, ``blocks.N.mlp.fc1``, ``norm``, ``fc_norm``,
``head``), so a timm checkpoint loads key for key. Options cover what real timm
checkpoints use: class token or not, register tokens, token/avg pooling, pre-norm (CLIP),
LayerScale (DeiT-3, DINOv2), position embedding with or without the prefix tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fastzoo.attention.base import AttnContext
from fastzoo.layers import Attention, DropPath, LayerScale, Mlp, PatchEmbed
from fastzoo.models.base import FastzooModel, ModelConfig


@dataclass
class ViTConfig(ModelConfig):
    img_size: int | tuple[int, int] = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    global_pool: str = "token"  # "token" | "avg"
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    class_token: bool = True
    reg_tokens: int = 0
    no_embed_class: bool = False  # position embedding covers patch tokens only (DeiT-3)
    pre_norm: bool = False  # LayerNorm before the blocks (CLIP)
    init_values: float | None = None  # LayerScale init; None = no LayerScale
    norm_eps: float = 1e-6
    patch_embed: str = "conv"  # "conv" | "linear"
    drop_rate: float = 0.0
    pos_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    drop_path_rate: float = 0.0

    def __post_init__(self):
        if isinstance(self.img_size, int):
            self.img_size = (self.img_size, self.img_size)
        self.img_size = tuple(self.img_size)
        if self.global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool={self.global_pool!r}: choose 'token' or 'avg'")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without a class token")


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: ViTConfig, drop_path: float):
        super().__init__()
        dim = cfg.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=cfg.norm_eps)
        self.attn = Attention(dim, cfg.num_heads, cfg.qkv_bias, cfg.attn_drop_rate, cfg.proj_drop_rate)
        self.ls1 = LayerScale(dim, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=cfg.norm_eps)
        self.mlp = Mlp(dim, int(dim * cfg.mlp_ratio), drop=cfg.proj_drop_rate)
        self.ls2 = LayerScale(dim, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x_BSD, ctx: AttnContext):
        x_BSD = x_BSD + self.drop_path1(self.ls1(self.attn(self.norm1(x_BSD), ctx)))
        return x_BSD + self.drop_path2(self.ls2(self.mlp(self.norm2(x_BSD))))


class VisionTransformer(FastzooModel):
    family = "vit"
    config_class = ViTConfig

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        D = cfg.embed_dim
        self.num_prefix_tokens = int(cfg.class_token) + cfg.reg_tokens
        # CLIP-style pre-norm models have no patch bias (timm's rule)
        self.patch_embed = PatchEmbed(cfg.img_size, cfg.patch_size, cfg.in_chans, D, cfg.patch_embed, bias=not cfg.pre_norm)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, D)) if cfg.reg_tokens else None
        pos_len = self.patch_embed.num_patches + (0 if cfg.no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.randn(1, pos_len, D) * 0.02)
        self.pos_drop = nn.Dropout(cfg.pos_drop_rate)
        self.norm_pre = nn.LayerNorm(D, eps=cfg.norm_eps) if cfg.pre_norm else nn.Identity()
        rates = torch.linspace(0, cfg.drop_path_rate, cfg.depth).tolist()
        self.blocks = nn.ModuleList([Block(cfg, r) for r in rates])
        use_fc_norm = cfg.global_pool == "avg"  # timm: avg pooling normalises after pooling
        self.norm = nn.LayerNorm(D, eps=cfg.norm_eps) if not use_fc_norm else nn.Identity()
        self.fc_norm = nn.LayerNorm(D, eps=cfg.norm_eps) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(D, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)

    def attention_needs(self) -> dict:
        return {"head_dim": self.config.embed_dim // self.config.num_heads, "causal": False}

    def _pos_embed(self, x_BND):
        B = x_BND.shape[0]
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.reg_token) if t is not None]
        if self.config.no_embed_class:
            return torch.cat(prefix + [x_BND + self.pos_embed], dim=1)
        return torch.cat(prefix + [x_BND], dim=1) + self.pos_embed

    def forward_features(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        if images_BCHW.ndim != 4:
            raise ValueError(f"images must be [B, C, H, W], got shape {tuple(images_BCHW.shape)}")
        x_BSD = self.pos_drop(self._pos_embed(self.patch_embed(images_BCHW)))
        x_BSD = self.norm_pre(x_BSD)
        ctx = AttnContext(grid_size=self.patch_embed.grid_size, num_prefix_tokens=self.num_prefix_tokens)
        for block in self.blocks:
            x_BSD = block(x_BSD, ctx)
        return self.norm(x_BSD)

    def forward_head(self, x_BSD: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.config.global_pool == "token":
            x_BD = x_BSD[:, 0]
        else:
            x_BD = x_BSD[:, self.num_prefix_tokens :].mean(dim=1)
        x_BD = self.head_drop(self.fc_norm(x_BD))
        return x_BD if pre_logits else self.head(x_BD)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images_BCHW))

    def adapt_checkpoint(self, state, changed):
        fresh, notes = [], []
        if "num_classes" in changed:
            old = state.pop("head.weight", None)
            state.pop("head.bias", None)
            fresh = [k for k in self.state_dict() if k.startswith("head.")]
            had = old.shape[0] if old is not None else 0
            notes.append(f"num_classes={self.config.num_classes}: fresh classifier head (the checkpoint has {had} classes)")
        if "img_size" in changed and "pos_embed" in state and state["pos_embed"].shape != self.pos_embed.shape:
            prefix = 0 if self.config.no_embed_class else self.num_prefix_tokens
            state["pos_embed"] = resample_pos_embed(state["pos_embed"], self.patch_embed.grid_size, prefix)
            notes.append(f"img_size={self.config.img_size}: position embedding resampled (bicubic) to {self.patch_embed.grid_size}")
        return state, fresh, notes

    def reset_classifier(self, num_classes: int) -> None:
        """A fresh head for ``num_classes`` (fine-tuning)."""
        self.config.num_classes = num_classes
        D = self.config.embed_dim
        self.head = nn.Linear(D, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)


def resample_pos_embed(pos_embed: torch.Tensor, new_grid: tuple[int, int], num_prefix: int) -> torch.Tensor:
    """Bicubic resize of the patch part of a [1, prefix + N, D] position embedding (timm's rule)."""
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    n = grid.shape[1]
    old = int(math.isqrt(n))
    if old * old != n:
        raise ValueError(f"position embedding of {n} patch tokens is not a square grid")
    D = grid.shape[-1]
    grid_1DHW = grid.reshape(1, old, old, D).permute(0, 3, 1, 2).float()
    grid_1DHW = nn.functional.interpolate(grid_1DHW, size=new_grid, mode="bicubic", antialias=True, align_corners=False)
    grid = grid_1DHW.permute(0, 2, 3, 1).reshape(1, -1, D).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)
