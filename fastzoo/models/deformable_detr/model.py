"""Deformable DETR (Zhu et al. 2021, "Deformable DETR: Deformable Transformers for End-to-End Object
Detection"), as transformers' ``DeformableDetrForObjectDetection``: its module names (``model.backbone.model``,
``model.input_proj.N``, ``model.level_embed``, ``model.encoder.layers.N.self_attn.sampling_offsets`` ...,
``class_embed.N``, ``bbox_embed.N``), so its state dicts load key for key.

What it shares with DETR (``fastzoo.models.detr``): the frozen-BatchNorm ResNet backbone, the sine
position embedding, the decoder's self-attention and the MLPs, the set loss. What differs, as transformers
5.17 computes it:

- multi-scale features: the backbone's stages ``backbone_out_indices`` (C3..C5), each through a 1x1 conv and
  GroupNorm(32), and ``num_feature_levels`` minus those levels more from 3x3 stride-2 convs on the last;
  the sine embedding's positions at the pixels' centres (offset 0.5) plus a learned ``level_embed``;
- the encoder's self-attention and the decoder's cross-attention are multi-scale deformable attention
  (``layers.py``) around reference points: each token's own centre (scaled by the valid ratios of the
  padded levels) in the encoder, a linear map of the query embedding (or a box) in the decoder;
- ``with_box_refine``: each decoder layer's box head moves the reference boxes the next layer reads
  (detached); ``two_stage``: the encoder's tokens become proposals (a fixed box per token and level, a
  class and box head on each), the top ``num_queries`` give the decoder its queries and reference boxes;
- heads: per decoder layer ``class_embed`` (``num_labels`` logits, sigmoid: no "no object" class) and
  ``bbox_embed`` (3-layer MLP) predicting offsets to the reference in inverse-sigmoid space; the loss is the
  set loss with its sigmoid focal term (``focal_alpha``) and the focal matching cost.

transformers computes no loss on the two-stage encoder's proposals (``enc_outputs_class`` /
``enc_outputs_coord_logits`` are returned, not trained by its loss): neither does this model.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.attention.deformable import initial_offsets
from fastzoo.models.base import FastzooModel, write_pretrained
from fastzoo.models.deformable_detr.config import DeformableDetrConfig
from fastzoo.models.detr.backbone import DetrConvEncoder, resize_mask
from fastzoo.models.detr.model import (DetrMLPPredictionHead, TransformersDetector, _check_pixels, init_outside_backbone,
                                       sine_position_embedding)


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """transformers' (clamped to [0, 1], then log(x / (1 - x)) with both sides at least ``eps``)."""
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def valid_ratio(mask_BHW: torch.Tensor, dtype) -> torch.Tensor:
    """The share of each image's real rows and columns in a padded level: ``[B, 2]`` (width, height)."""
    _, H, W = mask_BHW.shape
    return torch.stack([mask_BHW[:, 0, :].sum(1).to(dtype) / W, mask_BHW[:, :, 0].sum(1).to(dtype) / H], -1)


def min_image_side(cfg: DeformableDetrConfig) -> int:
    """Twice the stride of the coarsest level: backbone stage i has stride 2^(i+1), each extra level 2x more."""
    return 2 * 2 ** (cfg.backbone_out_indices[-1] + 1 + cfg.num_feature_levels - len(cfg.backbone_out_indices))


def encoder_reference_points(shapes, valid_BL2: torch.Tensor) -> torch.Tensor:
    """Each token's centre in its level, normalised by the level's real part, then scaled to every level
    by its valid ratios: ``[B, S, L, 2]`` (transformers' ``get_reference_points``)."""
    refs = []
    for level, (h, w) in enumerate(shapes):
        y, x = torch.meshgrid(torch.linspace(0.5, h - 0.5, h, dtype=valid_BL2.dtype, device=valid_BL2.device),
                              torch.linspace(0.5, w - 0.5, w, dtype=valid_BL2.dtype, device=valid_BL2.device),
                              indexing="ij")
        y = y.reshape(-1)[None] / (valid_BL2[:, None, level, 1] * h)
        x = x.reshape(-1)[None] / (valid_BL2[:, None, level, 0] * w)
        refs.append(torch.stack((x, y), -1))
    return torch.cat(refs, 1)[:, :, None] * valid_BL2[:, None]


