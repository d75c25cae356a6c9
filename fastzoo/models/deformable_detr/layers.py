"""Deformable DETR's transformer layers, as transformers' ``modeling_deformable_detr`` computes them, under
its module names: the multi-scale deformable attention module (offsets and weights from the query, values
from the encoder's tokens, sampled through ``fastzoo.attention.deformable``'s seam), and the post-norm
encoder and decoder layers (DETR's self-attention and MLP, ``fastzoo.models.detr.transformer``).

The layers are transformers' ``GradientCheckpointingLayer`` s, as DETR's (this module is imported when a
Deformable DETR is built, as transformers is then).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from fastzoo.attention.base import AttnContext
from fastzoo.attention.deformable import multi_scale_deformable_attention
from fastzoo.models.deformable_detr.config import DeformableDetrConfig
from fastzoo.models.detr.transformer import DetrAttention, DetrMLP


@dataclass
class Levels:
    """The feature levels the deformable attention reads: ``shapes`` (h, w) per level on the host,
    the same as an int64 ``[L, 2]`` tensor, and where each level starts in the flattened tokens."""

    shapes: tuple[tuple[int, int], ...]
    shapes_L2: torch.Tensor
    start_L: torch.Tensor

    @classmethod
    def of(cls, shapes, device) -> "Levels":
        """The levels of ``shapes`` (h, w per level, on the host), their tensors made on ``device`` (no read)."""
        shapes_L2 = torch.as_tensor(shapes, dtype=torch.long, device=device)
        return cls(tuple(shapes), shapes_L2, torch.cat((shapes_L2.new_zeros((1,)), shapes_L2.prod(1).cumsum(0)[:-1])))


class DeformableDetrMultiscaleDeformableAttention(nn.Module):
    """transformers' module: per head, ``n_points`` sampling offsets on each level and their softmaxed
    weights from the query; the values are the projected tokens (padding zeroed)."""

    def __init__(self, cfg: DeformableDetrConfig, heads: int, points: int):
        super().__init__()
        self.heads, self.levels, self.points, self.impl = heads, cfg.num_feature_levels, points, "auto"
        d = cfg.d_model
        self.sampling_offsets = nn.Linear(d, heads * self.levels * points * 2)
        self.attention_weights = nn.Linear(d, heads * self.levels * points)
        self.value_proj = nn.Linear(d, d)
        self.output_proj = nn.Linear(d, d)

    def forward(self, q_BQD, mem_BSD, mask_BS, ref_BQLC, levels: Levels):
        """``q_BQD``: the queries (position embedding added); ``mem_BSD``: the tokens read; ``ref_BQLC``:
        reference points per level, (x, y) or boxes (cx, cy, w, h) in [0, 1]."""
        B, Q, _ = q_BQD.shape
        S = mem_BSD.shape[1]
        H, L, P = self.heads, self.levels, self.points
        v_BSD = self.value_proj(mem_BSD)
        if mask_BS is not None:
            v_BSD = v_BSD.masked_fill(~mask_BS[..., None], 0.0)
        v_BSHD = v_BSD.view(B, S, H, -1)
        off_BQHLP2 = self.sampling_offsets(q_BQD).view(B, Q, H, L, P, 2)
        w_BQHLP = F.softmax(self.attention_weights(q_BQD).view(B, Q, H, L * P), -1).view(B, Q, H, L, P)
        if ref_BQLC.shape[-1] == 2:
            wh_L2 = torch.stack([levels.shapes_L2[..., 1], levels.shapes_L2[..., 0]], -1)
            loc = ref_BQLC[:, :, None, :, None, :] + off_BQHLP2 / wh_L2[None, None, None, :, None, :]
        else:  # around a box: offsets in units of half its size over the points
            loc = ref_BQLC[:, :, None, :, None, :2] + off_BQHLP2 / P * ref_BQLC[:, :, None, :, None, 2:] * 0.5
        out_BQD = multi_scale_deformable_attention(v_BSHD, levels.shapes_L2, levels.start_L, loc, w_BQHLP,
                                                   impl=self.impl, spatial_shapes_list=levels.shapes)
        return self.output_proj(out_BQD)


def _clamp_non_finite(x: torch.Tensor) -> torch.Tensor:
    """transformers' training-time clamp of non-finite encoder outputs, without its host read (a clamp to
    the dtype's range minus 1000 is the identity on finite values)."""
    big = torch.finfo(x.dtype).max - 1000
    return x.clamp(-big, big)


class DeformableDetrEncoderLayer(GradientCheckpointingLayer):
    def __init__(self, cfg: DeformableDetrConfig):
        super().__init__()
        self.self_attn = DeformableDetrMultiscaleDeformableAttention(cfg, cfg.encoder_attention_heads,
                                                                     cfg.encoder_n_points)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = DetrMLP(cfg, cfg.encoder_ffn_dim)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x_BSD, pos_BSD, mask_BS, ref_BSL2, levels: Levels):
        a = self.self_attn(x_BSD + pos_BSD, x_BSD, mask_BS, ref_BSL2, levels)
        x_BSD = self.self_attn_layer_norm(x_BSD + F.dropout(a, self.dropout, self.training))
        x_BSD = self.final_layer_norm(x_BSD + self.mlp(x_BSD))
        return _clamp_non_finite(x_BSD) if self.training else x_BSD


class DeformableDetrDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, cfg: DeformableDetrConfig):
        super().__init__()
        self.self_attn = DetrAttention(cfg.d_model, cfg.decoder_attention_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.encoder_attn = DeformableDetrMultiscaleDeformableAttention(cfg, cfg.decoder_attention_heads,
                                                                        cfg.decoder_n_points)
        self.encoder_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = DetrMLP(cfg, cfg.decoder_ffn_dim)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x_BQD, query_pos_BQD, ref_BQLC, levels: Levels, mem_BSD, mask_BS):
        a = self.self_attn(x_BQD, query_pos_BQD, AttnContext())
        x_BQD = self.self_attn_layer_norm(x_BQD + F.dropout(a, self.dropout, self.training))
        a = self.encoder_attn(x_BQD + query_pos_BQD, mem_BSD, mask_BS, ref_BQLC, levels)
        x_BQD = self.encoder_attn_layer_norm(x_BQD + F.dropout(a, self.dropout, self.training))
        return self.final_layer_norm(x_BQD + self.mlp(x_BQD))
