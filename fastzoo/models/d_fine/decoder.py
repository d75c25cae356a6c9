"""D-FINE's decoder (Peng et al. 2024, "D-FINE: Redefine Regression Task in DETRs as Fine-grained Distribution
Refinement"), as transformers' ``DFineDecoder`` computes it, under its module names.

RT-DETR's decoder layer (``RTDetrSelfAttention`` over the queries, the denoising groups as its unmasked
attentions) with D-FINE's differences: the deformable cross-attention samples the encoder's tokens directly
(no value or output projection; ``decoder_n_points`` points per level, v2's sampling around the box); a gate
(``gateway``) mixes it with the residual in place of a LayerNorm; the MLP is ``mlp.layers.N``; the layer's
output is clamped to fp16's range before its last norm.

Fine-grained distribution refinement: the first layer's ``pre_bbox_head`` gives each query an initial box;
every layer's ``bbox_embed`` gives each box edge a distribution over ``max_num_bins + 1`` bins (added to the
previous layer's, which it refines), whose expectation under the non-uniform weighting function
(``fastzoo.losses.set_prediction.weighting_function``) is the edge's distance from the initial box (:func:`distance2bbox`). The
location-quality estimate (``lqe_layers``) adds a score from each distribution's top probabilities to the
class logits. In training every layer's logits and boxes are output, the first layer's initial prediction
first; in eval mode only the last layer's (``eval_idx``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from fastzoo.attention.deformable import multi_scale_deformable_attention
from fastzoo.losses.set_matching import corners_to_center
from fastzoo.losses.set_prediction import weighting_function
from fastzoo.models.d_fine.config import DFineConfig
from fastzoo.models.d_fine.encoder import DFineMLP
from fastzoo.models.deformable_detr.layers import Levels
from fastzoo.models.rt_detr.decoder import RTDetrMLPPredictionHead, RTDetrSelfAttention, inverse_sigmoid
from fastzoo.models.rt_detr.denoising import DenoisingGroups


def distance2bbox(points_BQ4: torch.Tensor, distance_BQ4: torch.Tensor, reg_scale) -> torch.Tensor:
    """Boxes (cxcywh) whose edges lie ``(reg_scale / 2 + distance) x side / reg_scale`` from the centre of
    ``points`` (cxcywh); distances left, top, right, bottom."""
    reg_scale = abs(reg_scale)
    cx, cy, w, h = points_BQ4.unbind(-1)
    x0 = cx - (0.5 * reg_scale + distance_BQ4[..., 0]) * (w / reg_scale)
    y0 = cy - (0.5 * reg_scale + distance_BQ4[..., 1]) * (h / reg_scale)
    x1 = cx + (0.5 * reg_scale + distance_BQ4[..., 2]) * (w / reg_scale)
    y1 = cy + (0.5 * reg_scale + distance_BQ4[..., 3]) * (h / reg_scale)
    return corners_to_center(torch.stack([x0, y0, x1, y1], -1))


def integral(corners_BQK: torch.Tensor, project_K: torch.Tensor) -> torch.Tensor:
    """Each edge's expected distance ``[B, Q, 4]``: its bins' softmax against the weighting function."""
    B, Q, _ = corners_BQK.shape
    p = F.softmax(corners_BQK.reshape(-1, project_K.shape[0]), dim=1)
    return F.linear(p, project_K).reshape(B, Q, 4)


class DFineGate(nn.Module):
    """Two sigmoid gates from both inputs weight the residual and the new value; LayerNorm of their sum."""

    def __init__(self, d: int):
        super().__init__()
        self.gate = nn.Linear(2 * d, 2 * d)
        self.norm = nn.LayerNorm(d)

    def forward(self, residual, x):
        g1, g2 = torch.sigmoid(self.gate(torch.cat([residual, x], -1))).chunk(2, dim=-1)
        return self.norm(g1 * residual + g2 * x)


class DFineLQE(nn.Module):
    """Location-quality estimate: an MLP of each edge's ``top_prob_values`` largest probabilities and their
    mean, added to the class logits."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.top, self.bins = cfg.top_prob_values, cfg.max_num_bins
        self.reg_conf = DFineMLP(4 * (self.top + 1), cfg.lqe_hidden_dim, 1, cfg.lqe_layers)

    def forward(self, scores_BQC, corners_BQK):
        B, Q, _ = corners_BQK.shape
        prob = F.softmax(corners_BQK.reshape(B, Q, 4, self.bins + 1), dim=-1)
        top = prob.topk(self.top, dim=-1).values
        stat = torch.cat([top, top.mean(dim=-1, keepdim=True)], dim=-1)
        return scores_BQC + self.reg_conf(stat.reshape(B, Q, -1))


