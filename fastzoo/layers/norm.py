"""RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``, no centring, no bias.

Computed in fp32 and cast back, in the order of the checkpoint's reference code, so that a
bf16 model matches it to the bit pattern of that order, not only in fp32:

- Llama (transformers' ``LlamaRMSNorm``): normalised in fp32, cast back, then times the weight;
- ``weight_in_fp32`` (OLMo 2, Gemma): times the weight in fp32, then cast back;
- ``offset=1.0`` (Gemma): scaled by ``1 + weight``, the weight starting at 0.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, offset: float = 0.0, weight_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.eps, self.offset, self.weight_in_fp32 = eps, offset, weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            weight = self.weight.float()
            return (normed * (weight + self.offset if self.offset else weight)).to(x.dtype)
        return (self.weight + self.offset if self.offset else self.weight) * normed.to(x.dtype)

    def extra_repr(self) -> str:
        extra = (f", offset={self.offset}" if self.offset else "") + (", weight in fp32" if self.weight_in_fp32 else "")
        return f"{self.weight.shape[0]}, eps={self.eps}{extra}"


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of ``[B, C, H, W]`` (ConvNeXt's and transformers'
    ``RfDetrLayerNorm(data_format="channels_first")``)."""

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return super().forward(x_BCHW.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
