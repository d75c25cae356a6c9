"""D-FINE (Peng et al. 2024, "D-FINE: Redefine Regression Task in DETRs as Fine-grained Distribution Refinement"),
as transformers' ``DFineForObjectDetection``: RT-DETR (``fastzoo.models.rt_detr``) with declared differences, under
transformers' module names, so that its state dicts load key for key, and its call convention.

What is RT-DETR's here: the query selection and the forward of ``RTDetrModel`` (projections, hybrid encoder,
anchors, top-k queries, denoising queries), the call and its checks (``RTDetrForObjectDetection.forward``), the
self-attention and its denoising groups. What differs: the HGNetV2 backbone (``backbone.py``), the encoder's blocks
(``encoder.py``), the decoder's distribution refinement (``decoder.py``), the decoder's input projections
(identities where the encoder's width is ``d_model``; every extra level from the coarsest map) and the loss: the set
loss's RT-DETR part with its distribution terms declared (``fastzoo.losses.set_prediction.rt_detr_loss`` with the
predicted corners: FGL and DDF on the auxiliary and denoising layers, boxes clamped to [0, 1]).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fastzoo.models.d_fine.config import DFineConfig
from fastzoo.models.rt_detr.model import RTDetrForObjectDetection, RTDetrModel, _projection


class DFineModel(RTDetrModel):
    """transformers' ``DFineModel``: RT-DETR's parts and forward with D-FINE's backbone, encoder and decoder."""

    def __init__(self, cfg: DFineConfig):
        from fastzoo.models.d_fine.backbone import HGNetV2Backbone
        from fastzoo.models.d_fine.decoder import DFineDecoder
        from fastzoo.models.d_fine.encoder import DFineHybridEncoder
        from fastzoo.models.rt_detr.backbone import RTDetrConvEncoder

        nn.Module.__init__(self)
        self.config = cfg
        d, eps = cfg.d_model, cfg.batch_norm_eps
        self.encode_and_select(cfg, RTDetrConvEncoder(cfg, HGNetV2Backbone), cfg.stage_out_channels, DFineHybridEncoder)
        cin, n = cfg.decoder_in_channels[-1], len(cfg.decoder_in_channels)
        self.decoder_input_proj = nn.ModuleList(
            nn.Identity() if d == cin else _projection(cin, d, eps, kernel_size=1 if level < n else 3, stride=1 if level < n else 2)
            for level in range(cfg.num_feature_levels))
        self.decoder = DFineDecoder(cfg)


