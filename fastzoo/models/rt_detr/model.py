"""RT-DETR (Zhao et al. 2024, "DETRs Beat YOLOs on Real-time Object Detection") and RT-DETRv2 (Lv et al.
2024), as transformers' ``RTDetrForObjectDetection`` / ``RTDetrV2ForObjectDetection``: their module names
(``model.backbone.model``, ``model.encoder_input_proj.N``, ``model.encoder.aifi.N``, ``model.encoder.fpn_blocks.N``,
``model.enc_score_head``, ``model.decoder.layers.N``, ``model.decoder.class_embed.N`` ...), so their state dicts
load key for key, and their call convention.

The pieces: the ResNet-vd backbone (``backbone.py``), the hybrid encoder (``encoder.py``), the decoder
(``decoder.py``) and the denoising queries (``denoising.py``). Here, as transformers 5.17 computes it:

- the backbone's maps through 1x1 conv + BatchNorm projections, the hybrid encoder, then the decoder's
  projections (one per ``decoder_in_channels``, those beyond the encoder's maps of the coarsest again;
  ``num_feature_levels`` beyond them: 3x3 stride-2 convs of the coarsest map);
- query selection: every token of every level gets an anchor box (its cell, side 0.05 x 2^level; invalid
  near the border) and, through ``enc_output``, a class score and a box refining its anchor; the
  ``num_queries`` best tokens are the decoder's queries (detached) and initial boxes;
- training with ``labels``: the denoising queries are prepended (``denoising.py``), the outputs carry them
  (``logits`` of ``[B, denoising + num_queries, C]``, as transformers') and the loss splits them;
- the loss is the set loss's RT-DETR part (``fastzoo.losses.set_prediction.rt_detr_loss``: varifocal,
  L1, GIoU on every layer, the encoder's top-k and the denoising groups).

``pixel_mask`` is accepted and, as in transformers, changes nothing (RT-DETR attends to every token).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fastzoo.attention.deformable import initial_offsets
from fastzoo.attention.base import AttnContext
from fastzoo.models.base import FastzooModel, write_pretrained
from fastzoo.models.detr.model import TransformersDetector, _check_pixels
from fastzoo.models.rt_detr.config import HybridDetrConfig, RTDetrConfig
from fastzoo.models.rt_detr.denoising import denoising_queries


def _projection(cin: int, d: int, eps: float, kernel_size: int = 1, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, d, kernel_size, stride=stride, padding=kernel_size // 2, bias=False),
                         nn.BatchNorm2d(d, eps))


def anchors(shapes, device, dtype, grid_size: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``generate_anchors``: per token its cell's centre and side ``grid_size * 2^level`` as
    logits ``[1, S, 4]`` (the dtype's largest value where a coordinate is within 0.01 of the border), and
    that validity ``[1, S, 1]``."""
    out = []
    for level, (h, w) in enumerate(shapes):
        gy, gx = torch.meshgrid(torch.arange(end=h, device=device).to(dtype), torch.arange(end=w, device=device).to(dtype),
                                indexing="ij")
        xy = torch.stack([gx, gy], -1).unsqueeze(0) + 0.5
        xy[..., 0] /= w
        xy[..., 1] /= h
        wh = torch.ones_like(xy) * grid_size * (2.0 ** level)
        out.append(torch.concat([xy, wh], -1).reshape(-1, h * w, 4))
    a = torch.concat(out, 1)
    valid = ((a > 1e-2) * (a < 1 - 1e-2)).all(-1, keepdim=True)
    a = torch.log(a / (1 - a))
    return torch.where(valid, a, torch.full((), torch.finfo(dtype).max, dtype=dtype, device=device)), valid


def fixed_anchor_shapes(cfg: RTDetrConfig, shapes) -> tuple[tuple[int, int], ...]:
    """Eval mode's anchors with ``anchor_image_size``: the maps of that size at ``feat_strides`` (transformers'
    cache), refused naming ``pixel_values`` where the images give another number of tokens (transformers fails on
    a size mismatch)."""
    h, w = cfg.anchor_image_size
    fixed = tuple((int(h / s), int(w / s)) for s in cfg.feat_strides)
    if sum(a * b for a, b in fixed) != sum(a * b for a, b in shapes):
        raise ValueError(f"pixel_values: in eval mode the anchors are those of anchor_image_size={tuple(cfg.anchor_image_size)} "
                         f"(maps {list(fixed)}), and these images give maps {list(shapes)}: use images of that size, "
                         f"train mode, or anchor_image_size=None (anchors from each batch's own maps)")
    return fixed


