"""Multi-head self-attention whose inner product runs through a swappable backend."""
from __future__ import annotations

import torch
from torch import nn

from fastzoo.attention.base import AttentionBackend, AttnContext


class UsesAttention(nn.Module):
    """A module that calls an attention backend; ``FastzooModel.set_attention`` sets it.

    The backend is a plain attribute, not a submodule: it holds no weights, so switching
    kernels never touches the state dict.
    """

    backend: AttentionBackend | None = None


class Attention(UsesAttention):
    """ViT self-attention, named as timm's (``qkv``, ``proj``) so its weights load key for key."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x_BSC: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, S, C = x_BSC.shape
        qkv_3BHSD = self.qkv(x_BSC).reshape(B, S, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q_BHSD, k_BHSD, v_BHSD = qkv_3BHSD.unbind(0)
        ctx.dropout_p = self.attn_drop if self.training else 0.0
        o_BHSD = self.backend(q_BHSD, k_BHSD, v_BHSD, ctx)
        x_BSC = o_BHSD.transpose(1, 2).reshape(B, S, C)
        return self.proj_drop(self.proj(x_BSC))
