"""RF-DETR (Robinson et al. 2025, "RF-DETR: Neural Architecture Search for Real-Time Detection Transformers"), as
transformers' ``RfDetrForObjectDetection``: its module names (``model.backbone.projector``, ``model.enc_output.N``,
``model.decoder.layers.N.cross_attn`` ..., ``class_embed``, ``bbox_embed``), so its state dicts load key for key
outside the DINOv2, whose keys are fastzoo's ViT's (``convert.py``), and its call convention.

The pieces: the windowed DINOv2 and the projector (``backbone.py``), LW-DETR's decoder (``decoder.py``). Here,
as transformers 5.17 computes it:

- the projector's one map is the decoder's memory (its padding from ``pixel_mask``, resized);
- two-stage queries per Group-DETR group (``group_detr`` in training, the first in eval): every token gets a
  fixed box (its cell, side 0.05; none near the border or in padding) refined by the group's ``enc_out_bbox_embed``
  and a score from its ``enc_out_class_embed``; the ``num_queries`` best boxes (detached), each moved by a
  learned ``reference_point_embed`` delta, are the decoder's boxes, and learned ``query_feat`` its queries;
- the heads refine those boxes once more (``bbox_embed``, a delta in cxcy, log-wh); ``logits`` are sigmoids
  per class;
- the loss is the set loss's LW-DETR part (``fastzoo.losses.set_prediction.lw_detr_loss``: IoU-aware BCE, L1,
  GIoU on every layer and the encoder's proposals, each group matched apart).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fastzoo.attention.deformable import initial_offsets
from fastzoo.models.base import FastzooModel, refuse_inputs, write_pretrained
from fastzoo.models.deformable_detr.model import valid_ratio
from fastzoo.models.detr.model import TransformersDetector, _check_pixels
from fastzoo.models.rf_detr.config import RfDetrConfig


def refine_boxes(boxes: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """transformers' ``refine_bboxes``: the centre moved by ``deltas[:2]`` of the size, the size scaled by
    ``exp(deltas[2:])``."""
    cxcy = deltas[..., :2] * boxes[..., 2:] + boxes[..., :2]
    return torch.cat((cxcy, deltas[..., 2:].exp() * boxes[..., 2:]), -1)


def proposals(mem_BSD: torch.Tensor, pad_BS: torch.Tensor, h: int, w: int):
    """transformers' ``gen_encoder_output_proposals`` for one level: each token's cell as a box (side 0.05,
    centres over the image's real part), zero where invalid (padding, or a coordinate outside (0.01, 0.99));
    the tokens zeroed there too; and that invalidity ``[B, S, 1]``."""
    B = mem_BSD.shape[0]
    pad_BHW1 = pad_BS.view(B, h, w, 1)
    valid_h, valid_w = (~pad_BHW1[:, :, 0, 0]).sum(1), (~pad_BHW1[:, 0, :, 0]).sum(1)
    gy, gx = torch.meshgrid(torch.linspace(0, h - 1, h, dtype=mem_BSD.dtype, device=mem_BSD.device),
                            torch.linspace(0, w - 1, w, dtype=mem_BSD.dtype, device=mem_BSD.device), indexing="ij")
    grid = torch.cat([gx.unsqueeze(-1), gy.unsqueeze(-1)], -1)
    scale = torch.cat([valid_w.unsqueeze(-1), valid_h.unsqueeze(-1)], 1).view(B, 1, 1, 2)
    grid = (grid.unsqueeze(0).expand(B, -1, -1, -1) + 0.5) / scale
    boxes_BS4 = torch.cat((grid, torch.ones_like(grid) * 0.05), -1).view(B, -1, 4)
    invalid_BS1 = pad_BS.unsqueeze(-1) | ~((boxes_BS4 > 0.01) & (boxes_BS4 < 0.99)).all(-1, keepdim=True)
    return mem_BSD.masked_fill(invalid_BS1, 0.0), boxes_BS4.masked_fill(invalid_BS1, 0.0), invalid_BS1


class RfDetrModel(nn.Module):
    """transformers' ``RfDetrModel``: backbone and projector, two-stage query selection per group, decoder."""

    def __init__(self, cfg: RfDetrConfig):
        # the layers are imported when a model is built, as transformers is then (see RT-DETR's model)
        from fastzoo.models.rf_detr.backbone import RfDetrConvEncoder
        from fastzoo.models.rf_detr.decoder import RfDetrDecoder
        from fastzoo.models.rt_detr.decoder import RTDetrMLPPredictionHead

        super().__init__()
        self.config = cfg
        d, G, Q = cfg.d_model, cfg.group_detr, cfg.num_queries
        self.backbone = RfDetrConvEncoder(cfg)
        self.reference_point_embed = nn.Embedding(Q * G, 4)
        self.query_feat = nn.Embedding(Q * G, d)
        self.decoder = RfDetrDecoder(cfg)
        self.enc_output = nn.ModuleList(nn.Linear(d, d) for _ in range(G))
        self.enc_output_norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(G))
        self.enc_out_bbox_embed = nn.ModuleList(RTDetrMLPPredictionHead(d, d, 4, num_layers=3) for _ in range(G))
        self.enc_out_class_embed = nn.ModuleList(nn.Linear(d, cfg.num_labels) for _ in range(G))

    def forward(self, pixel_values, pixel_mask) -> dict:
        from fastzoo.models.deformable_detr.layers import Levels

        cfg = self.config
        features_BDHW, mask_BHW = self.backbone(pixel_values, pixel_mask)
        B, _, h, w = features_BDHW.shape
        mem_BSD = features_BDHW.flatten(2).transpose(1, 2)
        mask_BS = mask_BHW.flatten(1)
        levels = Levels.of(((h, w),), mem_BSD.device)
        query_BSD, boxes_BS4, invalid_BS1 = proposals(mem_BSD, ~mask_BS, h, w)
        groups = cfg.group_detr if self.training else 1
        Q = cfg.num_queries
        picked_boxes, picked_queries = [], []
        for g in range(groups):
            q_BSD = self.enc_output_norm[g](self.enc_output[g](query_BSD))
            scores_BSC = self.enc_out_class_embed[g](q_BSD).masked_fill(invalid_BS1, float("-inf"))
            coords_BS4 = refine_boxes(boxes_BS4, self.enc_out_bbox_embed[g](q_BSD))
            top_BQ = torch.topk(scores_BSC.max(-1)[0], Q, dim=1)[1]
            picked_boxes.append(coords_BS4.gather(1, top_BQ.unsqueeze(-1).expand(-1, -1, 4)))
            picked_queries.append(q_BSD.gather(1, top_BQ.unsqueeze(-1).expand(-1, -1, cfg.d_model)))
        enc_boxes_BQ4, enc_queries_BQD = torch.cat(picked_boxes, 1), torch.cat(picked_queries, 1)
        deltas_BQ4 = self.reference_point_embed.weight[: Q * groups].unsqueeze(0).expand(B, -1, -1)
        boxes_BQ4 = refine_boxes(enc_boxes_BQ4.detach(), deltas_BQ4)
        target_BQD = self.query_feat.weight[: Q * groups].unsqueeze(0).expand(B, -1, -1)
        valid_B12 = valid_ratio(mask_BHW, mem_BSD.dtype).unsqueeze(1)
        hs_LBQD = self.decoder(target_BQD, boxes_BQ4, valid_B12, levels, mem_BSD, mask_BS, groups)
        return dict(hs=hs_LBQD, boxes=boxes_BQ4, features=features_BDHW, enc_queries=enc_queries_BQD,
                    enc_boxes=enc_boxes_BQ4)


