"""The set-prediction loss of the DETR family (Carion et al. 2020), one loss whose detectors declare
their parts: the matcher's cost (:class:`~fastzoo.losses.set_matching.MatchCost`), the classification
term (:class:`ClassTerm`), which stacks of layers are matched and how (Hungarian, or by index for
denoising groups), and how the terms are named and weighted -- each exactly as transformers' loss of
that detector (``ImageLoss``, ``DeformableDetrImageLoss``, ``RTDetrLoss``):

- matched pairs: ``loss_bbox`` L1 in cxcywh and ``loss_giou`` 1 - GIoU (xyxy), each summed over the
  matched pairs and divided by the batch's box count (at least 1; times the groups for denoising);
- classification, one of :data:`CLASS_TERMS`: ``ce`` (DETR) cross-entropy over every query, unmatched
  ones target "no object" (the last class) with weight ``eos_coefficient``, a weighted mean; ``focal``
  (Deformable DETR) the sigmoid focal loss (gamma 2, ``alpha``) of every query against its one-hot
  matched class, summed over queries and classes, divided by the box count; ``varifocal`` (RT-DETR,
  Zhang et al. 2021) binary cross-entropy against the IoU-aware target ``IoU(matched pair) x one-hot``
  (the IoU of the detached prediction), weighted ``alpha p^gamma`` on the negatives and the target on
  the positive, normalised as ``focal``; ``iou_aware`` (LW-DETR, RF-DETR) BCE of every query and class,
  the matched class's target ``p^alpha IoU^(1-alpha)`` (at least 0.01, no gradient) weighting ``-log p`` and
  one minus it ``-log(1-p)``, every other ``p^2`` (with its gradient) weighting ``-log(1-p)``; summed, over
  the box count.

:func:`set_prediction_loss` is DETR's and Deformable DETR's (``loss_ce`` ..., ``cardinality_error``,
auxiliary layers suffixed ``_0`` ... ``_{L-2}``, ``loss`` = sum of the layers' ``loss_ce +
bbox_loss_coefficient x loss_bbox + giou_loss_coefficient x loss_giou``); :func:`rt_detr_loss` is
RT-DETR's (``loss_vfl``, ``loss_bbox``, ``loss_giou`` already weighted; ``_aux_{i}`` for the decoder
layers and the encoder's proposals, ``_dn_{i}`` for the denoising groups; ``loss`` = their sum);
:func:`lw_detr_loss` is LW-DETR's and RF-DETR's (``loss_ce``, ``loss_bbox``, ``loss_giou``,
``cardinality_error``; ``_{i}`` for the earlier decoder layers, ``_enc`` for the encoder's proposals; the
queries matched per Group-DETR group, the box count times the groups).

How it runs. transformers computes one ``[B*Q, N]`` cost for the whole batch per layer (every
query against every image's boxes), the GIoU loss as the diagonal of an ``N x N`` matrix, and
reads the device a few times per layer (a cost copy and box checks; the counts:
benchmarks/results/cpu-2core/README.md, "DETR: the set loss"). Here: targets padded to ``[B, M]``,
the cost of every layer at once per image, one host read per step that carries every Hungarian-matched
layer's costs and the target checks together (:mod:`fastzoo.losses.set_matching`), denoising matched
by index (no read), and the GIoU term of every matched pair of every layer in one call, as
``giou_impl`` says (:data:`GIOU_IMPLS`). An image may have no boxes, or more boxes than queries (then,
as transformers, ``Q`` of them are matched). Errors: see :mod:`fastzoo.losses.set_matching`; bad
predictions or denoising metadata name the argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from fastzoo.kernel_ranges import kernel_range
from fastzoo.losses.giou import PAD_BOX, giou_loss_concat, giou_loss_padded, giou_loss_per_sample
from fastzoo.losses.registry import Loss
from fastzoo.losses.set_matching import (
    MatchCost,
    PaddedTargets,
    by_index,
    center_to_corners,
    check_labels,
    hungarian,
    pad_targets,
    paired_iou,
)

__all__ = ["CLASS_TERMS", "GIOU_IMPLS", "ClassTerm", "check_labels", "lw_detr_loss", "rt_detr_loss",
           "set_prediction_loss"]

# how the GIoU term runs: ``giou_impl=`` of the loss, DETR's config field of that name, the bench's cases
GIOU_IMPLS = {"per_sample": "GIoU term in a loop over images", "concat": "GIoU term on the gathered pairs",
              "padded": "GIoU term on the padded pairs, plain ops",
              "kernel": "GIoU term through the fused padded op (no gather, no host sync)"}
CLASS_TERMS = {"ce": "softmax cross-entropy with a 'no object' class (DETR)",
               "focal": "sigmoid focal loss (Deformable DETR)",
               "varifocal": "sigmoid varifocal loss, IoU-aware targets (RT-DETR)",
               "iou_aware": "sigmoid BCE with IoU-aware positive targets (LW-DETR, RF-DETR)"}


@dataclass(frozen=True)
class ClassTerm:
    """The classification term (one of :data:`CLASS_TERMS`) and its constants: ``eos_coefficient``
    (``ce``), ``alpha`` (``focal``: the positives' weight; ``varifocal``: the negatives'; ``iou_aware``: the
    probability's exponent in the target), ``gamma``."""

    kind: str = "ce"
    eos_coefficient: float = 0.1
    alpha: float = 0.25
    gamma: float = 2.0


@dataclass
class _Stack:
    """Layers of predictions ``[L, B, Q, ...]`` with their match: the query of each target slot
    ``query_LBS`` (-1: none), the slots' boxes and class ids ``[B, S]``, the terms' normaliser."""

    logits_LBQC: Tensor
    boxes_LBQ4: Tensor
    query_LBS: Tensor
    boxes_BS4: Tensor
    labels_BS: Tensor
    n: float


def set_prediction_loss(logits_LBQC: Tensor, boxes_LBQ4: Tensor, labels, config=None, *, num_classes: int | None = None,
                        class_cost: float = 1.0, bbox_cost: float = 5.0, giou_cost: float = 2.0,
                        bbox_loss_coefficient: float = 5.0, giou_loss_coefficient: float = 2.0,
                        eos_coefficient: float = 0.1, giou_impl: str = "kernel", num_boxes=None,
                        focal_alpha: float | None = None) -> tuple[Tensor, dict]:
    """DETR's and Deformable DETR's ``(loss, loss_dict)`` of L decoder layers' predictions (the last is the
    final output, the others auxiliary): ``logits_LBQC [L, B, Q, C+1]``, ``boxes_LBQ4 [L, B, Q, 4]`` (cx, cy,
    w, h); ``labels`` as transformers'. A ``config`` with transformers' field names (``num_labels``,
    ``class_cost`` ..., ``eos_coefficient``, ``giou_impl``, and ``focal_alpha`` where the model has one) sets
    them all. ``num_boxes``: the normaliser (e.g. all-reduced over processes); default this batch's box
    count. ``focal_alpha``: the classification is per-class sigmoids (``logits [L, B, Q, C]``, no "no object"
    class) with the focal term and Deformable DETR's matcher (focal cost, alpha 0.25 and gamma 2 whatever
    the loss's alpha)."""
    if config is not None:
        num_classes, class_cost, bbox_cost, giou_cost = config.num_labels, config.class_cost, config.bbox_cost, config.giou_cost
        bbox_loss_coefficient, giou_loss_coefficient = config.bbox_loss_coefficient, config.giou_loss_coefficient
        eos_coefficient, giou_impl = config.eos_coefficient, config.giou_impl
        focal_alpha = getattr(config, "focal_alpha", None)  # a config of a sigmoid-classified detector declares it
    _check_giou_impl(giou_impl)
    with kernel_range("loss", "set_prediction_loss", giou_impl):  # for fastzoo.explain; a no-op otherwise
        _check_predictions(logits_LBQC, boxes_LBQ4)
        L, B, Q, C1 = logits_LBQC.shape
        extra = 0 if focal_alpha is not None else 1  # softmax: a last "no object" class; sigmoids: none
        C = C1 - extra if num_classes is None else num_classes
        if C1 != C + extra:
            raise ValueError(f"logits have {C1} classes; num_classes={C} needs {C + extra}"
                             f"{' (the last: no object)' if extra else ' (sigmoid classes, focal loss)'}")
        t = pad_targets(labels, B, logits_LBQC.device)
        cost = MatchCost(class_cost, bbox_cost, giou_cost, None if focal_alpha is None else (0.25, 2.0))
        term = ClassTerm("ce", eos_coefficient) if focal_alpha is None else ClassTerm("focal", alpha=focal_alpha)
        (query_LBM,) = hungarian([(logits_LBQC, boxes_LBQ4)], t, cost, C)
        n = max(t.num_boxes, 1) if num_boxes is None else num_boxes
        stack = _Stack(logits_LBQC, boxes_LBQ4, query_LBM, t.boxes_BM4, t.labels_BM, n)
        pairs = [_pairs(stack)]
        ((loss_ce, loss_bbox),), (loss_giou,) = _class_and_l1([stack], pairs, term, C), _giou_sums(giou_impl, pairs)

        card = _cardinality_error(logits_LBQC, t, None if focal_alpha is None else C)
        loss_giou = loss_giou / n
        loss_dict = {}
        for layer in [L - 1, *range(L - 1)]:
            sfx = "" if layer == L - 1 else f"_{layer}"
            loss_dict.update({f"loss_ce{sfx}": loss_ce[layer], f"loss_bbox{sfx}": loss_bbox[layer],
                              f"loss_giou{sfx}": loss_giou[layer], f"cardinality_error{sfx}": card[layer]})
        loss = (loss_ce + bbox_loss_coefficient * loss_bbox + giou_loss_coefficient * loss_giou).sum()
        return loss, loss_dict


def rt_detr_loss(logits_LBQC: Tensor, boxes_LBQ4: Tensor, labels, config, *, enc_topk_logits: Tensor | None = None,
                 enc_topk_bboxes: Tensor | None = None, denoising_meta_values: dict | None = None,
                 predicted_corners: Tensor | None = None, initial_reference_points: Tensor | None = None
                 ) -> tuple[Tensor, dict]:
    """RT-DETR's ``(loss, loss_dict)``, transformers' ``RTDetrForObjectDetectionLoss``: the L decoder layers'
    ``logits_LBQC [L, B, DN+Q, C]`` (per-class sigmoids) and ``boxes_LBQ4 [L, B, DN+Q, 4]`` (cxcywh;
    transformers' ``intermediate_logits`` / ``intermediate_reference_points`` with the layers first), the
    DN denoising queries first when ``denoising_meta_values`` (transformers' dict: ``dn_positive_idx``,
    ``dn_num_group``, ``dn_num_split``) is given; the encoder's top-k proposals ``enc_topk_logits [B, Q, C]``,
    ``enc_topk_bboxes [B, Q, 4]``. ``config``: transformers' ``RTDetrConfig`` field names (``matcher_*``,
    ``use_focal_loss``, ``focal_loss_alpha`` / ``_gamma``, ``weight_loss_*``, ``auxiliary_loss``) and
    fastzoo's ``giou_impl``.

    Terms (varifocal class term, L1, GIoU, each times its ``weight_loss_*``): the last layer's (all its
    queries: with denoising, transformers 5.17 matches the denoising queries there too); with
    ``auxiliary_loss``, each earlier layer's normal queries (``_aux_0`` ...), the encoder's proposals
    (``_aux_{L-1}``) and each layer's denoising groups matched by index (``_dn_0`` ..., normalised by the box
    count times the groups).

    D-FINE's part (transformers' ``DFineForObjectDetectionLoss``), declared by ``predicted_corners [Lk, B, DN+Q,
    4 (max_num_bins + 1)]`` (each layer's box-edge distributions) with ``initial_reference_points [Lk, B, DN+Q, 4]``
    (each layer's initial boxes) and the config's ``max_num_bins``, ``reg_scale``, ``up``, ``weight_loss_fgl``,
    ``weight_loss_ddf``: every box (the encoder's too) clamped to [0, 1]; the auxiliary layers are the first
    ``min(L, Lk) - 1`` (transformers pairs layer ``i``'s logits with layer ``i``'s distributions, the logits
    starting one earlier) and the denoising layers the first ``min(L, Lk)``; each of those adds ``loss_fgl`` (the
    matched edges' distributions against the target edge's two nearest bins, weighted by the IoU) and
    ``loss_ddf`` (every query's distributions distilled from the last layer's, weighted by the IoU where matched
    and the last layer's top score elsewhere; 0 for the last layer itself)."""
    fields = ("num_labels", "matcher_class_cost", "matcher_bbox_cost", "matcher_giou_cost", "use_focal_loss",
              "matcher_alpha", "matcher_gamma", "focal_loss_alpha", "focal_loss_gamma", "weight_loss_vfl",
              "weight_loss_bbox", "weight_loss_giou", "auxiliary_loss")
    missing = [f for f in fields if not hasattr(config, f)]
    if missing:
        raise ValueError(f"config lacks RT-DETR's loss fields {', '.join(missing)} (transformers' RTDetrConfig names)")
    cost = MatchCost(config.matcher_class_cost, config.matcher_bbox_cost, config.matcher_giou_cost,
                     (config.matcher_alpha, config.matcher_gamma) if config.use_focal_loss else None)
    if cost.class_cost == cost.bbox_cost == cost.giou_cost == 0:
        raise ValueError("matcher_class_cost, matcher_bbox_cost and matcher_giou_cost are all 0: the matcher needs one")
    giou_impl = getattr(config, "giou_impl", "kernel")
    _check_giou_impl(giou_impl)
    fdr = None
    if predicted_corners is not None:
        fdr = _check_distributions(predicted_corners, initial_reference_points, logits_LBQC, config)
        boxes_LBQ4 = boxes_LBQ4.clamp(min=0, max=1)
        if enc_topk_bboxes is not None:
            enc_topk_bboxes = enc_topk_bboxes.clamp(min=0, max=1)
    with kernel_range("loss", "rt_detr_loss", giou_impl):  # for fastzoo.explain; a no-op otherwise
        return _rt_detr_loss(logits_LBQC, boxes_LBQ4, labels, config, cost, giou_impl, enc_topk_logits,
                             enc_topk_bboxes, denoising_meta_values, fdr)


@dataclass
class _Distributions:
    """D-FINE's part of the loss: each layer's edge distributions ``corners_LBQK`` and initial boxes
    ``refs_LBQ4``, and the weighting function's constants."""

    corners_LBQK: Tensor
    refs_LBQ4: Tensor
    bins: int
    reg_scale: float
    up: float
    weight_fgl: float
    weight_ddf: float


def _check_distributions(corners, refs, logits_LBQC, config) -> _Distributions:
    missing = [f for f in ("max_num_bins", "reg_scale", "up", "weight_loss_fgl", "weight_loss_ddf") if not hasattr(config, f)]
    if missing:
        raise ValueError(f"predicted_corners: config lacks D-FINE's loss fields {', '.join(missing)} (transformers' "
                         f"DFineConfig names)")
    K = 4 * (config.max_num_bins + 1)
    shape = tuple(getattr(corners, "shape", ()))
    if not isinstance(corners, Tensor) or corners.ndim != 4 or shape[1:] != (*logits_LBQC.shape[1:3], K):
        raise ValueError(f"predicted_corners must be [layers, {logits_LBQC.shape[1]}, {logits_LBQC.shape[2]}, {K}] "
                         f"(4 x (max_num_bins + 1) per query), got {shape}")
    if not isinstance(refs, Tensor) or tuple(refs.shape) != (*shape[:3], 4):
        raise ValueError(f"initial_reference_points must be [{', '.join(map(str, shape[:3]))}, 4] with predicted_corners, "
                         f"got {tuple(getattr(refs, 'shape', ())) or refs!r}")
    return _Distributions(corners, refs, config.max_num_bins, config.reg_scale, config.up, config.weight_loss_fgl,
                          config.weight_loss_ddf)


def _rt_detr_loss(logits_LBQC, boxes_LBQ4, labels, config, cost, giou_impl, enc_logits_BQC, enc_boxes_BQ4, dn_meta,
                  fdr: _Distributions | None):
    _check_predictions(logits_LBQC, boxes_LBQ4)
    L, B, QQ, C = logits_LBQC.shape
    Lk = fdr.corners_LBQK.shape[0] if fdr is not None else L + 1
    n_aux, n_dn = min(L, Lk) - 1, min(L, Lk)  # RT-DETR: every earlier layer, every layer
    if C != config.num_labels:
        raise ValueError(f"logits have {C} classes; num_labels={config.num_labels} (sigmoid classes, no 'no object')")
    t = pad_targets(labels, B, logits_LBQC.device)
    DN, G = _check_denoising(dn_meta, t, QQ) if dn_meta is not None else (0, 0)
    aux = bool(config.auxiliary_loss)
    if aux:
        _check_encoder(enc_logits_BQC, enc_boxes_BQ4, (B, QQ - DN, C))
    # Hungarian stacks: the last layer (all its queries), and with auxiliary_loss the auxiliary layers' normal
    # queries with the encoder's proposals as one more layer; one stack when they share the query count
    suffixes = [""]
    if not aux:
        stacks = [(logits_LBQC[-1:], boxes_LBQ4[-1:])]
    elif DN == 0:
        stacks = [(torch.cat([logits_LBQC[:n_aux], logits_LBQC[-1:], enc_logits_BQC[None]]),
                   torch.cat([boxes_LBQ4[:n_aux], boxes_LBQ4[-1:], enc_boxes_BQ4[None]]))]
        suffixes = [*(f"_aux_{i}" for i in range(n_aux)), "", f"_aux_{n_aux}"]
    else:
        stacks = [(logits_LBQC[-1:], boxes_LBQ4[-1:]),
                  (torch.cat([logits_LBQC[:n_aux, :, DN:], enc_logits_BQC[None]]),
                   torch.cat([boxes_LBQ4[:n_aux, :, DN:], enc_boxes_BQ4[None]]))]
        suffixes = ["", *(f"_aux_{i}" for i in range(n_aux + 1))]
    starts = [0, *accumulate(lg.shape[0] for lg, _ in stacks)]
    names = [[_layer_name(sfx, L) for sfx in suffixes[a:b]] for a, b in zip(starts, starts[1:])]
    queries = hungarian(stacks, t, cost, C, names)
    n = max(t.num_boxes, 1)
    matched = [_Stack(lg, bx, q, t.boxes_BM4, t.labels_BM, n) for (lg, bx), q in zip(stacks, queries)]
    if aux and DN:
        suffixes += [f"_dn_{i}" for i in range(n_dn)]
        matched.append(_Stack(logits_LBQC[:n_dn, :, :DN], boxes_LBQ4[:n_dn, :, :DN], by_index(t, G, n_dn),
                              t.boxes_BM4.repeat(1, G, 1), t.labels_BM.repeat(1, G), n * G))
    term = ClassTerm("varifocal", alpha=config.focal_loss_alpha, gamma=config.focal_loss_gamma)
    pairs = [_pairs(s) for s in matched]
    class_l1 = _class_and_l1(matched, pairs, term, C)
    gious = _giou_sums(giou_impl, pairs)
    loss_dict = {}
    order = sorted(range(len(suffixes)), key=lambda i: (suffixes[i] != "", i))  # the last layer's terms first
    per_layer = [(c[i], b[i], g[i] / s.n) for (c, b), g, s in zip(class_l1, gious, matched) for i in range(len(c))]
    local = _local_terms(fdr, matched, pairs, suffixes, n_aux, DN, logits_LBQC[-1]) if fdr is not None and aux else {}
    for i in order:
        vfl, bbox, giou = per_layer[i]
        sfx = suffixes[i]
        loss_dict.update({f"loss_vfl{sfx}": config.weight_loss_vfl * vfl, f"loss_bbox{sfx}": config.weight_loss_bbox * bbox,
                          f"loss_giou{sfx}": config.weight_loss_giou * giou})
        if sfx in local:
            fgl, ddf = local[sfx]
            loss_dict.update({f"loss_fgl{sfx}": fdr.weight_fgl * fgl, f"loss_ddf{sfx}": fdr.weight_ddf * ddf})
    return torch.stack(list(loss_dict.values())).sum(), loss_dict


def weighting_function(max_num_bins: int, up: Tensor, reg_scale) -> Tensor:
    """D-FINE's W(n) ``[max_num_bins + 1]``: 0 in the middle, ``+-(step^i - 1)`` growing to ``+-up x reg_scale`` beside
    the ends, ``+-2 up x reg_scale`` at the ends (``step = (up x reg_scale + 1)^(2 / (max_num_bins - 2))``);
    transformers' list of the same operations (``up`` a 1-element tensor, ``reg_scale`` one or a number)."""
    bound = abs(up[0]) * abs(reg_scale)
    step = (bound + 1) ** (2 / (max_num_bins - 2))
    left = [-(step ** i) + 1 for i in range(max_num_bins // 2 - 1, 0, -1)]
    right = [step ** i - 1 for i in range(1, max_num_bins // 2)]
    values = [-abs(up[0]) * abs(reg_scale) * 2, *left, torch.zeros_like(up[0]), *right, abs(up[0]) * abs(reg_scale) * 2]
    return torch.cat([v.reshape(1) for v in values])


def _edge_bins(refs_4: Tensor, target_4: Tensor, fdr: _Distributions) -> tuple[Tensor, Tensor, Tensor]:
    """The target's edges (xyxy) as distances from the initial boxes (cxcywh) in the weighting function's units,
    and their two nearest bins with interpolation weights: ``(left bin, weight right, weight left)``, transformers'
    ``bbox2distance`` (an edge beyond the ends: all weight on the end bin)."""
    reg = abs(fdr.reg_scale)
    cx, cy, w, h = refs_4.unbind(-1)
    x0, y0, x1, y1 = target_4.unbind(-1)
    gt = torch.stack([(cx - x0) / (w / reg + 1e-16) - 0.5 * reg, (cy - y0) / (h / reg + 1e-16) - 0.5 * reg,
                      (x1 - cx) / (w / reg + 1e-16) - 0.5 * reg, (y1 - cy) / (h / reg + 1e-16) - 0.5 * reg], -1)
    values = weighting_function(fdr.bins, torch.tensor([fdr.up], device=gt.device), fdr.reg_scale)
    idx = (values <= gt[..., None]).sum(-1) - 1
    valid, below = (idx >= 0) & (idx < fdr.bins), idx < 0
    at = idx.clamp(0, fdr.bins - 1)
    left_d, right_d = (gt - values[at]).abs(), (values[at + 1] - gt).abs()
    ratio = left_d / (left_d + right_d)
    weight_right = torch.where(valid, ratio, torch.where(below, 0.0, 1.0))
    weight_left = torch.where(valid, 1.0 - ratio, torch.where(below, 1.0, 0.0))
    bin_ = torch.where(valid, idx.to(gt.dtype), torch.where(below, 0.0, fdr.bins - 0.1)).clamp(0, fdr.bins - 0.1)
    return bin_.long(), weight_right, weight_left


def _local_terms(fdr: _Distributions, matched: list[_Stack], pairs, suffixes, n_aux: int, DN: int, teacher_logits_BQC
                 ) -> dict[str, tuple[Tensor, Tensor]]:
    """D-FINE's ``(loss_fgl, loss_ddf)`` by loss_dict suffix, for the auxiliary layers ``_aux_i`` (i < n_aux: the
    normal queries) and the denoising layers ``_dn_i`` (the denoising queries); both unweighted."""
    out, start, Lk = {}, 0, fdr.corners_LBQK.shape[0]
    for s, (matched_LBS, pred_LBS4, tgt_LBS4) in zip(matched, pairs):
        names = suffixes[start:start + s.query_LBS.shape[0]]
        start += len(names)
        for layer, sfx in enumerate(names):
            if sfx.startswith("_aux_") and int(sfx[5:]) < n_aux:
                queries = slice(DN, None)
            elif sfx.startswith("_dn_"):
                queries = slice(None, DN)
            else:
                continue
            k = int(sfx.rsplit("_", 1)[1])
            out[sfx] = _fgl_ddf(fdr, k, Lk, queries, s.query_LBS[layer], matched_LBS[layer], pred_LBS4[layer],
                                tgt_LBS4[layer], teacher_logits_BQC[:, queries], s.n)
    return out


def _fgl_ddf(fdr: _Distributions, k: int, Lk: int, queries: slice, query_BS, matched_BS, pred_BS4, tgt_BS4,
             teacher_logits_BQC, n, T: float = 5.0) -> tuple[Tensor, Tensor]:
    """One layer's FGL (the matched queries' edge distributions: cross-entropy to the target edge's two nearest
    bins by their weights, times the pair's IoU, over the box count) and DDF (every query's distributions against
    the last layer's at temperature T: KL x T^2, weighted by the IoU where matched and the last layer's top score
    elsewhere; the matched and the other queries' means mixed by the square roots of their counts per image)."""
    corners_BQK = fdr.corners_LBQK[k, :, queries]
    B, Q, K4 = corners_BQK.shape
    bins = K4 // 4
    q_BS = query_BS.clamp(min=0)
    with torch.no_grad():
        iou_BS = paired_iou(center_to_corners(pred_BS4), center_to_corners(tgt_BS4))
        refs_BS4 = fdr.refs_LBQ4[k, :, queries].gather(1, q_BS[..., None].expand(*q_BS.shape, 4))
        left, weight_right, weight_left = _edge_bins(refs_BS4, center_to_corners(tgt_BS4), fdr)
    logp_BS4K = F.log_softmax(corners_BQK.gather(1, q_BS[..., None].expand(*q_BS.shape, K4)).reshape(B, -1, 4, bins), -1)
    ce = -(logp_BS4K.gather(-1, left[..., None])[..., 0] * weight_left
           + logp_BS4K.gather(-1, left[..., None] + 1)[..., 0] * weight_right)
    fgl = torch.where(matched_BS[..., None], ce * iou_BS[..., None], 0.0).sum() / n
    if k == Lk - 1:  # the teacher itself: transformers' zero that keeps the graph
        return fgl, corners_BQK.sum() * 0
    with torch.no_grad():
        slot_BS = torch.where(matched_BS, query_BS, Q)  # unmatched slots write to a dropped column Q
        weight_BQ = teacher_logits_BQC.sigmoid().max(-1).values
        weight_BQ = torch.cat([weight_BQ, weight_BQ[:, :1]], 1).scatter(1, slot_BS, iou_BS.to(weight_BQ.dtype))[:, :Q]
        mask_BQ = torch.zeros(B, Q + 1, dtype=torch.bool, device=corners_BQK.device).scatter(1, slot_BS, True)[:, :Q]
        teacher = F.softmax(fdr.corners_LBQK[-1, :, queries].reshape(B, Q, 4, bins) / T, -1)
    kl_BQ4 = F.kl_div(F.log_softmax(corners_BQK.reshape(B, Q, 4, bins) / T, -1), teacher, reduction="none").sum(-1)
    loss_BQ4 = weight_BQ[..., None] * T ** 2 * kl_BQ4
    mask_BQ4 = mask_BQ[..., None].expand(B, Q, 4)
    count_pos = mask_BQ4.sum()
    count_neg = mask_BQ4.numel() - count_pos
    mean_pos = torch.where(mask_BQ4, loss_BQ4, 0.0).sum() / count_pos.clamp(min=1)
    mean_neg = torch.where(mask_BQ4, 0.0, loss_BQ4).sum() / count_neg.clamp(min=1)
    num_pos, num_neg = (count_pos / B) ** 0.5, (count_neg / B) ** 0.5
    return fgl, (mean_pos * num_pos + mean_neg * num_neg) / (num_pos + num_neg)


def lw_detr_loss(logits_LBQC: Tensor, boxes_LBQ4: Tensor, labels, config, *, enc_logits_BQC: Tensor,
                 enc_boxes_BQ4: Tensor) -> tuple[Tensor, dict]:
    """LW-DETR's and RF-DETR's ``(loss, loss_dict)``, transformers' ``LwDetrForObjectDetectionLoss``: the L decoder
    layers' ``logits_LBQC [L, B, Q, C]`` (per-class sigmoids; the last is the final output, the others auxiliary)
    and boxes ``boxes_LBQ4`` (cxcywh), the encoder's proposals ``enc_logits_BQC [B, Qe, C]``, ``enc_boxes_BQ4``.
    ``config``: transformers' ``RfDetrConfig`` names (``class_cost`` ..., ``*_loss_coefficient``, ``focal_alpha``,
    ``group_detr``) and fastzoo's ``giou_impl``.

    Each stack's queries are ``group_detr`` groups of ``Q // group_detr`` (the rest unmatched), each matched
    apart (the focal cost, alpha 0.25 and gamma 2) to every box: transformers' loss uses the groups in eval
    mode too. Terms: the IoU-aware class term, L1, GIoU, each over the box count times the groups, and the
    cardinality error (logged, no gradient); ``loss`` = the sum of the class, L1 and GIoU terms weighted by
    their ``*_loss_coefficient``."""
    fields = ("num_labels", "class_cost", "bbox_cost", "giou_cost", "class_loss_coefficient", "bbox_loss_coefficient",
              "giou_loss_coefficient", "focal_alpha", "group_detr")
    missing = [f for f in fields if not hasattr(config, f)]
    if missing:
        raise ValueError(f"config lacks LW-DETR's loss fields {', '.join(missing)} (transformers' RfDetrConfig names)")
    giou_impl = getattr(config, "giou_impl", "kernel")
    _check_giou_impl(giou_impl)
    with kernel_range("loss", "lw_detr_loss", giou_impl):  # for fastzoo.explain; a no-op otherwise
        _check_predictions(logits_LBQC, boxes_LBQ4)
        L, B, Q, C = logits_LBQC.shape
        if C != config.num_labels:
            raise ValueError(f"logits have {C} classes; num_labels={config.num_labels} (sigmoid classes, no 'no object')")
        if (not isinstance(enc_logits_BQC, Tensor) or not isinstance(enc_boxes_BQ4, Tensor) or enc_logits_BQC.ndim != 3
                or enc_logits_BQC.shape[::2] != (B, C) or enc_boxes_BQ4.shape != (*enc_logits_BQC.shape[:2], 4)):
            raise ValueError(f"enc_logits_BQC and enc_boxes_BQ4 must be [{B}, Qe, {C}] and [{B}, Qe, 4] (the encoder's "
                             f"proposals), got {tuple(getattr(enc_logits_BQC, 'shape', ()))} and "
                             f"{tuple(getattr(enc_boxes_BQ4, 'shape', ()))}")
        G = config.group_detr
        stacks = [(logits_LBQC, boxes_LBQ4), (enc_logits_BQC[None], enc_boxes_BQ4[None])]
        if min(lg.shape[2] for lg, _ in stacks) < G:
            raise ValueError(f"group_detr={G}: more groups than the {min(lg.shape[2] for lg, _ in stacks)} queries "
                             f"predicted")
        t = pad_targets(labels, B, logits_LBQC.device)
        cost = MatchCost(config.class_cost, config.bbox_cost, config.giou_cost, (0.25, 2.0))
        names = [[*(f"auxiliary decoder layer {i}" for i in range(L - 1)), "the last decoder layer"],
                 ["the encoder's proposals (enc_outputs_class, enc_outputs_coord_logits)"]]
        names = [[name for name in layers for _ in range(G)] for layers in names]  # _grouped's order
        queries = [_ungroup(q, G, lg.shape[2] // G) for q, (lg, _) in
                   zip(hungarian([_grouped(lg, bx, G) for lg, bx in stacks], t, cost, C, names), stacks)]
        n = max(t.num_boxes * G, 1)
        matched = [_Stack(lg, bx, q, t.boxes_BM4.repeat(1, G, 1), t.labels_BM.repeat(1, G), n)
                   for (lg, bx), q in zip(stacks, queries)]
        pairs = [_pairs(s) for s in matched]
        class_l1 = _class_and_l1(matched, pairs, ClassTerm("iou_aware", alpha=config.focal_alpha), C)
        gious = _giou_sums(giou_impl, pairs)
        cards = [_cardinality_error(s.logits_LBQC, t, C) for s in matched]
        per_layer = [(c[i], b[i], g[i] / n, card[i]) for (c, b), g, card in zip(class_l1, gious, cards) for i in range(len(c))]
        suffixes = [*(f"_{i}" for i in range(L - 1)), "", "_enc"]
        order = sorted(range(len(suffixes)), key=lambda i: (suffixes[i] != "", i))  # the last layer's terms first
        loss_dict = {}
        for i in order:
            loss_dict.update({f"{k}{suffixes[i]}": v for k, v in
                              zip(("loss_ce", "loss_bbox", "loss_giou", "cardinality_error"), per_layer[i])})
        weights = {"loss_ce": config.class_loss_coefficient, "loss_bbox": config.bbox_loss_coefficient,
                   "loss_giou": config.giou_loss_coefficient}
        loss = sum(loss_dict[k + suffixes[i]] * w for i in order for k, w in weights.items())
        return loss, loss_dict


def _grouped(logits_LBQC: Tensor, boxes_LBQ4: Tensor, G: int) -> tuple[Tensor, Tensor]:
    """``[L, B, Q, ...]`` as ``G`` groups of ``q = Q // G`` queries, each group one more layer ``[L * G, B, q, ...]``
    (queries past ``G q`` dropped)."""
    L, B, Q, _ = logits_LBQC.shape
    q = Q // G

    def split(x):
        return x[:, :, : G * q].reshape(L, B, G, q, -1).transpose(1, 2).reshape(L * G, B, q, -1)

    return split(logits_LBQC), split(boxes_LBQ4)


def _ungroup(query_KBM: Tensor, G: int, q: int) -> Tensor:
    """The groups' matches ``[L * G, B, M]`` as one ``[L, B, G * M]``: group ``g``'s slots after the earlier
    groups', its queries offset by ``g q``."""
    K, B, M = query_KBM.shape
    offset = (torch.arange(G, device=query_KBM.device) * q).view(1, G, 1, 1)
    query_LGBM = query_KBM.view(K // G, G, B, M)
    query_LGBM = torch.where(query_LGBM >= 0, query_LGBM + offset, -1)
    return query_LGBM.transpose(1, 2).reshape(K // G, B, G * M)


def _cardinality_error(logits_LBQC: Tensor, t: PaddedTargets, sigmoid_classes: int | None) -> Tensor:
    """Per layer ``[L]``: the mean over images of |predicted non-empty - boxes|; a query is non-empty where
    "no object" is not its top class (softmax, ``sigmoid_classes`` None), or some sigmoid is above 0.5."""
    with torch.no_grad():
        if sigmoid_classes is None:
            card_LB = (logits_LBQC.argmax(-1) != logits_LBQC.shape[-1] - 1).sum(-1).float()
        else:
            card_LB = (logits_LBQC.sigmoid().max(-1).values > 0.5).sum(-1).float()
        return (card_LB - torch.tensor(t.counts, dtype=torch.float32, device=logits_LBQC.device)).abs().mean(-1)


def _layer_name(suffix: str, L: int) -> str:
    """How a matching error names an RT-DETR layer, from its loss_dict suffix."""
    if suffix == "":
        return "the last decoder layer"
    if suffix == f"_aux_{L - 1}":
        return "the encoder's top-k proposals (enc_topk_logits, enc_topk_bboxes)"
    return f"auxiliary decoder layer {suffix.rsplit('_', 1)[1]}"


def _check_giou_impl(giou_impl: str) -> None:
    if giou_impl not in GIOU_IMPLS:
        raise ValueError(f"giou_impl={giou_impl!r}: choose one of {', '.join(GIOU_IMPLS)}")


def _check_predictions(logits_LBQC, boxes_LBQ4) -> None:
    if (not isinstance(logits_LBQC, Tensor) or not isinstance(boxes_LBQ4, Tensor) or logits_LBQC.ndim != 4
            or boxes_LBQ4.shape != (*logits_LBQC.shape[:3], 4)):
        raise ValueError(f"logits must be [L, B, Q, C] and boxes [L, B, Q, 4], got {tuple(getattr(logits_LBQC, 'shape', ()))} "
                         f"and {tuple(getattr(boxes_LBQ4, 'shape', ()))}")


def _check_encoder(enc_logits, enc_boxes, BQC) -> None:
    B, Q, C = BQC
    if (not isinstance(enc_logits, Tensor) or not isinstance(enc_boxes, Tensor) or enc_logits.shape != (B, Q, C)
            or enc_boxes.shape != (B, Q, 4)):
        raise ValueError(f"enc_topk_logits and enc_topk_bboxes must be [{B}, {Q}, {C}] and [{B}, {Q}, 4] (the encoder's "
                         f"top-k proposals, needed with auxiliary_loss), got {tuple(getattr(enc_logits, 'shape', ()))} "
                         f"and {tuple(getattr(enc_boxes, 'shape', ()))}")


def _check_denoising(dn_meta, t: PaddedTargets, queries: int) -> tuple[int, int]:
    """The denoising queries' count and groups from transformers' ``denoising_meta_values``, checked against the
    labels (shapes only: no read)."""
    if not hasattr(dn_meta, "keys") or not {"dn_positive_idx", "dn_num_group", "dn_num_split"} <= set(dn_meta.keys()):
        raise ValueError("denoising_meta_values must be transformers' dict with 'dn_positive_idx', 'dn_num_group' and "
                         f"'dn_num_split', got {sorted(dn_meta.keys()) if hasattr(dn_meta, 'keys') else type(dn_meta).__name__}")
    G, split, idx = dn_meta["dn_num_group"], list(dn_meta["dn_num_split"]), dn_meta["dn_positive_idx"]
    M = t.labels_BM.shape[1]
    if len(split) != 2 or sum(split) != queries or split[0] != 2 * M * G:
        raise ValueError(f"denoising_meta_values['dn_num_split'] = {split}: must be [2 x {M} boxes x {G} groups, "
                         f"queries] summing to the predictions' {queries} queries")
    lengths = [len(i) for i in idx]
    if lengths != [n * G for n in t.counts]:
        raise ValueError(f"denoising_meta_values['dn_positive_idx'] has {lengths} positives per image; the labels' "
                         f"{list(t.counts)} boxes x {G} groups need {[n * G for n in t.counts]}")
    return split[0], G


def _pairs(s: _Stack) -> tuple[Tensor, Tensor, Tensor]:
    """A stack's matched pairs in the padded layout: which slots are matched ``[L, B, S]``, the predicted
    and the target boxes ``[L, B, S, 4]`` (cxcywh; unmatched slots hold query 0's and the padding's)."""
    L, B, S = s.query_LBS.shape
    matched_LBS = s.query_LBS >= 0
    pred_LBS4 = s.boxes_LBQ4.gather(2, s.query_LBS.clamp(min=0)[..., None].expand(L, B, S, 4))
    return matched_LBS, pred_LBS4, s.boxes_BS4[None].expand(L, B, S, 4)


def _class_and_l1(stacks: list[_Stack], pairs, term: ClassTerm, C: int) -> list[tuple[Tensor, Tensor]]:
    """Per stack ``(class term [L], L1 term [L])``, each normalised by the stack's ``n``."""
    out = []
    for s, (matched_LBS, pred_LBS4, tgt_LBS4) in zip(stacks, pairs):
        L, B, Q, _ = s.logits_LBQC.shape
        S = s.query_LBS.shape[2]
        slot_LBS = torch.where(matched_LBS, s.query_LBS, Q)  # unmatched slots write to a dropped column Q
        target_LBQ = torch.full((L, B, Q + 1), C, dtype=torch.long, device=s.logits_LBQC.device)
        target_LBQ = target_LBQ.scatter(2, slot_LBS, s.labels_BS[None].expand(L, B, S))[..., :Q]
        loss_bbox = torch.where(matched_LBS[..., None], (pred_LBS4 - tgt_LBS4).abs(), 0.0).sum((1, 2, 3)) / s.n
        if term.kind == "ce":
            loss_class = _class_loss(s.logits_LBQC, target_LBQ, C, term.eos_coefficient)
        elif term.kind == "focal":
            loss_class = _focal_class_loss(s.logits_LBQC, target_LBQ, C, term.alpha, s.n)
        else:
            with torch.no_grad():  # the IoU-aware target: of the detached prediction, as transformers'
                iou_LBS = paired_iou(center_to_corners(pred_LBS4), center_to_corners(tgt_LBS4))
                score_LBQ = torch.zeros(L, B, Q + 1, dtype=s.logits_LBQC.dtype, device=s.logits_LBQC.device)
                score_LBQ = score_LBQ.scatter(2, slot_LBS, torch.where(matched_LBS, iou_LBS, 0.0).to(score_LBQ.dtype))
            loss_of = _varifocal_class_loss if term.kind == "varifocal" else _iou_aware_class_loss
            loss_class = loss_of(s.logits_LBQC, target_LBQ, score_LBQ[..., :Q], C, term, s.n)
        out.append((loss_class, loss_bbox))
    return out


def _class_loss(logits_LBQC: Tensor, target_LBQ: Tensor, C: int, eos_coefficient: float) -> Tensor:
    """DETR's per layer ``[L]``: cross-entropy over every query, "no object" weighted ``eos_coefficient``, a weighted mean."""
    L, B, Q, _ = logits_LBQC.shape
    ce_LBQ = F.cross_entropy(logits_LBQC.flatten(0, 2), target_LBQ.flatten(), reduction="none").view(L, B, Q)
    # the class weights in the loss's precision (fp32 under autocast, as transformers' weighted cross-entropy):
    # (bf16 rounds eos_coefficient 0.1 to 0.1001, which a sum over the queries accumulates)
    weight = torch.ones(C + 1, device=logits_LBQC.device, dtype=ce_LBQ.dtype)
    weight[C] = eos_coefficient
    w_LBQ = weight[target_LBQ]
    return (ce_LBQ * w_LBQ).sum((1, 2)) / w_LBQ.sum((1, 2))


def _focal_class_loss(logits_LBQC: Tensor, target_LBQ: Tensor, C: int, alpha: float, n) -> Tensor:
    """Deformable DETR's per layer ``[L]``: the sigmoid focal loss (gamma 2) of every query and class against
    the one-hot matched classes (unmatched queries: all zeros), summed and divided by the box count
    (transformers' ``sigmoid_focal_loss(...) * num_queries``: a mean over queries times their number)."""
    Q = logits_LBQC.shape[2]
    onehot_LBQC = F.one_hot(target_LBQ, C + 1)[..., :C].to(logits_LBQC.dtype)
    prob = logits_LBQC.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits_LBQC, onehot_LBQC, reduction="none")
    p_t = prob * onehot_LBQC + (1 - prob) * (1 - onehot_LBQC)
    loss = ce * ((1 - p_t) ** 2)
    if alpha >= 0:
        loss = (alpha * onehot_LBQC + (1 - alpha) * (1 - onehot_LBQC)) * loss
    return loss.mean(2).sum((1, 2)) / n * Q


def _varifocal_class_loss(logits_LBQC: Tensor, target_LBQ: Tensor, score_LBQ: Tensor, C: int, term: ClassTerm,
                          n) -> Tensor:
    """RT-DETR's per layer ``[L]`` (transformers' ``loss_labels_vfl``): BCE of every query and class against
    ``IoU x one-hot``, weighted ``alpha sigmoid(logit)^gamma`` where the one-hot is 0 and the IoU where it
    is 1 (weights and targets carry no gradient), a mean over queries times their number over the box count."""
    Q, dtype = logits_LBQC.shape[2], logits_LBQC.dtype
    onehot_LBQC = F.one_hot(target_LBQ, C + 1)[..., :C]
    target_LBQC = score_LBQ[..., None] * onehot_LBQC
    weight = (term.alpha * logits_LBQC.detach().sigmoid().pow(term.gamma) * (1 - onehot_LBQC) + target_LBQC).to(dtype)
    loss = F.binary_cross_entropy_with_logits(logits_LBQC, target_LBQC, weight=weight, reduction="none")
    return loss.mean(2).sum((1, 2)) * Q / n


def _iou_aware_class_loss(logits_LBQC: Tensor, target_LBQ: Tensor, score_LBQ: Tensor, C: int, term: ClassTerm,
                          n) -> Tensor:
    """LW-DETR's per layer ``[L]`` (transformers' ``LwDetrImageLoss.loss_labels``), op for op: ``-w+ log p -
    w- log(1 - p)``, at the matched class ``w+ = max(p^alpha IoU^(1-alpha), 0.01)`` and ``w- = 1 - w+`` (no
    gradient), elsewhere ``w+ = 0`` and ``w- = p^2``; summed over queries and classes, over the box count."""
    onehot_LBQC = F.one_hot(target_LBQ, C + 1)[..., :C].bool()
    prob = logits_LBQC.sigmoid()
    quality = (prob.detach().pow(term.alpha) * score_LBQ[..., None].pow(1 - term.alpha)).clamp(min=0.01)
    pos = torch.where(onehot_LBQC, quality, 0.0)
    neg = torch.where(onehot_LBQC, 1 - quality, prob.pow(2))
    return (-pos * prob.log() - neg * (1 - prob).log()).sum((1, 2, 3)) / n


def _giou_sums(giou_impl: str, stack_pairs) -> list[Tensor]:
    """Per stack ``[L]``: the sum of 1 - GIoU over its matched pairs, every stack's pairs in one call
    (``padded`` / ``kernel``) or per layer (``concat``) or per layer and image (``per_sample``)."""
    pairs = [(center_to_corners(pred), center_to_corners(tgt), matched) for matched, pred, tgt in stack_pairs]
    if giou_impl in ("padded", "kernel"):  # unmatched slots hold an inverted box: padding to the loss
        preds, tgts = [], []
        for pred, tgt, matched in pairs:
            pad = torch.tensor(PAD_BOX, dtype=tgt.dtype, device=tgt.device)
            preds.append(pred.flatten(0, 2))
            tgts.append(torch.where(matched[..., None], tgt, pad).flatten(0, 2))
        loss = giou_loss_padded(torch.cat(preds), torch.cat(tgts), reduction="none", eps=0.0,
                                impl="kernel" if giou_impl == "kernel" else "torch", validate=False)
        return [part.view(m.shape[0], -1).sum(1) for part, (_, _, m) in zip(loss.split([m.numel() for _, _, m in pairs]), pairs)]
    sums = []
    for pred_LBS4, tgt_LBS4, matched_LBS in pairs:
        per_layer = []
        for layer in range(pred_LBS4.shape[0]):
            m = matched_LBS[layer]
            if giou_impl == "concat":
                per_layer.append(giou_loss_concat(pred_LBS4[layer][m], tgt_LBS4[layer][m], eps=0.0, validate=False))
            else:
                preds = [p[mm] for p, mm in zip(pred_LBS4[layer], m)]
                tgts = [g[mm] for g, mm in zip(tgt_LBS4[layer], m)]
                per_layer.append(giou_loss_per_sample(preds, tgts, eps=0.0, validate=False))
        sums.append(torch.stack(per_layer))
    return sums


SET_PREDICTION = Loss(
    name="set_prediction",
    description="the DETR family's set loss (Hungarian, grouped and denoising matches; CE / focal / varifocal / "
                "IoU-aware class term + L1 + GIoU, auxiliary and encoder layers), transformers' terms",
    functions=("set_prediction_loss", "rt_detr_loss", "lw_detr_loss"),
    impls=GIOU_IMPLS,
    kernel_ops=r"^fastzoo::giou",
    fused_op=r"^fastzoo::giou",
    fused_impls=("kernel",),
    bench="fastzoo.bench.set_loss",
)
