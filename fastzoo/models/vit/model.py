"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

Follows timm's ``VisionTransformer`` module for module, with timm's parameter names
(``patch_embed.proj``, ``blocks.N.attn.qkv``, ``blocks.N.mlp.fc1``, ``norm``, ``fc_norm``,
``head``), so a timm checkpoint loads key for key. Options cover what real timm
checkpoints use: class token or not, register tokens, token/avg pooling with the final
LayerNorm before or after pooling (timm's ``fc_norm``), pre-norm and QuickGELU (CLIP),
LayerScale (DeiT-3, DINOv2), position embedding with or without the prefix tokens; and what
transformers' vision checkpoints add (``hf.py`` converts them): DeiT's distillation token and
second head (timm's ``dist_token``, ``head_dist``), DINOv2's mask token, packed SwiGLU MLP and
classifier on the class and mean patch token, SigLIP's attention-pooling head (timm's
``attn_pool``), ViTModel's pooler. Called with transformers' keywords (``pixel_values=``,
``labels=``) it answers with transformers' output classes (:mod:`fastzoo.models.hf_outputs`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fastzoo.attention.base import AttnContext
from fastzoo.layers import ACTIVATIONS, Attention, AttentionPoolLatent, DropPath, LayerScale, Mlp, PackedGluMlp, PatchEmbed
from fastzoo.models import hf_outputs
from fastzoo.models.base import FastzooModel
from fastzoo.models.vit.config import ViTConfig
from fastzoo.models.timm_api import TimmModelAPI, check_images, take_indices

torch.fx.wrap("check_images")  # symbolic tracing records the input check as one call (see timm_api)


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
        hidden = int(dim * cfg.mlp_ratio)
        if cfg.mlp_layer == "swiglu_packed":
            self.mlp = PackedGluMlp(dim, hidden, drop=cfg.proj_drop_rate)
        else:
            self.mlp = Mlp(dim, hidden, act_layer=ACTIVATIONS[cfg.act_layer], drop=cfg.proj_drop_rate)
        self.ls2 = LayerScale(dim, cfg.init_values) if cfg.init_values is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x_BSD, ctx: AttnContext):
        x_BSD = x_BSD + self.drop_path1(self.ls1(self.attn(self.norm1(x_BSD), ctx)))
        return x_BSD + self.drop_path2(self.ls2(self.mlp(self.norm2(x_BSD))))