class RTDetrModel(nn.Module):
    """transformers' ``RTDetrModel``: backbone, projections, hybrid encoder, query selection, decoder."""

    def __init__(self, cfg: RTDetrConfig):
        # the layers are imported when a model is built, as transformers is then (its import pulls in
        # torchvision, whose registration of fastzoo's models would meet this module half-initialised)
        from fastzoo.models.rt_detr.backbone import RTDetrConvEncoder
        from fastzoo.models.rt_detr.decoder import RTDetrDecoder
        from fastzoo.models.rt_detr.encoder import RTDetrHybridEncoder

        super().__init__()
        self.config = cfg
        d, eps = cfg.d_model, cfg.batch_norm_eps
        self.encode_and_select(cfg, RTDetrConvEncoder(cfg), cfg.hidden_sizes, RTDetrHybridEncoder)
        proj = [_projection(c, d, eps) for c in cfg.decoder_in_channels]
        cin = cfg.decoder_in_channels[-1]
        for _ in range(cfg.num_feature_levels - len(proj)):
            proj.append(_projection(cin, d, eps, kernel_size=3, stride=2))
            cin = d
        self.decoder_input_proj = nn.ModuleList(proj)
        self.decoder = RTDetrDecoder(cfg)

    def encode_and_select(self, cfg, backbone: nn.Module, stage_widths, encoder_class) -> None:
        """The parts before the decoder's (D-FINE's too): the backbone, the encoder's input projections, the
        hybrid encoder, and the query selection's denoising embedding and heads."""
        from fastzoo.models.rt_detr.decoder import RTDetrMLPPredictionHead

        d = cfg.d_model
        self.backbone = backbone
        channels = [stage_widths[i - 1] for i in cfg.backbone_out_indices]
        # transformers' encoder input projections keep BatchNorm's default epsilon
        self.encoder_input_proj = nn.ModuleList(_projection(c, cfg.encoder_hidden_dim, 1e-5) for c in channels)
        self.encoder = encoder_class(cfg)
        if cfg.num_denoising > 0:
            self.denoising_class_embed = nn.Embedding(cfg.num_labels + 1, d, padding_idx=cfg.num_labels)
        self.enc_output = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d, eps=cfg.layer_norm_eps))
        self.enc_score_head = nn.Linear(d, cfg.num_labels)
        self.enc_bbox_head = RTDetrMLPPredictionHead(d, d, 4, num_layers=3)

    def sources(self, pixel_values):
        """The encoder's maps and the decoder's tokens ``[B, S, d_model]`` with their levels' shapes."""
        cfg = self.config
        maps = [proj(m) for proj, m in zip(self.encoder_input_proj, self.backbone(pixel_values))]
        enc_maps = self.encoder(maps)
        srcs = [proj(m) for proj, m in zip(self.decoder_input_proj, enc_maps)]
        for level in range(len(srcs), cfg.num_feature_levels):  # each from the coarsest map, as transformers
            srcs.append(self.decoder_input_proj[level](enc_maps[-1]))
        shapes = tuple(tuple(s.shape[-2:]) for s in srcs)
        tokens_BSD = torch.cat([s.flatten(2).transpose(1, 2) for s in srcs], 1)
        return enc_maps, tokens_BSD, shapes

    def forward(self, pixel_values, labels=None) -> dict:
        from fastzoo.models.deformable_detr.layers import Levels

        cfg = self.config
        enc_maps, mem_BSD, shapes = self.sources(pixel_values)
        device, dtype = mem_BSD.device, mem_BSD.dtype
        dn = None
        if self.training and cfg.num_denoising > 0 and labels is not None:
            dn = denoising_queries(labels, cfg.num_labels, cfg.num_queries, self.denoising_class_embed, cfg.num_denoising,
                                   cfg.label_noise_ratio, cfg.box_noise_scale)
        if self.training or cfg.anchor_image_size is None:
            anchor_1S4, valid_1S1 = anchors(shapes, device, dtype)
        else:
            anchor_1S4, valid_1S1 = anchors(fixed_anchor_shapes(cfg, shapes), device, dtype)
        out_mem = self.enc_output(valid_1S1.to(dtype) * mem_BSD)
        enc_class = self.enc_score_head(out_mem)
        enc_coord = self.enc_bbox_head(out_mem) + anchor_1S4
        top_BQ = torch.topk(enc_class.max(-1).values, cfg.num_queries, dim=1)[1]

        def pick(t):
            return t.gather(dim=1, index=top_BQ.unsqueeze(-1).repeat(1, 1, t.shape[-1]))

        ref_logit = pick(enc_coord)
        enc_topk_boxes, enc_topk_logits = ref_logit.sigmoid(), pick(enc_class)
        target = pick(out_mem).detach()
        if dn is not None:
            dn_class, dn_box, dn = dn
            ref_logit, target = torch.concat([dn_box, ref_logit], 1), torch.concat([dn_class, target], 1)
        out = self.decoder(target, ref_logit.detach(), mem_BSD, Levels.of(shapes, device), AttnContext(), dn)
        return dict(**out, enc_maps=enc_maps, init_ref=ref_logit.detach(),
                    enc_topk_logits=enc_topk_logits, enc_topk_bboxes=enc_topk_boxes, enc_outputs_class=enc_class,
                    enc_outputs_coord_logits=enc_coord, dn=dn)