class DFineForObjectDetection(RTDetrForObjectDetection):
    """D-FINE (``model_type="d_fine"``) with transformers' call convention."""

    family = "d_fine"
    config_class = DFineConfig

    def __init__(self, cfg: DFineConfig):
        from fastzoo.models.d_fine.encoder import DFineMLP

        super(RTDetrForObjectDetection, self).__init__()  # RT-DETR's parents; its parts are D-FINE's here
        import transformers.modeling_outputs  # noqa: F401  (registers HF output classes as pytree nodes, see the decoders)

        self.config = cfg
        self.model = DFineModel(cfg)
        d, L = cfg.d_model, cfg.decoder_layers
        self.class_embed = nn.ModuleList(nn.Linear(d, cfg.num_labels) for _ in range(L))
        self.bbox_embed = nn.ModuleList(DFineMLP(d, d, 4 * (cfg.max_num_bins + 1), 3) for _ in range(L))
        self.model.decoder.class_embed = self.class_embed  # the same modules under both names, as transformers
        self.model.decoder.bbox_embed = self.bbox_embed
        self._tied_weights_keys = {"class_embed": "model.decoder.class_embed", "bbox_embed": "model.decoder.bbox_embed"}
        self._init_weights()
        if cfg.gradient_checkpointing:  # transformers' legacy config field, honoured as transformers does
            self.gradient_checkpointing_enable()

    def _init_weights(self):
        """transformers' init of the heads, the gates, the quality estimates and the deformable attention (a fresh
        model; never the compared state: tests draw every parameter)."""
        cfg = self.config
        prior = 1 / (cfg.num_labels + 1)
        bias = float(-math.log((1 - prior) / prior))
        with torch.no_grad():
            for head in [*self.class_embed, self.model.enc_score_head]:
                nn.init.xavier_uniform_(head.weight)
                nn.init.constant_(head.bias, bias)
            last = [head.layers[-1] for head in self.bbox_embed] + [lqe.reg_conf.layers[-1] for lqe in self.model.decoder.lqe_layers]
            for layer in last:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
            for m in self.deformable_attentions():
                nn.init.zeros_(m.sampling_offsets.weight)
                thetas = torch.arange(m.heads, dtype=torch.float32) * (2.0 * math.pi / m.heads)
                grid = torch.stack([thetas.cos(), thetas.sin()], -1)
                grid = (grid / grid.abs().max(-1, keepdim=True).values).reshape(m.heads, 1, 2).tile([1, sum(m.points), 1])
                grid *= torch.cat([torch.arange(1, n + 1) for n in m.points]).reshape(1, -1, 1)
                m.sampling_offsets.bias.copy_(grid.flatten())
                nn.init.zeros_(m.attention_weights.weight)
                nn.init.zeros_(m.attention_weights.bias)
            for layer in self.model.decoder.layers:
                nn.init.zeros_(layer.gateway.gate.weight)
                nn.init.zeros_(layer.gateway.gate.bias)
            if cfg.num_denoising > 0:
                nn.init.xavier_uniform_(self.model.denoising_class_embed.weight)

    def deformable_attentions(self) -> list[nn.Module]:
        from fastzoo.models.d_fine.decoder import DFineMultiscaleDeformableAttention

        return [m for m in self.modules() if isinstance(m, DFineMultiscaleDeformableAttention)]

    def _loss(self, out: dict, labels, meta):
        """``(loss, loss_dict, auxiliary_outputs)``: the set loss's RT-DETR part with D-FINE's distribution terms,
        and transformers' auxiliary list (each earlier layer with its distributions and the last layer's as
        teacher, then the encoder's proposals)."""
        from fastzoo.losses.set_prediction import rt_detr_loss

        logits_BnQC, boxes_BnQ4, corners_BLQK, refs_BLQ4 = out["logits"], out["boxes"], out["corners"], out["refs"]
        loss, loss_dict = rt_detr_loss(logits_BnQC.transpose(0, 1), boxes_BnQ4.transpose(0, 1), labels, self.config,
                                       enc_topk_logits=out["enc_topk_logits"], enc_topk_bboxes=out["enc_topk_bboxes"],
                                       denoising_meta_values=meta, predicted_corners=corners_BLQK.transpose(0, 1),
                                       initial_reference_points=refs_BLQ4.transpose(0, 1))
        aux = None
        if self.config.auxiliary_loss:
            n = meta["dn_num_split"][0] if meta is not None else 0
            layers = min(logits_BnQC.shape[1], corners_BLQK.shape[1]) - 1
            teacher = dict(teacher_corners=corners_BLQK[:, -1, n:], teacher_logits=logits_BnQC[:, -1, n:])
            aux = [dict(logits=logits_BnQC[:, i, n:], pred_boxes=boxes_BnQ4[:, i, n:].clamp(min=0, max=1),
                        pred_corners=corners_BLQK[:, i, n:], ref_points=refs_BLQ4[:, i, n:], **teacher)
                   for i in range(layers)]
            aux.append({"logits": out["enc_topk_logits"], "pred_boxes": out["enc_topk_bboxes"].clamp(min=0, max=1)})
        return loss, loss_dict, aux

    def _output(self, loss, loss_dict, aux, out, return_dict):
        from transformers.models.d_fine.modeling_d_fine import DFineObjectDetectionOutput

        hs, logits, boxes = out["hs"], out["logits"], out["boxes"]
        o = DFineObjectDetectionOutput(
            loss=loss, loss_dict=loss_dict, logits=logits[:, -1], pred_boxes=boxes[:, -1], auxiliary_outputs=aux,
            last_hidden_state=hs[-1], intermediate_hidden_states=hs, intermediate_logits=logits,
            intermediate_reference_points=boxes, intermediate_predicted_corners=out["corners"],
            initial_reference_points=out["refs"], encoder_last_hidden_state=out["enc_maps"],
            init_reference_points=out["init_ref"], enc_topk_logits=out["enc_topk_logits"],
            enc_topk_bboxes=out["enc_topk_bboxes"], enc_outputs_class=out["enc_outputs_class"],
            enc_outputs_coord_logits=out["enc_outputs_coord_logits"],
            denoising_meta_values=out["dn"].meta if out["dn"] is not None else None)
        return o if return_dict is not False else o.to_tuple()

    def hf_config(self):
        """This architecture as a ``transformers.DFineConfig``."""
        from fastzoo.models.d_fine.convert import hf_config

        return hf_config(self.config)

    architecture = "DFineForObjectDetection"
