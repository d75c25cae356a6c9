"""RT-DETR's decoder, as transformers' ``RTDetrDecoder`` (v1) and ``RTDetrV2Decoder`` compute it, under
their module names: post-norm layers of self-attention over the queries (fastzoo's backends; the
denoising groups as ``denoising.grouped_attention``), multi-scale deformable cross-attention around each
query's box (``fastzoo.attention.deformable``'s seam), MLP; the queries' position embedding is an MLP of
their boxes, and every layer's box head refines the boxes the next layer reads (detached). The layers are
``GradientCheckpointingLayer`` s, as DETR's (``models/detr/transformer.py`` says how).

RT-DETRv2's cross-attention (``model_type="rt_detr_v2"``): the offsets of each level's points scaled by
1 / points and ``decoder_offset_scale`` around the box, sampled bilinearly or at the nearest pixel
(``decoder_method="discrete"``), the points flattened over ``decoder_n_levels`` levels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from fastzoo.attention.deformable import multi_scale_deformable_attention
from fastzoo.models.deformable_detr.layers import Levels
from fastzoo.models.detr.transformer import DetrAttention
from fastzoo.models.rt_detr.config import RTDetrConfig
from fastzoo.models.rt_detr.denoising import DenoisingGroups, grouped_attention
from fastzoo.models.rt_detr.encoder import RTDetrMLP


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """transformers' (clamped to [0, 1], then log(x / (1 - x)) with both sides at least ``eps``)."""
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


class RTDetrMLPPredictionHead(nn.Module):
    """``num_layers`` linear layers, ReLU between (``layers.N``)."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int):
        super().__init__()
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < len(self.layers) - 1 else layer(x)
        return x


class RTDetrSelfAttention(DetrAttention):
    """The decoder's self-attention (DETR's: position embedding on queries and keys); with denoising
    groups, transformers' mask as two unmasked attentions."""

    def forward(self, x_BSD, pos_BSD, ctx, dn: DenoisingGroups | None = None):
        if dn is None:
            return super().forward(x_BSD, pos_BSD, ctx)
        B, S, D = x_BSD.shape
        qk_in = x_BSD + pos_BSD
        q_BHSD, k_BHSD, v_BHSD = (proj(t).view(B, S, self.heads, self.head_dim).transpose(1, 2)
                                  for proj, t in ((self.q_proj, qk_in), (self.k_proj, qk_in), (self.v_proj, x_BSD)))
        o_BHSD = grouped_attention(self.attend, q_BHSD, k_BHSD, v_BHSD, ctx, dn)
        return self.o_proj(o_BHSD.transpose(1, 2).reshape(B, S, D))