def min_image_side(cfg: HybridDetrConfig) -> int:
    """Twice the stride of the coarsest level (each decoder level past the encoder's maps 2x more): the
    smallest side at which one image alone passes every BatchNorm in train mode."""
    return 2 * cfg.map_strides[-1] * 2 ** (cfg.num_feature_levels - len(cfg.backbone_out_indices))


def _check_side(pixel_values, cfg: HybridDetrConfig, training: bool) -> None:
    """ValueError naming ``pixel_values`` where the backbone's maps do not halve exactly from one encoder level
    to the next (the FPN upsamples each 2x onto the finer one; transformers fails there on a size mismatch).
    Every convolution and pool rounds up, so a map of stride ``s`` has side ``ceil(side / s)``."""
    strides = cfg.map_strides
    for side in pixel_values.shape[-2:]:
        sizes = [-(-side // s) for s in strides]
        if any(fine != 2 * coarse for fine, coarse in zip(sizes, sizes[1:])):
            raise ValueError(f"pixel_values: {tuple(pixel_values.shape[-2:])} images give feature maps of sides {sizes}, "
                             f"which do not halve exactly from level to level as RT-DETR's encoder needs: use sides "
                             f"that are multiples of {strides[-1]} (image_side_multiple)")
    coarsest = min_image_side(cfg) // 2
    if training and pixel_values.shape[0] == 1 and all(side <= coarsest for side in pixel_values.shape[-2:]):
        raise ValueError(f"pixel_values: one {tuple(pixel_values.shape[-2:])} image leaves the coarsest feature level a "
                         f"single position, which BatchNorm cannot normalise in train mode: use images of at least "
                         f"{min_image_side(cfg)} px (min_image_side), batches of 2 or eval mode")


class RTDetrForObjectDetection(TransformersDetector, FastzooModel):
    """RT-DETR (``model_type="rt_detr"``) or RT-DETRv2 (``"rt_detr_v2"``) with transformers' call convention
    (and its Trainer's asks: gradient checkpointing of AIFI's and the decoder's layers, ``num_parameters``)."""

    family = "rt_detr"
    config_class = RTDetrConfig
    main_input_name = "pixel_values"
    sigmoid_classes = True  # one sigmoid per class, no "no object" logit
    eval_after_pretrained = True  # like transformers' from_pretrained

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        import transformers.modeling_outputs  # noqa: F401  (registers HF output classes as pytree nodes, see the decoders)

        self.config = cfg
        self.model = RTDetrModel(cfg)
        if cfg.v2:  # transformers' V2 holds the decoder's heads at the top too (the same modules), and declares it
            self.class_embed = self.model.decoder.class_embed
            self.bbox_embed = self.model.decoder.bbox_embed
            self._tied_weights_keys = {"class_embed": "model.decoder.class_embed", "bbox_embed": "model.decoder.bbox_embed"}
        self._init_weights()
        if cfg.gradient_checkpointing:  # transformers' legacy config field, honoured as transformers does
            self.gradient_checkpointing_enable()

    def _init_weights(self):
        """transformers' init of the heads and the deformable attention (a fresh model; never the compared
        state: tests draw every parameter)."""
        cfg = self.config
        prior = 1 / (cfg.num_labels + 1)
        bias = float(-math.log((1 - prior) / prior))
        with torch.no_grad():
            for head in [*self.model.decoder.class_embed, self.model.enc_score_head]:
                nn.init.xavier_uniform_(head.weight)
                nn.init.constant_(head.bias, bias)
            for head in self.model.decoder.bbox_embed:
                nn.init.zeros_(head.layers[-1].weight)
                nn.init.zeros_(head.layers[-1].bias)
            for m in self.deformable_attentions():
                nn.init.zeros_(m.sampling_offsets.weight)
                m.sampling_offsets.bias.copy_(initial_offsets(m.heads, m.levels, m.points))
                for lin in (m.attention_weights, m.value_proj, m.output_proj):
                    nn.init.zeros_(lin.bias)
                nn.init.zeros_(m.attention_weights.weight)
                nn.init.xavier_uniform_(m.value_proj.weight)
                nn.init.xavier_uniform_(m.output_proj.weight)
            if cfg.num_denoising > 0:
                nn.init.xavier_uniform_(self.model.denoising_class_embed.weight)

    def checkpoint_stacks(self) -> list[nn.ModuleList]:
        """AIFI's layers (per encoded map) and the decoder's: the hybrid encoder's convolutions keep their
        activations, as the backbone's (BatchNorm in train mode would count a recomputed batch twice)."""
        return [*(aifi.layers for aifi in self.model.encoder.aifi), self.model.decoder.layers]

    def encoder_inputs(self) -> list[nn.Module]:
        """The modules whose outputs the hybrid encoder reads: each backbone map's input projection."""
        return list(self.model.encoder_input_proj)

    def attention_needs(self) -> dict:
        """AIFI's and the decoder's self-attention: unmasked (the denoising groups run as unmasked calls)."""
        cfg = self.config
        head_dim = max(cfg.encoder_hidden_dim // cfg.encoder_attention_heads, cfg.d_model // cfg.decoder_attention_heads)
        return {"head_dim": head_dim, "causal": False, "grid_2d": False, "padding_mask": False}

    @property
    def image_side_multiple(self) -> int:
        """Image sides that are multiples of this (the coarsest backbone map's stride) halve exactly from
        map to map, as the encoder needs (others are refused, naming them)."""
        return self.config.map_strides[-1]

    @property
    def min_image_side(self) -> int:
        """The smallest image side (pixels) whose every feature level keeps two positions, so that one image
        alone passes each BatchNorm in train mode (a multiple of ``image_side_multiple``)."""
        return min_image_side(self.config)

    def set_deformable_attention(self, impl: str = "auto") -> "RTDetrForObjectDetection":
        """The decoder's multi-scale deformable attention kernel (``fastzoo.attention.deformable``:
        reference | cpu | triton | auto), checked against this model's device and dtype now: an unknown or
        unavailable kernel is refused by name and nothing changes (RT-DETRv2's discrete sampling runs on
        the reference whatever is set, as the seam says)."""
        from fastzoo.attention.deformable import _kernel_name  # the seam's own choice and refusal, made now

        p = self.model.enc_score_head.weight
        _kernel_name(impl, p.device.type, p.dtype, False)
        for m in self.deformable_attentions():
            m.impl = impl
        return self

    def deformable_attentions(self) -> list[nn.Module]:
        from fastzoo.models.rt_detr.decoder import RTDetrMultiscaleDeformableAttention

        return [m for m in self.modules() if isinstance(m, RTDetrMultiscaleDeformableAttention)]

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None, labels: list[dict] | None = None,
                return_dict: bool | None = None, **kwargs):
        """transformers' ``RTDetrForObjectDetection.forward``: ``pixel_values [B, 3, H, W]``, ``pixel_mask``
        (unused, as transformers), ``labels`` as DETR's. Returns transformers' output class;
        ``return_dict=False`` gives its tuple."""
        from fastzoo.losses.set_prediction import check_labels
        from fastzoo.models.base import statistics_kept_on_error

        unknown = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: fastzoo's {self.architecture} takes pixel_values, pixel_mask, "
                             f"labels and return_dict (no per-layer attentions or hidden states, no precomputed embeddings)")
        pixel_values, pixel_mask = _check_pixels(pixel_values, pixel_mask, self.config.num_channels,
                                                 self.model.enc_score_head.weight)
        _check_side(pixel_values, self.config, self.training)
        if labels is None:
            return self._output(None, None, None, self.model(pixel_values), return_dict)
        check_labels(labels, pixel_values.shape[0])  # the denoising queries read their structure: refused before any work
        # their values come back with the set loss's one host read: a refusal then puts BatchNorm's statistics back
        with statistics_kept_on_error(self):
            out = self.model(pixel_values, labels)
            meta = out["dn"].meta if out["dn"] is not None and self.training else None
            loss, loss_dict, aux = self._loss(out, labels, meta)
        return self._output(loss, loss_dict, aux, out, return_dict)

    def _loss(self, out: dict, labels, meta):
        """``(loss, loss_dict, auxiliary_outputs)``: the set loss's RT-DETR part and transformers' auxiliary list."""
        from fastzoo.losses.set_prediction import rt_detr_loss

        logits_BLQC, boxes_BLQ4 = out["logits"], out["boxes"]
        loss, loss_dict = rt_detr_loss(logits_BLQC.transpose(0, 1), boxes_BLQ4.transpose(0, 1), labels, self.config,
                                       enc_topk_logits=out["enc_topk_logits"], enc_topk_bboxes=out["enc_topk_bboxes"],
                                       denoising_meta_values=meta)
        aux = None
        if self.config.auxiliary_loss:
            n = meta["dn_num_split"][0] if meta is not None else 0
            aux = [{"logits": logits_BLQC[:, i, n:], "pred_boxes": boxes_BLQ4[:, i, n:]}
                   for i in range(logits_BLQC.shape[1] - 1)]
            aux.append({"logits": out["enc_topk_logits"], "pred_boxes": out["enc_topk_bboxes"]})
        return loss, loss_dict, aux

    def _output(self, loss, loss_dict, aux, out, return_dict):
        if self.config.v2:
            from transformers.models.rt_detr_v2.modeling_rt_detr_v2 import RTDetrV2ObjectDetectionOutput as Output
        else:
            from transformers.models.rt_detr.modeling_rt_detr import RTDetrObjectDetectionOutput as Output
        hs, logits, boxes = out["hs"], out["logits"], out["boxes"]
        o = Output(loss=loss, loss_dict=loss_dict, logits=logits[:, -1], pred_boxes=boxes[:, -1], auxiliary_outputs=aux,
                   last_hidden_state=hs[:, -1], intermediate_hidden_states=hs, intermediate_logits=logits,
                   intermediate_reference_points=boxes, encoder_last_hidden_state=out["enc_maps"],
                   init_reference_points=out["init_ref"], enc_topk_logits=out["enc_topk_logits"],
                   enc_topk_bboxes=out["enc_topk_bboxes"], enc_outputs_class=out["enc_outputs_class"],
                   enc_outputs_coord_logits=out["enc_outputs_coord_logits"],
                   denoising_meta_values=out["dn"].meta if out["dn"] is not None else None)
        return o if return_dict is not False else o.to_tuple()

    @property
    def architecture(self) -> str:
        """transformers' class name, as ``config.json``'s ``architectures`` gives it."""
        return "RTDetrV2ForObjectDetection" if self.config.v2 else "RTDetrForObjectDetection"

    def hf_config(self):
        """This architecture as a ``transformers.RTDetrConfig`` / ``RTDetrV2Config``."""
        from fastzoo.models.rt_detr.convert import hf_config

        return hf_config(self.config)

    def save_pretrained(self, path, **_hf_options):
        """A directory transformers' ``from_pretrained`` and fastzoo both read (transformers' ``config.json`` and
        ``model.safetensors`` in its keys, which are this model's), written atomically. transformers' own
        options are accepted and ignored."""
        cfg = {**self.hf_config().to_dict(), "architectures": [self.architecture]}
        return write_pretrained(path, cfg, self.state_dict(), weights_format="pt")
