"""DETR's set-prediction loss (Carion et al. 2020), for any detector that predicts a fixed set of
boxes per image: a one-to-one (Hungarian) matching of predictions to target boxes, then class
cross-entropy over every query and L1 + GIoU over the matched pairs -- the matching cost and the
terms exactly as transformers' ``DetrHungarianMatcher`` / ``ImageLoss`` define them (the
``loss_dict`` keys, auxiliary layers suffixed ``_0`` ... ``_{L-2}``, are theirs too):

- cost = ``bbox_cost`` x L1(cxcywh) - ``class_cost`` x p(target class) - ``giou_cost`` x GIoU(xyxy);
- ``loss_ce``: cross-entropy over all queries, unmatched ones target "no object" (the last class)
  with weight ``eos_coefficient``, a weighted mean; ``loss_bbox``: L1 in cxcywh, and ``loss_giou``:
  1 - GIoU, each summed over the matched pairs and divided by the batch's box count (at least 1);
  ``cardinality_error`` (logged, no gradient): |predicted non-empty queries - boxes|, mean over images;
- ``loss`` = sum over decoder layers of ``loss_ce + bbox_loss_coefficient x loss_bbox +
  giou_loss_coefficient x loss_giou``.

Declared parts, by the detector (transformers' ``DeformableDetrHungarianMatcher`` / ``DeformableDetrImageLoss``):
``focal_alpha`` set makes the classification per-class sigmoids (no "no object" logit): ``loss_ce`` the
sigmoid focal loss (gamma 2, ``alpha``) of every query against its one-hot matched class, summed and divided
by the box count; the matching's class term the focal cost ``alpha (1-p)^2 (-log p) - (1-alpha) p^2
(-log(1-p))`` (alpha 0.25); ``cardinality_error`` counts queries with some sigmoid above 0.5.

How it runs. transformers computes one ``[B*Q, N]`` cost for the whole batch per layer (every
query against every image's boxes), the GIoU loss as the diagonal of an ``N x N`` matrix, and
reads the device a few times per layer (a cost copy and box checks; the counts:
benchmarks/results/cpu-2core/README.md, "DETR: the set loss"). Here: targets padded to ``[B, M]`` (M = most boxes in an image), the cost of every
layer at once per image ``[L, B, Q, M]``, and one host read per step that carries the costs and
the target checks together; the assignment goes back as one ``[L, B, M]`` index (a copy to the
device, no read). The GIoU term runs as ``giou_impl`` says (:data:`GIOU_IMPLS`). GIoU is
transformers' formula (no epsilon).

Errors: labels that are not a list of ``{"class_labels": [n] int, "boxes": [n, 4] float}``, boxes
that are not finite or leave [0, 1] (a negative width or height, pixel coordinates), class ids outside ``[0, num_classes)``
raise ``ValueError`` naming the image; a non-finite matching cost (NaN / Inf predictions, which
make scipy fail inside transformers) names the decoder layer and the image. An image may have no
boxes, or more boxes than queries (then, as transformers, ``Q`` of them are matched).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fastzoo.kernel_ranges import kernel_range
from fastzoo.losses.giou import PAD_BOX, giou_loss_concat, giou_loss_padded, giou_loss_per_sample
from fastzoo.losses.registry import Loss

# how the GIoU term runs: ``giou_impl=`` of the loss, DETR's config field of that name, the bench's cases
GIOU_IMPLS = {"per_sample": "GIoU term in a loop over images", "concat": "GIoU term on the gathered pairs",
              "padded": "GIoU term on the padded pairs, plain ops",
              "kernel": "GIoU term through the fused padded op (no gather, no host sync)"}


@dataclass
class PaddedTargets:
    """One batch's targets padded to ``[B, M]``: cxcywh boxes, class ids, which slots are real."""

    boxes_BM4: Tensor
    labels_BM: Tensor
    mask_BM: Tensor
    counts: tuple[int, ...]  # boxes per image, on the host (from the shapes: no read)

    @property
    def num_boxes(self) -> int:
        return sum(self.counts)