class DFineMultiscaleDeformableAttention(nn.Module):
    """Per head, ``decoder_n_points[l]`` points on each level ``l`` around the query's box (offsets scaled by
    1 / points and ``decoder_offset_scale``), sampled from the tokens themselves, their softmaxed weights from
    the query."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.heads, self.points, self.impl = cfg.decoder_attention_heads, list(cfg.decoder_n_points), "auto"
        self.offset_scale, self.method = cfg.decoder_offset_scale, cfg.decoder_method
        K = sum(self.points)
        self.register_buffer("num_points_scale", torch.tensor([1 / n for n in self.points for _ in range(n)],
                                                               dtype=torch.float32))
        self.sampling_offsets = nn.Linear(cfg.d_model, self.heads * K * 2)
        self.attention_weights = nn.Linear(cfg.d_model, self.heads * K)

    @property
    def levels(self) -> int:
        return len(self.points)

    def forward(self, q_BQD, mem_BSD, ref_BQ14, levels: Levels):
        B, Q, _ = q_BQD.shape
        S, H, K = mem_BSD.shape[1], self.heads, sum(self.points)
        v_BSHD = mem_BSD.reshape(B, S, H, -1)
        off_BQHK2 = self.sampling_offsets(q_BQD).reshape(B, Q, H, K, 2)
        w_BQHK = F.softmax(self.attention_weights(q_BQD).reshape(B, Q, H, K), dim=-1)
        scale_K1 = self.num_points_scale.to(dtype=q_BQD.dtype).unsqueeze(-1)
        loc = ref_BQ14[:, :, None, :, :2] + off_BQHK2 * scale_K1 * ref_BQ14[:, :, None, :, 2:] * self.offset_scale
        return multi_scale_deformable_attention(v_BSHD, levels.shapes_L2, levels.start_L, loc, w_BQHK,
                                                impl=self.impl, points_per_level=self.points, method=self.method,
                                                spatial_shapes_list=levels.shapes)


class DFineDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, cfg: DFineConfig):
        super().__init__()
        d = cfg.d_model
        self.self_attn = RTDetrSelfAttention(d, cfg.decoder_attention_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.encoder_attn = DFineMultiscaleDeformableAttention(cfg)
        self.gateway = DFineGate(d)
        self.mlp = DFineMLP(d, cfg.decoder_ffn_dim, d, 2, cfg.decoder_activation_function)
        self.final_layer_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.dropout = cfg.dropout

    def forward(self, x_BQD, pos_BQD, ref_BQ14, mem_BSD, levels: Levels, ctx, dn: DenoisingGroups | None):
        a = self.self_attn(x_BQD, pos_BQD, ctx, dn)
        x_BQD = self.self_attn_layer_norm(x_BQD + F.dropout(a, self.dropout, self.training))
        a = self.encoder_attn(x_BQD + pos_BQD, mem_BSD, ref_BQ14, levels)
        x_BQD = self.gateway(x_BQD, F.dropout(a, self.dropout, self.training))
        return self.final_layer_norm((x_BQD + self.mlp(x_BQD)).clamp(min=-65504, max=65504))


class DFineDecoder(nn.Module):
    """The layers, the query position head, the initial box head, the quality estimates and the weighting
    function's parameters (``reg_scale``, ``up``: not trained); the detection model hangs its per-layer class
    and distribution heads here (``model.decoder.class_embed`` / ``bbox_embed``, as transformers)."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        d = cfg.d_model
        self.bins, self.eval_idx = cfg.max_num_bins, cfg.decoder_layers - 1
        self.layers = nn.ModuleList(DFineDecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.query_pos_head = RTDetrMLPPredictionHead(4, 2 * d, d, num_layers=2)
        self.reg_scale = nn.Parameter(torch.tensor([cfg.reg_scale]), requires_grad=False)
        self.up = nn.Parameter(torch.tensor([cfg.up]), requires_grad=False)
        self.pre_bbox_head = DFineMLP(d, d, 4, 3)
        self.lqe_layers = nn.ModuleList(DFineLQE(cfg) for _ in range(cfg.decoder_layers))

    def forward(self, x_BQD, ref_logit_BQ4, mem_BSD, levels: Levels, ctx, dn: DenoisingGroups | None) -> dict:
        """``hs [L, B, Q, D]`` (transformers' stacking), and ``[B, n, Q, ...]``: class ``logits`` and ``boxes`` (n =
        L + 1 in training, the initial prediction first; the last layer's in eval mode), each layer's edge
        distributions ``corners`` and its initial boxes ``refs`` (n = L in training, 1 in eval mode)."""
        project_K = weighting_function(self.bins, self.up, self.reg_scale)
        ref = ref_logit_BQ4.sigmoid()
        hs, logits, boxes, corners, refs = [], [], [], [], []
        prev_x = prev_corners = 0
        for i, layer in enumerate(self.layers):
            pos = self.query_pos_head(ref).clamp(min=-10, max=10)
            x_BQD = layer(x_BQD, pos, ref.unsqueeze(2), mem_BSD, levels, ctx, dn)
            if i == 0:
                first_box = torch.sigmoid(self.pre_bbox_head(x_BQD) + inverse_sigmoid(ref))
                initial = first_box.detach()
            corners_BQK = self.bbox_embed[i](x_BQD + prev_x) + prev_corners
            box = distance2bbox(initial, integral(corners_BQK, project_K), self.reg_scale)
            prev_corners, ref, prev_x = corners_BQK, box.detach(), x_BQD.detach()
            hs.append(x_BQD)
            if self.training or i == self.eval_idx:
                scores = self.class_embed[i](x_BQD)
                if i == 0:
                    logits.append(scores)
                    boxes.append(first_box)
                logits.append(self.lqe_layers[i](scores, corners_BQK))
                boxes.append(box)
                refs.append(initial)
                corners.append(corners_BQK)
        return dict(hs=torch.stack(hs), logits=torch.stack(logits, 1), boxes=torch.stack(boxes, 1),
                    corners=torch.stack(corners, 1), refs=torch.stack(refs, 1))
