"""RF-DETR's decoder, LW-DETR's (Chen et al. 2024, "LW-DETR: A Transformer Replacement to YOLO for Real-Time
Detection"), as transformers' ``RfDetrDecoder`` computes it, under its module names: post-norm layers of
self-attention over the queries (DETR's, fastzoo's backends; in training each Group-DETR group of queries
attends only within itself), multi-scale deformable cross-attention around each query's box (Deformable
DETR's module, ``fastzoo.attention.deformable``'s seam) and an MLP with its residual inside. The queries'
position embedding is an MLP of the sine embedding of their boxes, computed once: the boxes stay fixed
through the layers (no per-layer refinement); each layer's output goes through the shared ``layernorm``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from fastzoo.attention.base import AttnContext
from fastzoo.models.deformable_detr.layers import DeformableDetrMultiscaleDeformableAttention, Levels
from fastzoo.models.detr.transformer import DetrAttention
from fastzoo.models.rf_detr.backbone import ACT
from fastzoo.models.rf_detr.config import RfDetrConfig
from fastzoo.models.rt_detr.decoder import RTDetrMLPPredictionHead


def box_sine_embedding(boxes_BQ4: torch.Tensor, num_pos_feats: int, temperature: int = 10000) -> torch.Tensor:
    """transformers' ``encode_sinusoidal_position_embedding``: each coordinate as ``num_pos_feats``
    interleaved sin / cos features, the coordinates' embeddings concatenated as (y, x, w, h)."""
    dim_t = torch.arange(num_pos_feats, dtype=torch.float32, device=boxes_BQ4.device)
    dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / num_pos_feats)
    emb = [c[..., None] * (2 * math.pi) / dim_t for c in boxes_BQ4.unbind(-1)]
    emb = [torch.stack((e[..., 0::2].sin(), e[..., 1::2].cos()), dim=-1).flatten(-2) for e in emb]
    emb[0], emb[1] = emb[1], emb[0]
    return torch.cat(emb, dim=-1).to(boxes_BQ4.dtype)


class RfDetrMLP(nn.Module):
    """fc1, activation, fc2 (dropout after each), the residual added here (transformers' ``RfDetrMLP``)."""

    def __init__(self, cfg: RfDetrConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, cfg.d_model)
        self.act, self.dropout = ACT[cfg.decoder_activation_function](), cfg.dropout

    def forward(self, x):
        y = F.dropout(self.act(self.fc1(x)), self.dropout, self.training)
        return x + F.dropout(self.fc2(y), self.dropout, self.training)


class RfDetrSelfAttention(DetrAttention):
    """DETR's self-attention (position embedding on queries and keys); with ``groups`` > 1 the queries are
    that many groups, each attending within itself (the groups as more sequences of the batch)."""

    def forward(self, x_BQD, pos_BQD, ctx, groups: int = 1):
        if groups == 1:
            return super().forward(x_BQD, pos_BQD, ctx)
        B, Q, D = x_BQD.shape

        def split(t):  # [B, G * q, D] -> [G * B, q, D], transformers' order
            return t.view(B, groups, Q // groups, D).transpose(0, 1).reshape(groups * B, Q // groups, D)

        out = super().forward(split(x_BQD), split(pos_BQD), ctx)
        return out.view(groups, B, Q // groups, D).transpose(0, 1).reshape(B, Q, D)


class RfDetrDecoderLayer(GradientCheckpointingLayer):
    """A ``GradientCheckpointingLayer`` as transformers' (``models/detr/transformer.py`` says how): every tensor
    it differentiates through is a positional argument."""

    def __init__(self, cfg: RfDetrConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = RfDetrSelfAttention(d, cfg.decoder_self_attention_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.cross_attn = DeformableDetrMultiscaleDeformableAttention(cfg, cfg.decoder_cross_attention_heads,
                                                                      cfg.decoder_n_points)
        self.cross_attn_layer_norm = nn.LayerNorm(d)
        self.mlp = RfDetrMLP(cfg)
        self.layer_norm = nn.LayerNorm(d)
        self.dropout = cfg.dropout

    def forward(self, x_BQD, pos_BQD, ref_BQ14, levels: Levels, mem_BSD, mask_BS, groups: int):
        a = self.self_attn(x_BQD, pos_BQD, AttnContext(), groups)
        x_BQD = self.self_attn_layer_norm(x_BQD + F.dropout(a, self.dropout, self.training))
        a = self.cross_attn(x_BQD + pos_BQD, mem_BSD, mask_BS, ref_BQ14, levels)
        x_BQD = self.cross_attn_layer_norm(x_BQD + F.dropout(a, self.dropout, self.training))
        return self.layer_norm(self.mlp(x_BQD))


class RfDetrDecoder(nn.Module):
    def __init__(self, cfg: RfDetrConfig):
        super().__init__()
        self.d_model = cfg.d_model
        self.layers = nn.ModuleList(RfDetrDecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layernorm = nn.LayerNorm(cfg.d_model)
        self.ref_point_head = RTDetrMLPPredictionHead(2 * cfg.d_model, cfg.d_model, cfg.d_model, num_layers=2)

    def forward(self, x_BQD, boxes_BQ4, valid_B12, levels: Levels, mem_BSD, mask_BS, groups: int) -> torch.Tensor:
        """Every layer's output after ``layernorm``: ``[L, B, Q, D]``. ``boxes_BQ4``: the queries' boxes (cx, cy,
        w, h), scaled by the valid ratios ``valid_B12`` (width, height) for sampling."""
        ref_BQ14 = boxes_BQ4[:, :, None] * torch.cat([valid_B12, valid_B12], -1)[:, None]
        pos_BQD = self.ref_point_head(box_sine_embedding(ref_BQ14[:, :, 0], self.d_model // 2))
        out = []
        for layer in self.layers:
            x_BQD = layer(x_BQD, pos_BQD, ref_BQ14, levels, mem_BSD, mask_BS, groups)
            out.append(self.layernorm(x_BQD))
        return torch.stack(out)