class VisionTransformer(hf_outputs.TransformersCall, TimmModelAPI, FastzooModel):
    family = "vit"
    config_class = ViTConfig
    timm_architecture = "vit_base_patch16_224"
    timm_feature_cls = "getter"  # timm's features_only for ViT: forward_intermediates
    default_out_indices = 3  # timm's: the last three blocks

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        D = cfg.embed_dim
        self.num_prefix_tokens = cfg.num_prefix_tokens
        # CLIP-style pre-norm models have no patch bias (timm's rule)
        self.patch_embed = PatchEmbed(cfg.img_size, cfg.patch_size, cfg.in_chans, D, cfg.patch_embed, bias=not cfg.pre_norm)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.dist_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, cfg.reg_tokens, D)) if cfg.reg_tokens else None
        self.mask_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.mask_token else None
        pos_len = self.patch_embed.num_patches + (0 if cfg.no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.randn(1, pos_len, D) * 0.02)
        self.pos_drop = nn.Dropout(cfg.pos_drop_rate)
        self.norm_pre = nn.LayerNorm(D, eps=cfg.norm_eps) if cfg.pre_norm else nn.Identity()
        rates = torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu").tolist()  # cpu: also under torch.device("meta")
        self.blocks = nn.ModuleList([Block(cfg, r) for r in rates])
        reduction = cfg.patch_size  # timm's feature_info: one entry per block
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=D, reduction=reduction) for i in range(cfg.depth)]
        self.norm = nn.LayerNorm(D, eps=cfg.norm_eps) if not cfg.use_fc_norm else nn.Identity()
        self.fc_norm = nn.LayerNorm(D, eps=cfg.norm_eps) if cfg.use_fc_norm else nn.Identity()
        if cfg.global_pool == "map":
            self.attn_pool = AttentionPoolLatent(D, cfg.num_heads, int(D * cfg.mlp_ratio), ACTIVATIONS[cfg.act_layer],
                                                 cfg.norm_eps)
        self.pooler = nn.Linear(D, D) if cfg.pooler else None
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(cfg.head_in_features, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self.head_dist = nn.Linear(D, cfg.num_classes) if cfg.distilled_head else None
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for t in (self.dist_token, self.reg_token):
            if t is not None:
                nn.init.normal_(t, std=1e-6)

    def attention_needs(self) -> dict:
        return {"head_dim": self.config.embed_dim // self.config.num_heads, "causal": False, "grid_2d": True}

    def _pos_embed(self, x_BND):
        B = x_BND.shape[0]
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if self.config.no_embed_class:
            return torch.cat(prefix + [x_BND + self.pos_embed], dim=1)
        return torch.cat(prefix + [x_BND], dim=1) + self.pos_embed

    def _embed(self, images_BCHW: torch.Tensor, bool_masked_pos=None) -> tuple[torch.Tensor, AttnContext]:
        """Patch tokens (those ``bool_masked_pos`` [B, N] marks replaced by the mask token) with prefix
        tokens and position embedding, and the forward's attention context."""
        images_BCHW = check_images(images_BCHW, self.config.in_chans, self.patch_embed.img_size, self.pos_embed)
        x_BND = self.patch_embed(images_BCHW)
        if bool_masked_pos is not None:
            x_BND = torch.where(bool_masked_pos.unsqueeze(-1), self.mask_token.to(x_BND.dtype), x_BND)
        x_BSD = self.norm_pre(self.pos_drop(self._pos_embed(x_BND)))
        return x_BSD, AttnContext(grid_size=self.patch_embed.grid_size, num_prefix_tokens=self.num_prefix_tokens)

    def forward_features(self, images_BCHW: torch.Tensor, bool_masked_pos=None) -> torch.Tensor:
        return self.norm(self.forward_blocks(images_BCHW, bool_masked_pos)[-1])

    def forward_blocks(self, images_BCHW: torch.Tensor, bool_masked_pos=None) -> list[torch.Tensor]:
        """The embedded tokens and each block's output, before the final norm (transformers' hidden_states)."""
        x_BSD, ctx = self._embed(images_BCHW, bool_masked_pos)
        out = [x_BSD]
        for block in self.blocks:
            out.append(self._run_block(block, out[-1], ctx))
        return out

    def forward_intermediates(
        self,
        images_BCHW: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ):
        """timm's ``forward_intermediates``: the outputs of blocks ``indices`` (None: all, an int:
        the last n, a list: those; negative from the end), prefix tokens split off, as
        ``[B, D, gh, gw]`` (``"NCHW"``) or ``[B, N, D]`` (``"NLC"``); ``norm`` applies the final
        norm to each. Returns ``(final features, intermediates)``, or only the intermediates;
        with ``return_prefix_tokens`` each intermediate is a ``(patch tokens, prefix tokens)`` pair."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt={output_fmt!r}: choose 'NCHW' or 'NLC'")
        taken, last = take_indices(len(self.blocks), indices)
        x_BSD, ctx = self._embed(images_BCHW)
        blocks = self.blocks[: last + 1] if stop_early else self.blocks
        out = []
        for i, block in enumerate(blocks):
            x_BSD = self._run_block(block, x_BSD, ctx)
            if i in taken:
                out.append(self.norm(x_BSD) if norm else x_BSD)
        P = self.num_prefix_tokens
        prefix = [y[:, :P] for y in out]
        out = [y[:, P:] for y in out]
        if output_fmt == "NCHW":
            gh, gw = self.patch_embed.grid_size
            out = [y.reshape(y.shape[0], gh, gw, -1).permute(0, 3, 1, 2).contiguous() for y in out]
        if return_prefix_tokens and P:
            out = list(zip(out, prefix))
        return out if intermediates_only else (self.norm(x_BSD), out)

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """timm's: drop the blocks after the last of ``indices`` (as :meth:`forward_intermediates`
        reads them), the final norm if ``prune_norm``, the pooling, ``fc_norm`` and head if
        ``prune_head``. Returns the kept indices. ``config.depth`` follows the blocks."""
        taken, last = take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: last + 1]
        self.config.depth = len(self.blocks)
        self.feature_info = self.feature_info[: last + 1]  # it names blocks: only those that are left
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.fc_norm = nn.Identity()
            self.reset_classifier(0, "")
        return taken

    def get_intermediate_layers(self, images_BCHW, n=1, reshape: bool = False, return_prefix_tokens: bool = False,
                                norm: bool = False):
        """DINO's name for :meth:`forward_intermediates` (timm keeps it): the last ``n`` blocks' tokens."""
        return self.forward_intermediates(images_BCHW, n, return_prefix_tokens=return_prefix_tokens, norm=norm,
                                          output_fmt="NCHW" if reshape else "NLC", intermediates_only=True)

    def forward_head(self, x_BSD: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        pool = self.config.global_pool
        if pool == "token":
            x = x_BSD[:, 0]
        elif pool == "avg":
            x = x_BSD[:, self.num_prefix_tokens :].mean(dim=1)
        elif pool == "map":
            x = self.attn_pool(x_BSD)
        elif pool == "token_avg":
            x = torch.cat([x_BSD[:, 0], x_BSD[:, self.num_prefix_tokens :].mean(dim=1)], dim=-1)
        else:  # no pooling: every token
            x = x_BSD
        x = self.head_drop(self.fc_norm(x))
        if self.pooler is not None:
            x = torch.tanh(self.pooler(x))
        if self.head_dist is not None:  # DeiT distilled (timm's VisionTransformerDistilled): the mean of both heads
            x_dist = x_BSD[:, 1]
            return (x + x_dist) / 2 if pre_logits else (self.head(x) + self.head_dist(x_dist)) / 2
        return x if pre_logits else self.head(x)

    def no_weight_decay(self) -> set[str]:
        """Parameters timm's optimizer factory keeps out of weight decay (besides biases and norms)."""
        return {"pos_embed", "cls_token", "reg_token", "dist_token"}

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups (layer decay): the embedding, then one group per block, the final norm last."""
        return dict(stem=r"^cls_token|reg_token|pos_embed|patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def get_classifier(self) -> nn.Module:
        return self.head

    def get_input_embeddings(self) -> nn.Module:
        """transformers' name for the patch embedding (what turns pixels into tokens)."""
        return self.patch_embed

    def get_output_embeddings(self) -> None:  # transformers': an image classifier has no tied output embedding
        return None

    def timm_model_args(self) -> dict | None:
        c = self.config
        if c.norm_eps != 1e-6:  # timm's LayerNorm default; another eps cannot be written as JSON
            return None
        if c.dist_token or c.mask_token or c.pooler or c.global_pool == "token_avg" or c.mlp_layer != "mlp":
            return None  # not timm's VisionTransformer
        names = ("patch_size", "in_chans", "num_classes", "global_pool", "embed_dim", "depth", "num_heads", "mlp_ratio",
                 "qkv_bias", "class_token", "reg_tokens", "no_embed_class", "pre_norm", "fc_norm", "init_values",
                 "act_layer", "drop_rate", "pos_drop_rate", "attn_drop_rate", "proj_drop_rate", "drop_path_rate")
        return {"img_size": list(c.img_size), **{n: getattr(c, n) for n in names}}

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """timm's and torchvision's call: ``model(images)`` -> logits (pooled features without a head).
        transformers' call (``model(pixel_values=, labels=, ...)``) -> its output class: :meth:`hf_forward`."""
        return self.forward_head(self.forward_features(images_BCHW))

    def hf_forward(self, pixel_values, labels=None, **kwargs):
        return hf_outputs.vit_forward(self, pixel_values, labels, **kwargs)

    def adapt_checkpoint(self, state, changed):
        fresh, notes = [], []
        if "num_classes" in changed:
            old = state.pop("head.weight", None)
            for k in ("head.bias", "head_dist.weight", "head_dist.bias"):
                state.pop(k, None)
            fresh = [k for k in self.state_dict() if k.startswith(("head.", "head_dist."))]
            had = old.shape[0] if old is not None else 0
            notes.append(f"num_classes={self.config.num_classes}: fresh classifier head (the checkpoint has {had} classes)")
        if "img_size" in changed and "pos_embed" in state and state["pos_embed"].shape != self.pos_embed.shape:
            prefix = 0 if self.config.no_embed_class else self.num_prefix_tokens
            # transformers' interpolate_pos_encoding has no antialias: a model from it resamples as it does
            antialias = self.config.hf_config is None
            state["pos_embed"] = resample_pos_embed(state["pos_embed"], self.patch_embed.grid_size, prefix, antialias)
            notes.append(f"img_size={self.config.img_size}: position embedding resampled (bicubic"
                         f"{'' if antialias else ', as transformers interpolate_pos_encoding'}) to {self.patch_embed.grid_size}")
        return state, fresh, notes

    def hf_pretrained(self) -> tuple[dict, dict]:
        from fastzoo.models.vit import hf, hf_config

        return hf_config.hf_config_dict(self.config), hf.from_fastzoo(self.state_dict(), self.config)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A fresh head for ``num_classes`` (0: none) on the model's device and dtype, and
        optionally another pooling ('token', 'avg', '' for none), as timm's. The final norm
        stays where it is (timm's rule too): the config pins ``fc_norm`` so it says so."""
        if num_classes < 0:
            raise ValueError(f"num_classes={num_classes} must be >= 0 (0: no classifier head)")
        if global_pool is not None:
            pools = ("token", "avg", "", self.config.global_pool)  # a learned pooling ('map') only where it has weights
            if global_pool not in pools:
                raise ValueError(f"global_pool={global_pool!r}: this ViT pools with {', '.join(map(repr, dict.fromkeys(pools)))}")
            if global_pool == "token" and self.cls_token is None:
                raise ValueError("global_pool='token' needs a class token, which this model has not")
            self.config.fc_norm = self.config.use_fc_norm
            self.config.global_pool = global_pool
        self.config.num_classes = num_classes
        if self.head_dist is not None:  # one fresh head: the distilled pair is the checkpoint's, not a new task's
            self.head_dist = None
            self.config.distilled_head = False
        if num_classes == 0:
            self.head = nn.Identity()
            return
        head = nn.Linear(self.config.head_in_features, num_classes)  # initialised in fp32: trunc_normal_ needs it on some devices
        nn.init.trunc_normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
        self.head = head.to(device=self.pos_embed.device, dtype=self.pos_embed.dtype).train(self.training)


def resample_pos_embed(pos_embed: torch.Tensor, new_grid: tuple[int, int], num_prefix: int,
                       antialias: bool = True) -> torch.Tensor:
    """Bicubic resize of the patch part of a [1, prefix + N, D] position embedding, in fp32: timm's rule
    (``antialias=True``) or transformers' ``interpolate_pos_encoding`` (``antialias=False``)."""
    prefix, grid = pos_embed[:, :num_prefix], pos_embed[:, num_prefix:]
    n = grid.shape[1]
    old = int(math.isqrt(n))
    if old * old != n:
        raise ValueError(f"position embedding of {n} patch tokens is not a square grid")
    D = grid.shape[-1]
    grid_1DHW = grid.reshape(1, old, old, D).permute(0, 3, 1, 2).float()
    grid_1DHW = nn.functional.interpolate(grid_1DHW, size=new_grid, mode="bicubic", antialias=antialias, align_corners=False)
    grid = grid_1DHW.permute(0, 2, 3, 1).reshape(1, -1, D).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)