class DeformableDetrEncoder(nn.Module):
    def __init__(self, cfg: DeformableDetrConfig):
        from fastzoo.models.deformable_detr.layers import DeformableDetrEncoderLayer

        super().__init__()
        self.layers = nn.ModuleList(DeformableDetrEncoderLayer(cfg) for _ in range(cfg.encoder_layers))


class DeformableDetrDecoder(nn.Module):
    """The decoder layers; with box refinement / two-stage, transformers hangs the model's box / class
    heads here too (the same modules: ``model.decoder.bbox_embed`` is ``bbox_embed``)."""

    def __init__(self, cfg: DeformableDetrConfig):
        from fastzoo.models.deformable_detr.layers import DeformableDetrDecoderLayer

        super().__init__()
        self.layers = nn.ModuleList(DeformableDetrDecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.bbox_embed = self.class_embed = None


def _projection(cin: int, d: int, kernel_size: int = 1, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, d, kernel_size, stride=stride, padding=kernel_size // 2), nn.GroupNorm(32, d))


class DeformableDetrModel(nn.Module):
    """transformers' ``DeformableDetrModel``: backbone, input projections, encoder, query set-up, decoder."""

    def __init__(self, cfg: DeformableDetrConfig):
        super().__init__()
        self.config = cfg
        self.backbone = DetrConvEncoder(cfg)
        d = cfg.d_model
        channels = [cfg.hidden_sizes[i - 1] for i in cfg.backbone_out_indices]
        proj = [_projection(c, d) for c in channels]
        for i in range(cfg.num_feature_levels - len(channels)):
            proj.append(_projection(channels[-1] if i == 0 else d, d, kernel_size=3, stride=2))
        self.input_proj = nn.ModuleList(proj)
        if not cfg.two_stage:
            self.query_position_embeddings = nn.Embedding(cfg.num_queries, 2 * d)
        self.encoder = DeformableDetrEncoder(cfg)
        self.decoder = DeformableDetrDecoder(cfg)
        self.level_embed = nn.Parameter(torch.empty(cfg.num_feature_levels, d))
        if cfg.two_stage:
            self.enc_output = nn.Linear(d, d)
            self.enc_output_norm = nn.LayerNorm(d)
            self.pos_trans = nn.Linear(2 * d, 2 * d)
            self.pos_trans_norm = nn.LayerNorm(2 * d)
        else:
            self.reference_points = nn.Linear(d, 2)

    def levels(self, pixel_values, pixel_mask):
        """The encoder's input: tokens ``[B, S, D]``, their position embedding (level embedding added),
        mask ``[B, S]``, the :class:`Levels` and the valid ratios ``[B, L, 2]``."""
        from fastzoo.models.deformable_detr.layers import Levels

        cfg = self.config
        feats = self.backbone.feature_maps(pixel_values, pixel_mask, cfg.backbone_out_indices)
        srcs = [self._project(level, f, pixel_values) for level, (f, _) in enumerate(feats)]
        masks = [m for _, m in feats]
        for level in range(len(feats), cfg.num_feature_levels):
            srcs.append(self._project(level, feats[-1][0] if level == len(feats) else srcs[-1], pixel_values))
            masks.append(resize_mask(pixel_mask, srcs[-1].shape[-2:]))
        x, pos = [], []
        for level, (src, mask) in enumerate(zip(srcs, masks)):
            p = sine_position_embedding(src.shape, pixel_values.dtype, pixel_values.device, cfg.d_model, mask, offset=0.5)
            pos.append(p.to(src.dtype) + self.level_embed[level].view(1, 1, -1))
            x.append(src.flatten(2).transpose(1, 2))
        levels = Levels.of(tuple(tuple(s.shape[-2:]) for s in srcs), pixel_values.device)
        valid_BL2 = torch.stack([valid_ratio(m, x[0].dtype) for m in masks], 1)
        mask_BS = torch.cat([m.flatten(1) for m in masks], 1)
        return torch.cat(x, 1), torch.cat(pos, 1), mask_BS, levels, valid_BL2

    def _project(self, level: int, f_BCHW, pixel_values):
        """Level ``level``'s input projection; a single value per GroupNorm group (a 1 x 1 map at d_model 32,
        which transformers' model fails on too) is refused naming the images' size (torch's error names none)."""
        h, w = f_BCHW.shape[-2:]
        if level >= len(self.config.backbone_out_indices):  # a 3x3 stride-2 convolution first
            h, w = (h + 1) // 2, (w + 1) // 2
        if f_BCHW.shape[0] * h * w * (self.config.d_model // 32) == 1:  # torch's test: B x C/G x h x w values
            raise ValueError(f"pixel_values: {tuple(pixel_values.shape[-2:])} images leave feature level {level} a "
                             f"single position, which GroupNorm (32 groups of d_model={self.config.d_model}) cannot "
                             f"normalise alone: use images of at least {min_image_side(self.config)} px (or batches of 2, "
                             f"fewer num_feature_levels, a wider d_model)")
        return self.input_proj[level](f_BCHW)

    def forward(self, pixel_values, pixel_mask):
        """Per decoder layer its output and the reference its heads add to; the first reference; the
        two-stage proposals' logits and boxes (None without ``two_stage``); the encoder's output."""
        cfg = self.config
        x_BSD, pos_BSD, mask_BS, levels, valid_BL2 = self.levels(pixel_values, pixel_mask)
        x_BSD = F.dropout(x_BSD, cfg.dropout, self.training)
        ref_BSL2 = encoder_reference_points(levels.shapes, valid_BL2)
        for layer in self.encoder.layers:
            x_BSD = layer(x_BSD, pos_BSD, mask_BS, ref_BSL2, levels)
        B, _, D = x_BSD.shape
        enc_class = enc_coord = None
        if cfg.two_stage:
            query_BSD, proposals_BS4 = self.proposals(x_BSD, mask_BS, levels.shapes)
            enc_class = self.decoder.class_embed[-1](query_BSD)
            enc_coord = self.decoder.bbox_embed[-1](query_BSD) + proposals_BS4
            top_BQ = torch.topk(enc_class[..., 0], cfg.two_stage_num_proposals, dim=1)[1]
            coord_BQ4 = torch.gather(enc_coord, 1, top_BQ.unsqueeze(-1).repeat(1, 1, 4)).detach()
            ref = coord_BQ4.sigmoid()
            query_pos_BQD, h_BQD = torch.split(self.pos_trans_norm(self.pos_trans(proposal_pos_embed(coord_BQ4, D))), D, 2)
        else:
            query_pos_QD, h_QD = torch.split(self.query_position_embeddings.weight, D, dim=1)
            query_pos_BQD, h_BQD = query_pos_QD.expand(B, -1, -1), h_QD.expand(B, -1, -1)
            ref = self.reference_points(query_pos_BQD).sigmoid()
        init_ref, hs, refs = ref, [], []
        for i, layer in enumerate(self.decoder.layers):
            scale = torch.cat([valid_BL2, valid_BL2], -1) if ref.shape[-1] == 4 else valid_BL2
            h_BQD = layer(h_BQD, query_pos_BQD, ref[:, :, None] * scale[:, None], levels, x_BSD, mask_BS)
            if self.decoder.bbox_embed is not None:  # box refinement: the next layer's reference boxes
                delta = self.decoder.bbox_embed[i](h_BQD)
                if ref.shape[-1] == 2:
                    delta = torch.cat([delta[..., :2] + inverse_sigmoid(ref), delta[..., 2:]], -1)
                else:
                    delta = delta + inverse_sigmoid(ref)
                ref = delta.sigmoid().detach()
            hs.append(h_BQD)
            refs.append(ref)
        return hs, [init_ref, *refs[:-1]], refs, enc_class, enc_coord, x_BSD

    def proposals(self, x_BSD, mask_BS, shapes):
        """transformers' ``gen_encoder_output_proposals``: a box per token (its cell's centre in the level's
        real part, side 0.05 x 2^level) in inverse-sigmoid space (inf where padding or near the edge), and the
        tokens (zeroed there) through ``enc_output`` and its norm."""
        B = x_BSD.shape[0]
        pad_BS = ~mask_BS
        props, start = [], 0
        for level, (h, w) in enumerate(shapes):
            pad = pad_BS[:, start:start + h * w].view(B, h, w, 1)
            valid_h, valid_w = torch.sum(~pad[:, :, 0, 0], 1), torch.sum(~pad[:, 0, :, 0], 1)
            gy, gx = torch.meshgrid(torch.linspace(0, h - 1, h, dtype=x_BSD.dtype, device=x_BSD.device),
                                    torch.linspace(0, w - 1, w, dtype=x_BSD.dtype, device=x_BSD.device), indexing="ij")
            grid = torch.cat([gx.unsqueeze(-1), gy.unsqueeze(-1)], -1)
            scale = torch.cat([valid_w.unsqueeze(-1), valid_h.unsqueeze(-1)], 1).view(B, 1, 1, 2)
            grid = (grid.unsqueeze(0).expand(B, -1, -1, -1) + 0.5) / scale
            props.append(torch.cat((grid, torch.ones_like(grid) * 0.05 * (2.0 ** level)), -1).view(B, -1, 4))
            start += h * w
        p = torch.cat(props, 1)
        ok = ((p > 0.01) & (p < 0.99)).all(-1, keepdim=True)
        p = torch.log(p / (1 - p)).masked_fill(pad_BS.unsqueeze(-1), float("inf")).masked_fill(~ok, float("inf"))
        q = x_BSD.masked_fill(pad_BS.unsqueeze(-1), 0.0).masked_fill(~ok, 0.0)
        return self.enc_output_norm(self.enc_output(q)), p


def proposal_pos_embed(coord_BQ4: torch.Tensor, d_model: int) -> torch.Tensor:
    """The sine embedding of proposal boxes (logits): ``d_model / 2`` features per coordinate, in fp32
    (transformers' ``get_proposal_pos_embed``) -> ``[B, Q, 2 d_model]``."""
    n = d_model // 2
    dim_t = torch.arange(n, dtype=torch.float32, device=coord_BQ4.device)
    dim_t = 10000 ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / n)
    pos = (coord_BQ4.sigmoid().to(torch.float32) * (2 * math.pi))[:, :, :, None] / dim_t
    pos = torch.stack((pos[:, :, :, 0::2].sin(), pos[:, :, :, 1::2].cos()), dim=4).flatten(2)
    return pos.to(coord_BQ4.dtype)


class DeformableDetrForObjectDetection(TransformersDetector, FastzooModel):
    """Deformable DETR with transformers' call convention (and its Trainer's asks: gradient checkpointing,
    ``num_parameters``)."""

    family = "deformable_detr"
    config_class = DeformableDetrConfig
    main_input_name = "pixel_values"
    sigmoid_classes = True  # one sigmoid per class, no "no object" logit (focal loss)
    eval_after_pretrained = True  # like transformers' from_pretrained
    # transformers' declaration of the heads one module serves (tie_word_embeddings): the layers after the first
    _tied_weights_keys = {r"bbox_embed.(?![0])\d+": "bbox_embed.0", r"class_embed.(?![0])\d+": "class_embed.0"}

    def __init__(self, cfg: DeformableDetrConfig):
        super().__init__()
        import transformers.modeling_outputs  # noqa: F401  (registers HF output classes as pytree nodes, see the decoders)

        self.config = cfg
        self.model = DeformableDetrModel(cfg)
        n = cfg.decoder_layers + 1 if cfg.two_stage else cfg.decoder_layers
        cls = [nn.Linear(cfg.d_model, cfg.num_labels) for _ in range(1 if cfg.shares_class_head() else n)]
        box = [DetrMLPPredictionHead(cfg.d_model, 4) for _ in range(1 if cfg.shares_box_head() else n)]
        self.class_embed = nn.ModuleList(cls * n if len(cls) == 1 else cls)  # one module n times: shared
        self.bbox_embed = nn.ModuleList(box * n if len(box) == 1 else box)
        self._tied_weights_keys = dict(self._tied_weights_keys)
        if cfg.with_box_refine:
            self.model.decoder.bbox_embed = self.bbox_embed
            self._tied_weights_keys["bbox_embed"] = "model.decoder.bbox_embed"
        if cfg.two_stage:
            self.model.decoder.class_embed = self.class_embed
            self._tied_weights_keys["class_embed"] = "model.decoder.class_embed"
        self._init_weights()
        if cfg.gradient_checkpointing:  # transformers' legacy config field, honoured as transformers does
            self.gradient_checkpointing_enable()

    def _init_weights(self):
        """transformers' init (a fresh model; never the compared state: tests draw every parameter)."""
        cfg = self.config
        init_outside_backbone(self)
        with torch.no_grad():
            for m in self.deformable_attentions():
                nn.init.zeros_(m.sampling_offsets.weight)
                m.sampling_offsets.bias.copy_(initial_offsets(m.heads, m.levels, m.points))
                nn.init.zeros_(m.attention_weights.weight)
                nn.init.zeros_(m.attention_weights.bias)
                nn.init.xavier_uniform_(m.value_proj.weight)
                nn.init.xavier_uniform_(m.output_proj.weight)
            if not cfg.two_stage:
                nn.init.xavier_uniform_(self.model.reference_points.weight)
            nn.init.normal_(self.model.level_embed)

    def encoder_inputs(self) -> list[nn.Module]:
        """The modules whose outputs the encoder reads: each feature level's input projection."""
        return list(self.model.input_proj)

    def attention_needs(self) -> dict:
        """The decoder's self-attention over the queries: no mask (the encoder's attention is deformable)."""
        return {"head_dim": self.config.d_model // self.config.decoder_attention_heads, "causal": False,
                "grid_2d": False, "padding_mask": False}

    @property
    def min_image_side(self) -> int:
        """The smallest image side (pixels) whose every feature level keeps two positions, so that one image
        alone passes each level's GroupNorm."""
        return min_image_side(self.config)

    def set_deformable_attention(self, impl: str = "auto") -> "DeformableDetrForObjectDetection":
        """The multi-scale deformable attention kernel of every layer (``fastzoo.attention.deformable``:
        reference | cpu | triton | auto), checked against this model's device and dtype now: an unknown or
        unavailable kernel is refused by name and nothing changes."""
        from fastzoo.attention.deformable import _kernel_name  # the seam's own choice and refusal, made now

        p = self.class_embed[0].weight
        _kernel_name(impl, p.device.type, p.dtype, False)
        for m in self.deformable_attentions():
            m.impl = impl
        return self

    def deformable_attentions(self) -> list[nn.Module]:
        """Every layer's multi-scale deformable attention module (``layers.py`` is imported when a model is
        built, as transformers is then: never when fastzoo is imported)."""
        from fastzoo.models.deformable_detr.layers import DeformableDetrMultiscaleDeformableAttention as MSDA

        return [m for m in self.modules() if isinstance(m, MSDA)]

    def heads(self, hs, refs):
        """Class logits ``[L, B, Q, C]`` and boxes ``[L, B, Q, 4]``: each layer's box head adds to its reference."""
        logits, boxes = [], []
        for level, (h, ref) in enumerate(zip(hs, refs)):
            ref = inverse_sigmoid(ref)
            delta = self.bbox_embed[level](h)
            if ref.shape[-1] == 4:
                delta = delta + ref
            else:
                delta = torch.cat([delta[..., :2] + ref, delta[..., 2:]], -1)
            logits.append(self.class_embed[level](h))
            boxes.append(delta.sigmoid())
        return torch.stack(logits), torch.stack(boxes)

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None, labels: list[dict] | None = None,
                return_dict: bool | None = None, **kwargs):
        """transformers' ``DeformableDetrForObjectDetection.forward``: ``pixel_values [B, 3, H, W]``,
        ``pixel_mask [B, H, W]`` (1 = a real pixel), ``labels`` as DETR's. Returns transformers'
        ``DeformableDetrObjectDetectionOutput``; ``return_dict=False`` gives its tuple."""
        from transformers.models.deformable_detr.modeling_deformable_detr import DeformableDetrObjectDetectionOutput

        from fastzoo.losses.set_prediction import check_labels, set_prediction_loss

        unknown = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: fastzoo's Deformable DETR takes pixel_values, pixel_mask, labels and "
                             f"return_dict (no per-layer attentions or hidden states, no precomputed embeddings)")
        pixel_values, pixel_mask = _check_pixels(pixel_values, pixel_mask, self.config.num_channels,
                                                 self.class_embed[0].weight)
        if labels is not None:  # refused before any work (a small image may not survive the strided levels)
            check_labels(labels, pixel_values.shape[0])
        if pixel_mask is None:
            B, _, H, W = pixel_values.shape
            pixel_mask = torch.ones(B, H, W, dtype=torch.long, device=pixel_values.device)
        hs, head_refs, refs, enc_class, enc_coord, memory = self.model(pixel_values, pixel_mask)
        logits_LBQC, boxes_LBQ4 = self.heads(hs, head_refs)
        loss = loss_dict = aux = None
        if labels is not None:
            loss_L = logits_LBQC if self.config.auxiliary_loss else logits_LBQC[-1:]
            boxes_L = boxes_LBQ4 if self.config.auxiliary_loss else boxes_LBQ4[-1:]
            loss, loss_dict = set_prediction_loss(loss_L, boxes_L, labels, self.config)
            if self.config.auxiliary_loss:
                aux = [{"logits": c, "pred_boxes": b} for c, b in zip(logits_LBQC[:-1], boxes_LBQ4[:-1])]
        out = DeformableDetrObjectDetectionOutput(
            loss=loss, loss_dict=loss_dict, logits=logits_LBQC[-1], pred_boxes=boxes_LBQ4[-1], auxiliary_outputs=aux,
            last_hidden_state=hs[-1], intermediate_hidden_states=torch.stack(hs, 1),
            intermediate_reference_points=torch.stack(refs, 1), init_reference_points=head_refs[0],
            encoder_last_hidden_state=memory, enc_outputs_class=enc_class, enc_outputs_coord_logits=enc_coord)
        return out if return_dict is not False else out.to_tuple()

    def hf_config(self):
        """This architecture as a ``transformers.DeformableDetrConfig``."""
        from fastzoo.models.deformable_detr.convert import hf_config

        return hf_config(self.config)

    def save_pretrained(self, path, **_hf_options):
        """A directory ``transformers.DeformableDetrForObjectDetection.from_pretrained`` and fastzoo both read
        (transformers' ``config.json`` and ``model.safetensors`` in its keys, which are this model's), written
        atomically. transformers' own options are accepted and ignored."""
        cfg = {**self.hf_config().to_dict(), "architectures": ["DeformableDetrForObjectDetection"]}
        return write_pretrained(path, cfg, self.state_dict(), weights_format="pt")
