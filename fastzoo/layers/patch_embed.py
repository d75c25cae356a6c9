"""Image to patch tokens (ViT, Dosovitskiy et al. 2021), as a Conv2d or as reshape + Linear.

Both forms keep timm's parameter ``proj.weight`` of shape [D, C, p, p], so a checkpoint
loads into either. The ``linear`` form avoids convolutions, which are slow on some
compilers (XLA / Neuron); it computes the same function (up to float summation order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbed(nn.Module):
    def __init__(
        self, img_size: tuple[int, int], patch_size: int, in_chans: int, embed_dim: int, kind: str = "conv", bias: bool = True
    ):
        super().__init__()
        if kind not in ("conv", "linear"):
            raise ValueError(f"patch_embed={kind!r}: choose 'conv' or 'linear'")
        if img_size[0] % patch_size or img_size[1] % patch_size:
            raise ValueError(f"img_size={img_size} is not divisible by patch_size={patch_size}")
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = (img_size[0] // patch_size, img_size[1] // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.kind = kind
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        # the image size is the model's to check, outside traced graphs (fastzoo.models.timm_api.check_images)
        if self.kind == "conv":
            return self.proj(x_BCHW).flatten(2).transpose(1, 2)  # x_BND
        B, C, p = x_BCHW.shape[0], self.proj.in_channels, self.patch_size
        gh, gw = self.grid_size
        # [B, C, gh, p, gw, p] -> [B, gh, gw, C, p, p]: each patch flattened in the conv weight's (C, p, p) order
        patches_BNP = x_BCHW.reshape(B, C, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(B, gh * gw, C * p * p)
        return F.linear(patches_BNP, self.proj.weight.reshape(self.proj.out_channels, -1), self.proj.bias)