def check_side(pixel_values, cfg: RfDetrConfig) -> None:
    """ValueError naming ``pixel_values`` where the patch grid does not split into ``num_windows`` windows per
    side, or the map has fewer tokens than ``num_queries`` (transformers fails inside a reshape or top-k)."""
    grid = [side // cfg.patch_size for side in pixel_values.shape[-2:]]
    if any(g == 0 or g % cfg.num_windows for g in grid):
        raise ValueError(f"pixel_values: {tuple(pixel_values.shape[-2:])} images give a {grid[0]} x {grid[1]} patch grid, "
                         f"which {cfg.num_windows} windows per side do not split: use sides that are multiples of "
                         f"{cfg.patch_size * cfg.num_windows} (image_side_multiple)")
    if grid[0] * grid[1] < cfg.num_queries:
        raise ValueError(f"pixel_values: {tuple(pixel_values.shape[-2:])} images give {grid[0] * grid[1]} tokens, fewer "
                         f"than num_queries={cfg.num_queries} proposals to pick: use larger images")


class RfDetrForObjectDetection(TransformersDetector, FastzooModel):
    """RF-DETR with transformers' call convention (and its Trainer's asks: gradient checkpointing of the DINOv2's
    blocks and the decoder's layers, ``num_parameters``)."""

    family = "rf_detr"
    config_class = RfDetrConfig
    main_input_name = "pixel_values"
    sigmoid_classes = True  # one sigmoid per class, no "no object" logit
    eval_after_pretrained = True  # like transformers' from_pretrained

    def __init__(self, cfg: RfDetrConfig):
        from fastzoo.models.rt_detr.decoder import RTDetrMLPPredictionHead

        super().__init__()
        import transformers.modeling_outputs  # noqa: F401  (registers HF output classes as pytree nodes, see the decoders)

        self.config = cfg
        self.model = RfDetrModel(cfg)
        self.class_embed = nn.Linear(cfg.d_model, cfg.num_labels)
        self.bbox_embed = RTDetrMLPPredictionHead(cfg.d_model, cfg.d_model, 4, num_layers=3)
        self._init_weights()
        if cfg.gradient_checkpointing:  # transformers' legacy config field, honoured as transformers does
            self.gradient_checkpointing_enable()

    def _init_weights(self):
        """transformers' init of a fresh model (never the compared state: tests draw every parameter)."""
        cfg = self.config
        bias = -math.log((1 - 0.01) / 0.01)
        with torch.no_grad():
            for name, m in self.named_modules():
                if name.startswith("model.backbone.backbone"):
                    continue
                if isinstance(m, (nn.Linear, nn.Conv2d)):
                    nn.init.normal_(m.weight, std=cfg.init_std)
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, nn.Embedding):
                    nn.init.normal_(m.weight, std=cfg.init_std)
            nn.init.zeros_(self.model.reference_point_embed.weight)
            for head in [self.class_embed, *self.model.enc_out_class_embed]:
                nn.init.constant_(head.bias, bias)
            for head in [self.bbox_embed, *self.model.enc_out_bbox_embed]:
                nn.init.zeros_(head.layers[-1].weight)
                nn.init.zeros_(head.layers[-1].bias)
            for m in self.deformable_attentions():
                nn.init.zeros_(m.sampling_offsets.weight)
                m.sampling_offsets.bias.copy_(initial_offsets(m.heads, m.levels, m.points))
                nn.init.zeros_(m.attention_weights.weight)
                nn.init.zeros_(m.attention_weights.bias)
                for lin in (m.value_proj, m.output_proj):
                    nn.init.xavier_uniform_(lin.weight)
                    nn.init.zeros_(lin.bias)
            vit = self.model.backbone.backbone
            for t in (vit.cls_token, vit.pos_embed):
                nn.init.trunc_normal_(t, std=0.02)

    def checkpoint_stacks(self) -> list[nn.ModuleList]:
        """The DINOv2's blocks and the decoder's layers (transformers' ``GradientCheckpointingLayer`` s in its RF-DETR,
        whose class declares no checkpointing support)."""
        return [self.model.backbone.backbone.blocks, self.model.decoder.layers]

    def encoder_inputs(self) -> list[nn.Module]:
        """The module whose output the checkpointed blocks read first: the DINOv2's patch embedding."""
        return [self.model.backbone.backbone.patch_embed]

    def attention_needs(self) -> dict:
        """The backbone's and the decoder's self-attention: unmasked (windows and Group-DETR groups are sequences
        of the batch)."""
        cfg = self.config
        head_dim = max(cfg.hidden_size // cfg.num_attention_heads, cfg.d_model // cfg.decoder_self_attention_heads)
        return {"head_dim": head_dim, "causal": False, "grid_2d": False, "padding_mask": False}

    @property
    def image_side_multiple(self) -> int:
        """Image sides that are multiples of this split into the backbone's windows (others are refused)."""
        return self.config.patch_size * self.config.num_windows

    @property
    def min_image_side(self) -> int:
        """The smallest square image side (a multiple of ``image_side_multiple``) whose map has ``num_queries``
        tokens to pick from."""
        m, cfg = self.image_side_multiple, self.config
        side = m
        while (side // cfg.patch_size) ** 2 < cfg.num_queries:
            side += m
        return side

    def set_deformable_attention(self, impl: str = "auto") -> "RfDetrForObjectDetection":
        """The decoder's multi-scale deformable attention kernel (``fastzoo.attention.deformable``: reference |
        cpu | triton | auto), checked against this model's device and dtype now: an unknown or unavailable kernel
        is refused by name and nothing changes."""
        from fastzoo.attention.deformable import _kernel_name  # the seam's own choice and refusal, made now

        p = self.class_embed.weight
        _kernel_name(impl, p.device.type, p.dtype, False)
        for m in self.deformable_attentions():
            m.impl = impl
        return self

    def deformable_attentions(self) -> list[nn.Module]:
        return [layer.cross_attn for layer in self.model.decoder.layers]

    def heads(self, hs_BQD: torch.Tensor, boxes_BQ4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Class logits and boxes (the queries' boxes refined) of hidden states ``[..., B, Q, D]``."""
        return self.class_embed(hs_BQD), refine_boxes(boxes_BQ4, self.bbox_embed(hs_BQD))

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None, labels: list[dict] | None = None,
                **kwargs):
        """transformers' ``RfDetrForObjectDetection.forward``: ``pixel_values [B, 3, H, W]``, ``pixel_mask [B, H, W]``
        (1 = a real pixel), ``labels`` as DETR's. Returns transformers' output class; ``return_dict=False`` gives
        its tuple. Refused by name: ``output_attentions`` / ``output_hidden_states`` true, any other keyword."""
        from transformers.models.rf_detr.modeling_rf_detr import RfDetrObjectDetectionOutput

        from fastzoo.losses.set_prediction import check_labels, lw_detr_loss

        return_dict = kwargs.pop("return_dict", None)
        unserved = {k: kwargs.pop(k, None) for k in ("output_attentions", "output_hidden_states")}
        refuse_inputs("RF-DETR", unserved, kwargs, why="it returns no per-layer attentions or hidden states")
        pixel_values, pixel_mask = _check_pixels(pixel_values, pixel_mask, self.config.num_channels, self.class_embed.weight)
        if labels is not None:
            check_labels(labels, pixel_values.shape[0])
        check_side(pixel_values, self.config)
        if pixel_mask is None:
            pixel_mask = torch.ones(pixel_values.shape[0], *pixel_values.shape[-2:], dtype=torch.long,
                                    device=pixel_values.device)
        out = self.model(pixel_values, pixel_mask)
        hs_LBQD, boxes_BQ4 = out["hs"], out["boxes"]
        logits, pred_boxes = self.heads(hs_LBQD[-1], boxes_BQ4)
        enc = self.model.enc_out_class_embed
        enc_logits = torch.cat([enc[g](part) for g, part in enumerate(out["enc_queries"].split(self.config.num_queries, 1))], 1)
        loss = loss_dict = aux = None
        if labels is not None:
            if self.config.auxiliary_loss:
                logits_LBQC, boxes_LBQ4 = self.heads(hs_LBQD, boxes_BQ4)
                aux = [{"logits": a, "pred_boxes": b} for a, b in zip(logits_LBQC[:-1], boxes_LBQ4[:-1])]
            else:
                logits_LBQC, boxes_LBQ4 = logits[None], pred_boxes[None]
            loss, loss_dict = lw_detr_loss(logits_LBQC, boxes_LBQ4, labels, self.config, enc_logits_BQC=enc_logits,
                                           enc_boxes_BQ4=out["enc_boxes"])
        o = RfDetrObjectDetectionOutput(
            loss=loss, loss_dict=loss_dict, logits=logits, pred_boxes=pred_boxes, auxiliary_outputs=aux,
            init_reference_points=boxes_BQ4, last_hidden_state=hs_LBQD[-1], intermediate_hidden_states=hs_LBQD,
            intermediate_reference_points=boxes_BQ4[None], enc_outputs_class=enc_logits,
            enc_outputs_coord_logits=out["enc_boxes"], backbone_features=out["features"])
        return o if return_dict is not False else o.to_tuple()

    def hf_config(self):
        """This architecture as a ``transformers.RfDetrConfig``."""
        from fastzoo.models.rf_detr.convert import hf_config

        return hf_config(self.config)

    def save_pretrained(self, path, **_hf_options):
        """A directory transformers' ``from_pretrained`` and fastzoo both read (transformers' ``config.json`` and
        ``model.safetensors`` in its keys), written atomically. transformers' own options are accepted and
        ignored."""
        from fastzoo.models.rf_detr.convert import HF

        cfg = {**self.hf_config().to_dict(), "architectures": ["RfDetrForObjectDetection"]}
        return write_pretrained(path, cfg, HF.from_fastzoo(self.state_dict(), self.config), weights_format="pt")
