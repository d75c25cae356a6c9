"""RF-DETR's backbone, as transformers' ``RfDetrConvEncoder`` computes it: a DINOv2 whose blocks attend
within ``num_windows x num_windows`` windows of the patch grid (each window with its own copy of the class
token) except every output block, which attends over the whole image; then the projector, a C2f layer of
RepVGG-style blocks on the output blocks' maps concatenated, to ``d_model`` channels.

The DINOv2 is fastzoo's ViT (:class:`fastzoo.models.vit.model.Block`, :class:`~fastzoo.layers.PatchEmbed`,
timm's parameter names: ``convert.py`` renames transformers' ``embeddings`` / ``encoder.layer.N`` keys as the
ViT family's DINOv2 converter does); the windows are reshapes of the batch, so every block runs the attention
backend the model is set to on an unmasked batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.attention.base import AttnContext
from fastzoo.layers import PatchEmbed
from fastzoo.layers.norm import ChannelsFirstLayerNorm
from fastzoo.models.rf_detr.config import RfDetrConfig
from fastzoo.models.vit.config import ViTConfig
from fastzoo.models.vit.model import Block, resample_pos_embed

ACT = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}


def vit_config(cfg: RfDetrConfig) -> ViTConfig:
    """The backbone's sizes as fastzoo's ViT config (transformers' ``Dinov2Model`` in the ViT family)."""
    return ViTConfig(img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=cfg.num_channels, num_classes=0,
                     embed_dim=cfg.hidden_size, depth=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                     mlp_ratio=float(cfg.mlp_ratio), qkv_bias=cfg.qkv_bias, init_values=cfg.layerscale_value,
                     norm_eps=cfg.backbone_layer_norm_eps, mask_token=cfg.use_mask_token,
                     hf_config={"architectures": ["Dinov2Model"], "model_type": "dinov2"})


def run_block(block: nn.Module, x_BSD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
    """``block(x_BSD, ctx)``, recomputed in the backward where gradient checkpointing switched it on
    (``TransformersDetector.gradient_checkpointing_enable``: what a ``GradientCheckpointingLayer`` does, for
    fastzoo's ViT blocks, as transformers' DINOv2 layers of RF-DETR are such layers)."""
    if block.gradient_checkpointing and block.training:
        return block._gradient_checkpointing_func(block, x_BSD, ctx)
    return block(x_BSD, ctx)


class WindowedDinov2(nn.Module):
    """transformers' ``RfDetrDinov2Backbone``: tokens ``[B * windows, 1 + window patches, D]`` through the
    blocks, the output blocks' patch tokens (final LayerNorm) as ``[B, D, H / patch, W / patch]`` maps."""

    def __init__(self, cfg: RfDetrConfig):
        super().__init__()
        vit = vit_config(cfg)
        D, self.cfg = cfg.hidden_size, cfg
        self.patch_embed = PatchEmbed(vit.img_size, cfg.patch_size, cfg.num_channels, D)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, D)) if cfg.use_mask_token else None
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, D) * 0.02)
        self.blocks = nn.ModuleList(Block(vit, 0.0) for _ in range(cfg.num_hidden_layers))
        for block in self.blocks:  # rounded as transformers' DINOv2: q, k, v projected apart, the scale on q k^T
            block.attn.split_qkv = block.attn.scale_scores = True
            block.gradient_checkpointing = False  # run_block's switch, as a GradientCheckpointingLayer's
        self.norm = nn.LayerNorm(D, eps=cfg.backbone_layer_norm_eps)

    def _pos_embed(self, gh: int, gw: int) -> torch.Tensor:
        """transformers' ``interpolate_pos_encoding``: as learned for a square grid of as many patches, else
        resampled (bicubic, antialiased, in fp32)."""
        if gh * gw == self.pos_embed.shape[1] - 1 and gh == gw:
            return self.pos_embed
        return resample_pos_embed(self.pos_embed, (gh, gw), 1, antialias=True)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        cfg, n = self.cfg, self.cfg.num_windows
        p = cfg.patch_size
        gh, gw = pixel_values.shape[-2] // p, pixel_values.shape[-1] // p
        x_BND = self.patch_embed(pixel_values)
        B, _, D = x_BND.shape
        x_BSD = torch.cat([self.cls_token.expand(B, -1, -1), x_BND], 1) + self._pos_embed(gh, gw)
        if n > 1:  # transformers' window_partition, reshape for reshape (the class token is the same for every image)
            win = x_BSD[:, 1:].reshape(B, n, gw // n, n, gh // n, D).transpose(2, 3).reshape(B * n * n, -1, D)
            x_BSD = torch.cat([x_BSD[:, :1].repeat(n * n, 1, 1), win], 1)
        ctx, windowed, maps = AttnContext(), cfg.window_blocks, []
        for i, block in enumerate(self.blocks):
            if i in windowed:
                x_BSD = run_block(block, x_BSD, ctx)
            else:  # every window of an image in one sequence
                x_BSD = run_block(block, x_BSD.reshape(B, -1, D), ctx).reshape(x_BSD.shape)
            if i + 1 in cfg.backbone_out_indices:
                maps.append(self._feature_map(x_BSD, B, gh, gw))
        return maps

    def _feature_map(self, x_BSD: torch.Tensor, B: int, gh: int, gw: int) -> torch.Tensor:
        """An output block's patch tokens as ``[B, D, gh, gw]`` (transformers' ``window_unpartition``)."""
        n, D = self.cfg.num_windows, x_BSD.shape[-1]
        if self.cfg.apply_layernorm:
            x_BSD = self.norm(x_BSD)
        x = x_BSD[:, 1:]
        if n > 1:
            x = x.reshape(B, n, n, gh // n, gw // n, D).transpose(2, 3)
        return x.reshape(B, gh, gw, D).permute(0, 3, 1, 2).contiguous()


class RfDetrConvNormLayer(nn.Module):
    def __init__(self, cfg: RfDetrConfig, cin: int, cout: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, 1, padding=kernel_size // 2, bias=False)
        self.norm = ChannelsFirstLayerNorm(cout, eps=cfg.layer_norm_eps)
        self.activation = ACT[cfg.activation_function]()

    def forward(self, x):
        return self.activation(self.norm(self.conv(x)))


class RfDetrRepVggBlock(nn.Module):
    def __init__(self, cfg: RfDetrConfig, width: int):
        super().__init__()
        self.conv1 = RfDetrConvNormLayer(cfg, width, width, 3)
        self.conv2 = RfDetrConvNormLayer(cfg, width, width, 3)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class RfDetrC2FLayer(nn.Module):
    """A 1x1 convolution to two halves; the blocks run on the second, each output kept; every part
    concatenated through a last 1x1 convolution."""

    def __init__(self, cfg: RfDetrConfig, cin: int):
        super().__init__()
        self.width = int(cfg.d_model * cfg.hidden_expansion)
        self.conv1 = RfDetrConvNormLayer(cfg, cin, 2 * self.width, 1)
        self.conv2 = RfDetrConvNormLayer(cfg, (2 + cfg.c2f_num_blocks) * self.width, cfg.d_model, 1)
        self.bottlenecks = nn.ModuleList(RfDetrRepVggBlock(cfg, self.width) for _ in range(cfg.c2f_num_blocks))

    def forward(self, x):
        parts = list(self.conv1(x).split(self.width, 1))
        y = parts[-1].contiguous()
        for block in self.bottlenecks:
            y = block(y)
            parts.append(y)
        return self.conv2(torch.cat(parts, 1))


class RfDetrScaleProjector(nn.Module):
    def __init__(self, cfg: RfDetrConfig):
        super().__init__()
        self.projector_layer = RfDetrC2FLayer(cfg, cfg.hidden_size * len(cfg.backbone_out_indices))
        self.layer_norm = ChannelsFirstLayerNorm(cfg.d_model, eps=1e-6)  # transformers' default, not the config's

    def forward(self, maps):
        return self.layer_norm(self.projector_layer(torch.cat(maps, 1)))


class RfDetrConvEncoder(nn.Module):
    """``model.backbone``: the DINOv2 (``backbone``) and the projector; the pixel mask resized (nearest) to
    the projector's map."""

    def __init__(self, cfg: RfDetrConfig):
        super().__init__()
        self.backbone = WindowedDinov2(cfg)
        self.projector = RfDetrScaleProjector(cfg)

    def forward(self, pixel_values, pixel_mask):
        features = self.projector(self.backbone(pixel_values))
        mask = F.interpolate(pixel_mask[None].float(), size=features.shape[-2:]).to(torch.bool)[0]
        return features, mask
