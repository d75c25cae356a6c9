"""RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``, no centring, no bias.

Computed in fp32 and cast back before the weight is applied, as Llama's reference code and
transformers' ``LlamaRMSNorm`` do (so a bf16 model matches them to the bit pattern of that
order, not only in fp32)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
