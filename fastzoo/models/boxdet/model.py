"""A set-prediction box detector on a ResNet: DETR's head and loss without its transformer.

The backbone is any of the ResNet family's sizes (config fields ``block``, ``layers``,
``channels``, ``groups``, ``width_per_group``, as ``ResNetConfig``'s; ResNet-50 by default):
``fastzoo.create("boxdet_r50", **fastzoo.registry.get_entry("resnext50_32x4d").config)``, or read from
the checkpoint given as ``pretrained=``. The head projects the backbone's C5 channels.

After Carion et al. 2020, "End-to-End Object Detection with Transformers" (DETR): a fixed
set of ``num_queries`` learned queries each predicts one box and a class among
``num_classes`` + "no object"; training matches predictions to targets one-to-one and
applies class cross-entropy (no-object down-weighted by ``eos_coef``) + L1 + GIoU on the
matched pairs, normalised by the number of target boxes. Names follow DETR's code
(``input_proj``, ``query_embed``, ``class_embed``, ``bbox_embed``, ``eos_coef``,
``cost_class/bbox/giou``).

Why this head. DETR's 6+6-layer transformer is what makes it slow to train; what the
box losses need is only a fixed-size set of boxes per image. Here each query pools the
projected C5 features with one single-head attention (query . (feature + sine position))
-- enough to localise, a few lines, and it keeps the matcher/loss exactly DETR's. It
calls ``F.scaled_dot_product_attention`` directly: it is a 1-query-token pooling, not a
layer worth a swappable backend, so ``set_attention`` changes nothing on this model.

Box parametrisation. DETR predicts sigmoid (cx, cy, w, h) and converts to xyxy as
``cx -/+ w/2``, which can leave [0, 1] (a centre near the border with a large width).
We keep the sigmoid but read its four outputs as (u_x, u_y, w, h): the box spans
``x1 = u_x * (1 - w)`` to ``x2 = x1 + w`` -- the centre ranges over exactly the positions
where a box of that width fits. So every predicted box is xyxy in [0, 1] with x2 >= x1
and y2 >= y1 by construction (valid GIoU inputs; no clamp, so no dead gradients).

Frozen backbone BatchNorm (``frozen_bn=True``, the default), as DETR's backbone
(torchvision's ``FrozenBatchNorm2d``): detection batches are a few large images per device,
too few for batch statistics, so the ImageNet statistics and BN affine parameters are kept.
It also makes the detector the same function of each image whatever the batch split: one
process and N processes on the same global batch compute the same loss and gradients.
``frozen_bn=False`` trains BN with per-process statistics (``--sync-bn`` in
``scripts/train_boxdet.py`` syncs them on CUDA).

Targets: ``model.loss(outputs, targets, labels=None)`` with ``targets`` a list of
``[n_i, 4]`` xyxy boxes in [0, 1] (n_i may be 0) and ``labels`` an optional list of
``[n_i]`` int class ids (default: class 0), or a :class:`fastzoo.losses.boxes.BoxTargets`
from the collator (already validated, all layouts built on the CPU).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.losses.boxes import BoxTargets, collate_boxes, matched_giou_sum
from fastzoo.losses.giou import generalized_box_iou
from fastzoo.models.base import FastzooModel
from fastzoo.models.boxdet.config import BoxDetConfig
from fastzoo.models.resnet import ResNet


class MLP(nn.Module):
    """DETR's box head: Linear layers with ReLU between."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:] + [out_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


def sine_position_embedding(H: int, W: int, dim: int, device=None) -> torch.Tensor:
    """DETR's 2-D sine embedding [H*W, dim] (normalised coordinates, temperature 10000)."""
    n = dim // 4
    freq = 10000 ** (-torch.arange(n, device=device, dtype=torch.float32) / n)
    y = (torch.arange(H, device=device, dtype=torch.float32) + 0.5) / H * 2 * math.pi
    x = (torch.arange(W, device=device, dtype=torch.float32) + 0.5) / W * 2 * math.pi
    ey, ex = y[:, None] * freq, x[:, None] * freq  # [H, n], [W, n]
    ey = torch.cat([ey.sin(), ey.cos()], -1)[:, None, :].expand(H, W, 2 * n)
    ex = torch.cat([ex.sin(), ex.cos()], -1)[None, :, :].expand(H, W, 2 * n)
    pos = torch.cat([ey, ex], -1).reshape(H * W, 4 * n)
    return F.pad(pos, (0, dim - 4 * n))