def pad_targets(labels, batch: int, device) -> PaddedTargets:
    """transformers' ``labels`` (a list of dicts, one per image) padded; shapes and types checked here
    (free, :func:`check_labels`), values with the cost's host read (:func:`set_prediction_loss`)."""
    boxes, classes = check_labels(labels, batch)
    counts = tuple(b.shape[0] for b in boxes)
    M = max(counts)
    boxes_BM4 = torch.tensor([0.5, 0.5, 1.0, 1.0], device=device).repeat(batch, M, 1)  # a valid box in padding
    labels_BM = torch.zeros(batch, M, dtype=torch.long, device=device)
    mask_BM = torch.zeros(batch, M, dtype=torch.bool, device=device)
    for i, (b, c) in enumerate(zip(boxes, classes)):
        n = b.shape[0]
        boxes_BM4[i, :n] = b.to(device, torch.float32, non_blocking=True)
        labels_BM[i, :n] = c.to(device, non_blocking=True)
        mask_BM[i, :n] = True
    return PaddedTargets(boxes_BM4, labels_BM, mask_BM, counts)


def check_labels(labels, batch: int) -> tuple[list[Tensor], list[Tensor]]:
    """The boxes and class ids of transformers' ``labels`` after checking their structure, shapes and
    types (no values: no host read); ValueError naming the image and key. A model may call it before its
    forward, so that bad labels are refused before any work."""
    if not isinstance(labels, (list, tuple)) or len(labels) != batch:
        raise ValueError(f"labels must be a list of {batch} dicts (one per image) with 'class_labels' and 'boxes', "
                         f"got {type(labels).__name__}{f' of {len(labels)}' if isinstance(labels, (list, tuple)) else ''}")
    boxes, classes = [], []
    for i, t in enumerate(labels):
        if not hasattr(t, "keys") or "class_labels" not in t or "boxes" not in t:
            raise ValueError(f"labels[{i}] must be a dict with 'class_labels' [n] and 'boxes' [n, 4] (cx, cy, w, h in "
                             f"[0, 1]), got {sorted(t.keys()) if hasattr(t, 'keys') else type(t).__name__}")
        c, b = t["class_labels"], t["boxes"]
        if not isinstance(b, Tensor) or b.ndim != 2 or b.shape[1] != 4 or not b.is_floating_point():
            raise ValueError(f"labels[{i}]['boxes'] must be a float [n, 4] tensor (cx, cy, w, h), got "
                             f"{getattr(b, 'dtype', type(b).__name__)} {tuple(getattr(b, 'shape', ()))}")
        if not isinstance(c, Tensor) or c.shape != (b.shape[0],) or c.is_floating_point() or c.dtype == torch.bool:
            raise ValueError(f"labels[{i}]['class_labels'] must be an integer tensor of shape ({b.shape[0]},) (one id "
                             f"per box), got {getattr(c, 'dtype', type(c).__name__)} {tuple(getattr(c, 'shape', ()))}")
        boxes.append(b)
        classes.append(c)
    return boxes, classes


def center_to_corners(b: Tensor) -> Tensor:
    """(cx, cy, w, h) -> (x1, y1, x2, y2), transformers' ``center_to_corners_format``."""
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], dim=-1)


def pairwise_giou(a: Tensor, b: Tensor) -> Tensor:
    """GIoU ``[..., Q, M]`` between xyxy boxes ``a [..., Q, 4]`` and ``b [..., M, 4]``, transformers'
    (DETR's) formula: no epsilon, intersection and enclosure clamped at 0."""
    a, b = a[..., :, None, :], b[..., None, :, :]
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    wh = (torch.min(a[..., 2:], b[..., 2:]) - torch.max(a[..., :2], b[..., :2])).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = area_a + area_b - inter
    enclose = (torch.max(a[..., 2:], b[..., 2:]) - torch.min(a[..., :2], b[..., :2])).clamp(min=0)
    area_c = enclose[..., 0] * enclose[..., 1]
    return inter / union - (area_c - union) / area_c


