"""DETR's transformer layers, as transformers' ``modeling_detr`` computes them: attention with the
position embeddings added to the queries' and keys' inputs (never the values'), the MLP, and the
post-norm encoder and decoder layers, under its module names.

The layers are transformers' ``GradientCheckpointingLayer`` s (the class its tools and tests look
for): ``gradient_checkpointing`` on and the model's ``torch.utils.checkpoint`` call in
``_gradient_checkpointing_func`` make a layer recompute its activations in the backward
(``DetrForObjectDetection.gradient_checkpointing_enable``). Every tensor a layer differentiates
through is a positional argument, so the reentrant variant (which sees only those) gives the same
gradients. This module is imported when a DETR is built, as transformers is then.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from fastzoo.attention.base import AttnContext
from fastzoo.layers.attention import UsesAttention

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class DetrAttention(UsesAttention):
    """transformers' ``DetrSelfAttention`` / ``DetrCrossAttention``: position embeddings are added to
    the queries' and the keys' inputs, never to the values'."""

    scale_scores = True  # transformers' eager attention scales q k^T

    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.attn_dropout = nn.Dropout(dropout)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.q_proj = nn.Linear(d_model, d_model)
        self.o_proj = nn.Linear(d_model, d_model)

    def forward(self, x_BSD, pos_BSD, ctx: AttnContext, kv_BKD=None, kpos_BKD=None):
        q_in = x_BSD if pos_BSD is None else x_BSD + pos_BSD
        if kv_BKD is None:  # self-attention
            kv_BKD, k_in = x_BSD, q_in
        else:
            k_in = kv_BKD if kpos_BKD is None else kv_BKD + kpos_BKD
        B, S, D = x_BSD.shape
        q_BHSD = self.q_proj(q_in).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k_BHKD = self.k_proj(k_in).view(*kv_BKD.shape[:2], self.heads, self.head_dim).transpose(1, 2)
        v_BHKD = self.v_proj(kv_BKD).view(*kv_BKD.shape[:2], self.heads, self.head_dim).transpose(1, 2)
        o_BHSD = self.attend(q_BHSD, k_BHKD, v_BHKD, ctx)
        return self.o_proj(o_BHSD.transpose(1, 2).reshape(B, S, D))


class DetrMLP(nn.Module):
    def __init__(self, cfg: DetrConfig, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, cfg.d_model)
        self.act, self.activation_dropout, self.dropout = ACTIVATIONS[cfg.activation_function], cfg.activation_dropout, cfg.dropout

    def forward(self, x):
        x = F.dropout(self.act(self.fc1(x)), self.activation_dropout, self.training)
        return F.dropout(self.fc2(x), self.dropout, self.training)


class DetrEncoderLayer(GradientCheckpointingLayer):
    def __init__(self, cfg: DetrConfig):
        super().__init__()
        self.self_attn = DetrAttention(cfg.d_model, cfg.encoder_attention_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = DetrMLP(cfg, cfg.encoder_ffn_dim)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x_BSD, pos_BSD, ctx):
        x_BSD = self.self_attn_layer_norm(x_BSD + F.dropout(self.self_attn(x_BSD, pos_BSD, ctx), self.dropout, self.training))
        x_BSD = self.final_layer_norm(x_BSD + self.mlp(x_BSD))
        if self.training:  # transformers clamps non-finite values (after a host read): the same, without it
            big = torch.finfo(x_BSD.dtype).max - 1000
            x_BSD = x_BSD.clamp(-big, big)
        return x_BSD


class DetrDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, cfg: DetrConfig):
        super().__init__()
        self.self_attn = DetrAttention(cfg.d_model, cfg.decoder_attention_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.encoder_attn = DetrAttention(cfg.d_model, cfg.decoder_attention_heads, cfg.attention_dropout)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = DetrMLP(cfg, cfg.decoder_ffn_dim)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x_BQD, query_pos_BQD, mem, mem_pos, self_ctx, cross_ctx):
        """``mem``, ``mem_pos``: the encoder's output and its position embedding, ``[B, S, D]`` each, or
        packed ``[1, T, D]`` with ``cross_ctx`` carrying the offsets (then the queries go in packed too)."""
        x_BQD = self.self_attn_layer_norm(x_BQD + F.dropout(self.self_attn(x_BQD, query_pos_BQD, self_ctx),
                                                            self.dropout, self.training))
        B, Q, D = x_BQD.shape
        packed = mem.shape[0] != B or cross_ctx.cu_seqlens is not None
        x_in, pos_in = (x_BQD.reshape(1, B * Q, D), query_pos_BQD.reshape(1, B * Q, D)) if packed else (x_BQD, query_pos_BQD)
        cross = self.encoder_attn(x_in, pos_in, cross_ctx, mem, mem_pos).view(B, Q, D)
        x_BQD = self.encoder_attn_layer_norm(x_BQD + F.dropout(cross, self.dropout, self.training))
        return self.final_layer_norm(x_BQD + self.mlp(x_BQD))