def boxes_from_sigmoid(s_BQ4: torch.Tensor) -> torch.Tensor:
    """(u_x, u_y, w, h) in (0, 1) -> xyxy inside [0, 1] (see the module docstring)."""
    u, wh = s_BQ4[..., :2], s_BQ4[..., 2:]
    lo = u * (1 - wh)
    return torch.cat([lo, lo + wh], -1)


class BoxDetector(FastzooModel):
    family = "boxdet"
    config_class = BoxDetConfig

    def __init__(self, cfg: BoxDetConfig):
        super().__init__()
        self.config = cfg
        D = cfg.hidden_dim
        self.backbone = ResNet(cfg.backbone_config())
        self.input_proj = nn.Conv2d(self.backbone.config.num_features, D, 1)
        self.query_embed = nn.Embedding(cfg.num_queries, D)
        self.class_embed = nn.Linear(D, cfg.num_classes + 1)
        self.bbox_embed = MLP(D, D, 4, 3)
        if cfg.channels_last:
            self.input_proj.to(memory_format=torch.channels_last)

    def load_backbone(self, source) -> None:
        """Load a ResNet checkpoint (any ``pretrained=`` source: torchvision / timm module or
        file, fastzoo directory) into the backbone, strictly; its classifier ``fc`` is dropped."""
        from fastzoo import weights
        from fastzoo.models.resnet.spec import SPEC as RESNET

        src = weights.read_source(source)
        state = {k: v for k, v in weights.to_fastzoo(RESNET, src).items() if not k.startswith("fc.")}
        weights.load_into(self.backbone, state, src.origin)
        cfg = weights.pretrained_cfg_of(src)
        if cfg:  # the backbone's preprocessing is the checkpoint's (timm's resolve_data_config(model=det.backbone))
            self.backbone.pretrained_cfg = cfg

    def forward(self, images_BCHW: torch.Tensor) -> dict[str, torch.Tensor]:
        f_BDHW = self.input_proj(self.backbone.forward_features(images_BCHW))
        B, D, H, W = f_BDHW.shape
        mem_BSD = f_BDHW.flatten(2).transpose(1, 2)
        key_BSD = mem_BSD + sine_position_embedding(H, W, D, f_BDHW.device).to(mem_BSD.dtype)
        q_BQD = self.query_embed.weight.expand(B, -1, -1)
        # one head: [B, 1, Q, D] queries pool [B, 1, S, D] features
        pooled_BQD = F.scaled_dot_product_attention(q_BQD[:, None], key_BSD[:, None], mem_BSD[:, None])[:, 0]
        h_BQD = pooled_BQD + q_BQD
        return {"boxes": boxes_from_sigmoid(self.bbox_embed(h_BQD).sigmoid()), "logits": self.class_embed(h_BQD)}

    # -- training ----------------------------------------------------------------------
    def _targets(self, targets, labels, B: int) -> BoxTargets:
        if isinstance(targets, BoxTargets):
            if labels is not None:
                raise ValueError("labels= goes with a list of box tensors; BoxTargets already carries its labels")
            tb = targets
        elif isinstance(targets, (list, tuple)):
            # boxes, their [0, 1] scale (not pixels) and the labels: checked in one host read
            tb = collate_boxes(list(targets), labels, num_classes=self.config.num_classes, normalized=True)
        else:
            raise ValueError(f"targets must be a list of [n_i, 4] tensors or a BoxTargets, not {type(targets).__name__}")
        if len(tb) != B:
            raise ValueError(f"targets has {len(tb)} images but the outputs have {B}")
        C = self.config.num_classes
        checked = tb.checked_classes is not None and tb.checked_classes <= C  # by the collator, on the CPU
        if tb.num_boxes and not checked and bool(((tb.labels < 0) | (tb.labels >= C)).any()):  # else CE reads "no object"
            raise ValueError(f"labels must be class ids in [0, {C}), got values {tb.labels.unique().tolist()}")
        if tb.num_boxes and max(tb.counts) > self.config.num_queries:
            raise ValueError(f"an image has {max(tb.counts)} target boxes, more than num_queries={self.config.num_queries}")
        return tb

    @torch.no_grad()
    def match(self, outputs: dict, targets: BoxTargets) -> torch.Tensor:
        """For each target box (concatenated order), the index of its query [N].

        DETR's cost (class probability, L1, GIoU) is computed on the device for each image
        against its own boxes only, in the padded layout ``[B, Q, M]`` (M = most boxes in an
        image), and copied to the host once per batch for scipy's Hungarian solver; the
        assignment goes back in one copy. (DETR's reference matcher builds every query against
        every box of the batch, ``[B*Q, N]``, and slices it per image: B times the work and
        the transfer.)"""
        if self.config.matcher == "order" or targets.num_boxes == 0:
            return targets.slot  # target i of an image <-> query i
        from scipy.optimize import linear_sum_assignment

        boxes_BQ4, logits_BQC = outputs["boxes"].float(), outputs["logits"].float()
        Q, c = boxes_BQ4.shape[1], self.config
        target_BM4 = targets.padded.float()
        labels_BQM = targets.padded_labels.clamp_min(0)[:, None, :].expand(-1, Q, -1)  # padding: any class
        cost_class = -logits_BQC.softmax(-1).gather(2, labels_BQM)
        cost_bbox = torch.cdist(boxes_BQ4, target_BM4, p=1)
        cost_giou = -generalized_box_iou(boxes_BQ4, target_BM4)
        cost_BQM = (c.cost_bbox * cost_bbox + c.cost_class * cost_class + c.cost_giou * cost_giou).cpu().numpy()
        query = torch.empty(targets.num_boxes, dtype=torch.long)
        start = 0
        for b, n in enumerate(targets.counts):  # real boxes come first in each padded row
            rows, cols = linear_sum_assignment(cost_BQM[b, :, :n])
            query[start + torch.as_tensor(cols, dtype=torch.long)] = torch.as_tensor(rows, dtype=torch.long)
            start += n
        return query.to(boxes_BQ4.device, non_blocking=True)

    def loss_components(self, outputs: dict, targets, labels=None, *, num_images=None, num_boxes=None) -> dict[str, torch.Tensor]:
        """``{"loss", "loss_ce", "loss_bbox", "loss_giou"}``; ``loss`` is the weighted sum.

        DETR's normalisation: the class CE is the mean over all queries weighted by target class
        (no object: ``eos_coef``), i.e. divided by ``eos_coef * num_images * Q + (1 - eos_coef) *
        num_boxes``; L1 and GIoU are sums over the matched boxes divided by ``num_boxes`` (at least 1).
        Both default to this call's batch. Under data parallelism pass the whole batch's counts
        (all-reduced; tensors are fine, no host sync): each process's loss is then its share of
        the whole batch's loss and the shares sum to it, so N processes compute the same function
        as one (DETR all-reduces ``num_boxes`` for the same reason).
        """
        boxes_BQ4, logits_BQC = outputs["boxes"], outputs["logits"]
        B, Q = boxes_BQ4.shape[:2]
        C = self.config.num_classes
        tb = self._targets(targets, labels, B)
        query_N = self.match(outputs, tb)
        matched_N4 = boxes_BQ4[tb.batch_index, query_N]
        target_classes_BQ = torch.full((B, Q), C, dtype=torch.long, device=logits_BQC.device)
        target_classes_BQ[tb.batch_index, query_N] = tb.labels
        weight = torch.ones(C + 1, device=logits_BQC.device)
        weight[C] = self.config.eos_coef
        c = self.config
        num_images = B if num_images is None else num_images
        num_boxes = tb.num_boxes if num_boxes is None else num_boxes
        ce_weight = c.eos_coef * num_images * Q + (1 - c.eos_coef) * num_boxes  # sum of the CE weights over queries
        num_boxes = num_boxes.clamp_min(1) if isinstance(num_boxes, torch.Tensor) else max(num_boxes, 1)
        loss_ce = F.cross_entropy(logits_BQC.float().transpose(1, 2), target_classes_BQ, weight, reduction="sum") / ce_weight
        loss_bbox = F.l1_loss(matched_N4.float(), tb.boxes.float(), reduction="sum") / num_boxes
        loss_giou = matched_giou_sum(self.config.loss, boxes_BQ4, matched_N4, query_N, tb) / num_boxes
        total = c.loss_ce * loss_ce + c.loss_bbox * loss_bbox + c.loss_giou * loss_giou
        return {"loss": total, "loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou}

    def loss(self, outputs: dict, targets, labels=None, *, num_images=None, num_boxes=None) -> torch.Tensor:
        """Class CE (no-object weighted) + L1 + GIoU on matched pairs, per target box
        (``num_images`` / ``num_boxes``: see :meth:`loss_components`)."""
        return self.loss_components(outputs, targets, labels, num_images=num_images, num_boxes=num_boxes)["loss"]