@torch.no_grad()
def matching_cost(logits_LBQC: Tensor, boxes_LBQ4: Tensor, t: PaddedTargets, class_cost: float, bbox_cost: float,
                  giou_cost: float, focal_alpha: float | None = None) -> Tensor:
    """The matching cost of every layer's queries against its own image's boxes ``[L, B, Q, M]``. The class
    term: ``-p(target class)`` of the softmax (DETR), or with ``focal_alpha`` the focal cost of the sigmoid
    (Deformable DETR's matcher: alpha and gamma 0.25 and 2, whatever the loss's alpha)."""
    L, B, Q, C = logits_LBQC.shape
    M = t.labels_BM.shape[1]
    # a class id out of range is refused by name after this read (_target_problems): clamped here so
    # the gather does not fail first (a RuntimeError on the CPU, a device-side assert on CUDA)
    labels_LBQM = t.labels_BM.clamp(0, C - 1)[None, :, None, :].expand(L, B, Q, M)
    if focal_alpha is None:
        class_LBQM = -logits_LBQC.softmax(-1).gather(-1, labels_LBQM)
    else:
        p_LBQM = logits_LBQC.sigmoid().gather(-1, labels_LBQM)
        neg = (1 - 0.25) * (p_LBQM ** 2.0) * (-(1 - p_LBQM + 1e-8).log())
        pos = 0.25 * ((1 - p_LBQM) ** 2.0) * (-(p_LBQM + 1e-8).log())
        class_LBQM = pos - neg
    l1_LBQM = (boxes_LBQ4[..., :, None, :] - t.boxes_BM4[None, :, None, :, :]).abs().sum(-1)
    giou_LBQM = pairwise_giou(center_to_corners(boxes_LBQ4), center_to_corners(t.boxes_BM4)[None])
    return bbox_cost * l1_LBQM + class_cost * class_LBQM + giou_cost * -giou_LBQM


def _bad_boxes(b: Tensor, mask_BM: Tensor) -> Tensor:
    """Which real boxes are not finite (cx, cy, w, h) in [0, 1] (NaN compares false: caught by the range)."""
    return ~((b >= 0) & (b <= 1)).all(-1) & mask_BM


def _target_problems(t: PaddedTargets, num_classes: int) -> Tensor:
    """A [2] flag on the device: some real box is malformed, some class id is out of range."""
    bad_box = _bad_boxes(t.boxes_BM4, t.mask_BM)
    bad_label = ((t.labels_BM < 0) | (t.labels_BM >= num_classes)) & t.mask_BM
    return torch.stack([bad_box.any(), bad_label.any()]).float()


def _raise_target_problem(flags, t: PaddedTargets, num_classes: int) -> None:
    if flags[0]:
        b = t.boxes_BM4.cpu()
        bad = _bad_boxes(b, t.mask_BM.cpu())
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"labels[{i}]['boxes'][{j}] = {b[i, j].tolist()}: boxes must be finite (cx, cy, w, h) "
                         f"normalised to [0, 1] (so w >= 0 and h >= 0)")
    if flags[1]:
        lab = t.labels_BM.cpu()
        bad = ((lab < 0) | (lab >= num_classes)) & t.mask_BM.cpu()
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"labels[{i}]['class_labels'][{j}] = {int(lab[i, j])}: class ids must lie in "
                         f"[0, {num_classes}) (num_labels={num_classes}; 'no object' is not a target class)")


def assign(cost_LBQM: np.ndarray, counts) -> np.ndarray:
    """scipy's Hungarian solver per (layer, image) on the host: the query of each target slot
    ``[L, B, M]`` (-1: padding, or a box left unmatched when an image has more boxes than queries)."""
    from scipy.optimize import linear_sum_assignment

    L, B, Q, M = cost_LBQM.shape
    query = np.full((L, B, M), -1, dtype=np.int64)
    for b, n in enumerate(counts):
        if n == 0:
            continue
        for layer in range(L):
            c = cost_LBQM[layer, b, :, :n]
            if not np.isfinite(c).all():
                which = "the last decoder layer" if layer == L - 1 else f"auxiliary decoder layer {layer}"
                raise ValueError(f"the matching cost of {which} (of {L}), image {b}, is not finite: its predicted "
                                 f"boxes or logits hold NaN or Inf")
            rows, cols = linear_sum_assignment(c)
            query[layer, b, cols] = rows
    return query


