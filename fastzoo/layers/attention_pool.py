"""Attention pooling with a learned query (multihead attention pooling, "MAP"; Zhai et al. 2022,
SigLIP's vision head): one latent token attends to every image token, then a residual MLP.
Named as timm's ``AttentionPoolLatent`` (``latent``, ``q``, ``kv``, ``proj``, ``norm``, ``mlp``);
its inner product runs through the model's attention backend like every other layer's."""
from __future__ import annotations

import torch
from torch import nn

from fastzoo.attention.base import AttnContext
from fastzoo.layers.attention import UsesAttention
from fastzoo.layers.mlp import Mlp


class AttentionPoolLatent(UsesAttention):
    attn_dropout_field = "attn_drop_rate"

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act_layer, norm_eps: float):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, mlp_hidden, act_layer=act_layer)
        nn.init.trunc_normal_(self.latent, std=dim**-0.5)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        H, Dh = self.num_heads, self.head_dim
        q_BHQD = self.q(self.latent).expand(B, -1, -1).reshape(B, 1, H, Dh).transpose(1, 2)
        kv_2BHSD = self.kv(x_BSD).reshape(B, S, 2, H, Dh).permute(2, 0, 3, 1, 4)
        o_BHQD = self.attend(q_BHQD, kv_2BHSD[0], kv_2BHSD[1], AttnContext())  # one query: no grid, no packing
        x_BQD = self.proj(o_BHQD.transpose(1, 2).reshape(B, 1, D))
        x_BQD = x_BQD + self.mlp(self.norm(x_BQD))
        return x_BQD[:, 0]