class RTDetrMultiscaleDeformableAttention(nn.Module):
    """Per head, points on each level around the query's box, their softmaxed weights from the query."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        self.v2 = cfg.v2
        self.heads, self.points, self.impl = cfg.decoder_attention_heads, cfg.decoder_n_points, "auto"
        self.levels = cfg.decoder_n_levels if cfg.v2 else cfg.num_feature_levels
        d, H, L, P = cfg.d_model, self.heads, self.levels, self.points
        self.sampling_offsets = nn.Linear(d, H * L * P * 2)
        self.attention_weights = nn.Linear(d, H * L * P)
        self.value_proj = nn.Linear(d, d)
        self.output_proj = nn.Linear(d, d)
        if cfg.v2:
            self.offset_scale, self.method = cfg.decoder_offset_scale, cfg.decoder_method
            self.register_buffer("n_points_scale", torch.full((L * P,), 1 / P, dtype=torch.float32))

    def forward(self, q_BQD, mem_BSD, ref_BQ14, levels: Levels):
        B, Q, _ = q_BQD.shape
        S = mem_BSD.shape[1]
        H, L, P = self.heads, self.levels, self.points
        v_BSHD = self.value_proj(mem_BSD).view(B, S, H, -1)
        w_BQHK = F.softmax(self.attention_weights(q_BQD).view(B, Q, H, L * P), -1)
        if not self.v2:
            off_BQHLP2 = self.sampling_offsets(q_BQD).view(B, Q, H, L, P, 2)
            loc = ref_BQ14[:, :, None, :, None, :2] + off_BQHLP2 / P * ref_BQ14[:, :, None, :, None, 2:] * 0.5
            out = multi_scale_deformable_attention(v_BSHD, levels.shapes_L2, levels.start_L, loc,
                                                   w_BQHK.view(B, Q, H, L, P), impl=self.impl,
                                                   spatial_shapes_list=levels.shapes)
        else:
            off_BQHK2 = self.sampling_offsets(q_BQD).view(B, Q, H, L * P, 2)
            scale_K1 = self.n_points_scale.to(dtype=q_BQD.dtype).unsqueeze(-1)
            loc = ref_BQ14[:, :, None, :, :2] + off_BQHK2 * scale_K1 * ref_BQ14[:, :, None, :, 2:] * self.offset_scale
            out = multi_scale_deformable_attention(v_BSHD, levels.shapes_L2, levels.start_L, loc, w_BQHK,
                                                   impl=self.impl, points_per_level=[P] * L, method=self.method,
                                                   spatial_shapes_list=levels.shapes)
        return self.output_proj(out)


class RTDetrDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        d, eps = cfg.d_model, cfg.layer_norm_eps
        self.self_attn = RTDetrSelfAttention(d, cfg.decoder_attention_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.encoder_attn = RTDetrMultiscaleDeformableAttention(cfg)
        self.encoder_attn_layer_norm = nn.LayerNorm(d, eps=eps)
        self.mlp = RTDetrMLP(cfg, d, cfg.decoder_ffn_dim, cfg.decoder_activation_function)
        self.final_layer_norm = nn.LayerNorm(d, eps=eps)
        self.dropout = cfg.dropout

    def forward(self, x_BQD, pos_BQD, ref_BQ14, mem_BSD, levels: Levels, ctx, dn: DenoisingGroups | None):
        a = self.self_attn(x_BQD, pos_BQD, ctx, dn)
        x_BQD = self.self_attn_layer_norm(x_BQD + F.dropout(a, self.dropout, self.training))
        a = self.encoder_attn(x_BQD + pos_BQD, mem_BSD, ref_BQ14, levels)
        x_BQD = self.encoder_attn_layer_norm(x_BQD + F.dropout(a, self.dropout, self.training))
        return self.final_layer_norm(x_BQD + self.mlp(x_BQD))


class RTDetrDecoder(nn.Module):
    """The layers and the query position head; the detection model hangs its per-layer class and box
    heads here (``model.decoder.class_embed`` / ``bbox_embed``, as transformers)."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        self.layers = nn.ModuleList(RTDetrDecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.query_pos_head = RTDetrMLPPredictionHead(4, 2 * cfg.d_model, cfg.d_model, num_layers=2)
        n = cfg.decoder_layers
        self.class_embed = nn.ModuleList(nn.Linear(cfg.d_model, cfg.num_labels) for _ in range(n))
        self.bbox_embed = nn.ModuleList(RTDetrMLPPredictionHead(cfg.d_model, cfg.d_model, 4, 3) for _ in range(n))

    def forward(self, x_BQD, ref_logit_BQ4, mem_BSD, levels: Levels, ctx, dn: DenoisingGroups | None) -> dict:
        """Per layer: hidden states ``hs``, class ``logits``, ``boxes`` ``[B, L, Q, ...]`` each (transformers' stacking)."""
        ref = ref_logit_BQ4.sigmoid()
        hs, logits, boxes = [], [], []
        for i, layer in enumerate(self.layers):
            x_BQD = layer(x_BQD, self.query_pos_head(ref), ref.unsqueeze(2), mem_BSD, levels, ctx, dn)
            new = torch.sigmoid(self.bbox_embed[i](x_BQD) + inverse_sigmoid(ref))
            ref = new.detach()
            hs.append(x_BQD)
            boxes.append(new)
            logits.append(self.class_embed[i](x_BQD))
        return dict(hs=torch.stack(hs, 1), logits=torch.stack(logits, 1), boxes=torch.stack(boxes, 1))