def set_prediction_loss(logits_LBQC: Tensor, boxes_LBQ4: Tensor, labels, config=None, *, num_classes: int | None = None,
                        class_cost: float = 1.0, bbox_cost: float = 5.0, giou_cost: float = 2.0,
                        bbox_loss_coefficient: float = 5.0, giou_loss_coefficient: float = 2.0,
                        eos_coefficient: float = 0.1, giou_impl: str = "kernel", num_boxes=None,
                        focal_alpha: float | None = None) -> tuple[Tensor, dict]:
    """``(loss, loss_dict)`` of L decoder layers' predictions (the last is the final output, the others
    auxiliary): ``logits_LBQC [L, B, Q, C+1]``, ``boxes_LBQ4 [L, B, Q, 4]`` (cx, cy, w, h);
    ``labels`` as transformers' (see the module docstring). A ``config`` with transformers' field names
    (``num_labels``, ``class_cost`` ..., ``eos_coefficient``, ``giou_impl``, and ``focal_alpha`` where the
    model has one) sets them all. ``num_boxes``: the normaliser (e.g. all-reduced over processes); default
    this batch's box count. ``focal_alpha``: the classification is per-class sigmoids (``logits [L, B, Q, C]``,
    no "no object" class) with the focal term and cost (Deformable DETR's)."""
    if config is not None:
        num_classes, class_cost, bbox_cost, giou_cost = config.num_labels, config.class_cost, config.bbox_cost, config.giou_cost
        bbox_loss_coefficient, giou_loss_coefficient = config.bbox_loss_coefficient, config.giou_loss_coefficient
        eos_coefficient, giou_impl = config.eos_coefficient, config.giou_impl
        focal_alpha = getattr(config, "focal_alpha", None)  # a config of a sigmoid-classified detector declares it
    if giou_impl not in GIOU_IMPLS:
        raise ValueError(f"giou_impl={giou_impl!r}: choose one of {', '.join(GIOU_IMPLS)}")
    with kernel_range("loss", "set_prediction_loss", giou_impl):  # for fastzoo.explain; a no-op otherwise
        return _set_prediction_loss(logits_LBQC, boxes_LBQ4, labels, num_classes, class_cost, bbox_cost, giou_cost,
                                    bbox_loss_coefficient, giou_loss_coefficient, eos_coefficient, giou_impl, num_boxes,
                                    focal_alpha)


def _set_prediction_loss(logits_LBQC, boxes_LBQ4, labels, num_classes, class_cost, bbox_cost, giou_cost,
                         bbox_loss_coefficient, giou_loss_coefficient, eos_coefficient, giou_impl, num_boxes,
                         focal_alpha):
    if logits_LBQC.ndim != 4 or boxes_LBQ4.shape != (*logits_LBQC.shape[:3], 4):
        raise ValueError(f"logits must be [L, B, Q, C+1] and boxes [L, B, Q, 4], got {tuple(logits_LBQC.shape)} and "
                         f"{tuple(boxes_LBQ4.shape)}")
    L, B, Q, C1 = logits_LBQC.shape
    extra = 0 if focal_alpha is not None else 1  # softmax: a last "no object" class; sigmoids: none
    C = C1 - extra if num_classes is None else num_classes
    if C1 != C + extra:
        raise ValueError(f"logits have {C1} classes; num_classes={C} needs {C + extra}"
                         f"{' (the last: no object)' if extra else ' (sigmoid classes, focal loss)'}")
    device = logits_LBQC.device
    t = pad_targets(labels, B, device)
    M = t.labels_BM.shape[1]

    query_LBM = np.full((L, B, M), -1, dtype=np.int64)
    if M:  # the one host read: every layer's cost and the target checks together
        cost = matching_cost(logits_LBQC.detach(), boxes_LBQ4.detach(), t, class_cost, bbox_cost, giou_cost, focal_alpha)
        host = torch.cat([cost.float().flatten(), _target_problems(t, C)]).cpu().numpy()
        if host[-2:].any():
            _raise_target_problem(host[-2:], t, C)
        query_LBM = assign(host[:-2].reshape(L, B, Q, M), t.counts)
    query_LBM = torch.from_numpy(query_LBM).to(device, non_blocking=True)
    matched_LBM = query_LBM >= 0
    q_LBM = query_LBM.clamp(min=0)
    n = max(t.num_boxes, 1) if num_boxes is None else num_boxes

    # class: every query, unmatched ones "no object" (index C); matched labels scattered to their query
    target_LBQ = torch.full((L, B, Q + 1), C, dtype=torch.long, device=device)
    target_LBQ.scatter_(2, torch.where(matched_LBM, q_LBM, Q), t.labels_BM[None].expand(L, B, M))
    target_LBQ = target_LBQ[..., :Q]
    loss_ce = (_class_loss(logits_LBQC, target_LBQ, C, eos_coefficient) if focal_alpha is None
               else _focal_class_loss(logits_LBQC, target_LBQ, C, focal_alpha, n))

    # boxes: the matched pairs in the padded layout [L, B, M]
    pred_LBM4 = boxes_LBQ4.gather(2, q_LBM[..., None].expand(L, B, M, 4))
    tgt_LBM4 = t.boxes_BM4[None].expand(L, B, M, 4)
    loss_bbox = torch.where(matched_LBM[..., None], (pred_LBM4 - tgt_LBM4).abs(), 0.0).sum((1, 2, 3)) / n
    loss_giou = _giou_sums(giou_impl, center_to_corners(pred_LBM4), center_to_corners(tgt_LBM4), matched_LBM) / n

    with torch.no_grad():
        if focal_alpha is None:  # predicted non-empty: "no object" is not the top class / some sigmoid above 0.5
            card_LB = (logits_LBQC.argmax(-1) != C).sum(-1).float()
        else:
            card_LB = (logits_LBQC.sigmoid().max(-1).values > 0.5).sum(-1).float()
        card = (card_LB - torch.tensor(t.counts, dtype=torch.float32, device=device)).abs().mean(-1)
    loss_dict = {}
    for layer in [L - 1, *range(L - 1)]:
        sfx = "" if layer == L - 1 else f"_{layer}"
        loss_dict.update({f"loss_ce{sfx}": loss_ce[layer], f"loss_bbox{sfx}": loss_bbox[layer],
                          f"loss_giou{sfx}": loss_giou[layer], f"cardinality_error{sfx}": card[layer]})
    loss = (loss_ce + bbox_loss_coefficient * loss_bbox + giou_loss_coefficient * loss_giou).sum()
    return loss, loss_dict


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


def _giou_sums(giou_impl: str, pred_LBM4: Tensor, tgt_LBM4: Tensor, matched_LBM: Tensor) -> Tensor:
    """Per layer ``[L]``: the sum of 1 - GIoU over the matched pairs, as ``giou_impl`` runs it."""
    L = pred_LBM4.shape[0]
    if giou_impl in ("padded", "kernel"):  # unmatched slots hold an inverted box: padding to the loss
        pad = torch.tensor(PAD_BOX, dtype=tgt_LBM4.dtype, device=tgt_LBM4.device)
        tgt = torch.where(matched_LBM[..., None], tgt_LBM4, pad)
        loss = giou_loss_padded(pred_LBM4.flatten(0, 1), tgt.flatten(0, 1), reduction="none", eps=0.0,
                                impl="kernel" if giou_impl == "kernel" else "torch", validate=False)
        return loss.view(L, -1).sum(1)
    sums = []
    for layer in range(L):
        m = matched_LBM[layer]
        if giou_impl == "concat":
            sums.append(giou_loss_concat(pred_LBM4[layer][m], tgt_LBM4[layer][m], eps=0.0, validate=False))
        else:
            preds = [p[mm] for p, mm in zip(pred_LBM4[layer], m)]
            tgts = [g[mm] for g, mm in zip(tgt_LBM4[layer], m)]
            sums.append(giou_loss_per_sample(preds, tgts, eps=0.0, validate=False))
    return torch.stack(sums)


SET_PREDICTION = Loss(
    name="set_prediction",
    description="DETR's set loss (Hungarian matching, class CE + L1 + GIoU, auxiliary layers), transformers' terms",
    functions=("set_prediction_loss",),
    impls=GIOU_IMPLS,
    kernel_ops=r"^fastzoo::giou",
    fused_op=r"^fastzoo::giou",
    fused_impls=("kernel",),
    bench="fastzoo.bench.set_loss",
)
