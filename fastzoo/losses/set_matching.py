"""The matcher of the set losses (DETR, Carion et al. 2020, and its descendants): a batch's targets
padded to ``[B, M]``, the matching cost of every decoder layer's queries against their own image's
boxes, and the one-to-one assignment -- Hungarian (scipy's solver, on the host) or by index (the
denoising groups of DN-DETR / RT-DETR, whose queries are built from the targets in a known order).

The cost is transformers' (``DetrHungarianMatcher``, ``DeformableDetrHungarianMatcher``,
``RTDetrHungarianMatcher``): ``bbox_cost`` x L1(cxcywh) + ``class_cost`` x class term - ``giou_cost`` x GIoU(xyxy),
the class term ``-p(target class)`` of a softmax, or the focal cost of per-class sigmoids
``alpha (1-p)^gamma (-log p) - (1-alpha) p^gamma (-log(1-p))``. GIoU is transformers' formula (no epsilon).

Every Hungarian-matched layer's cost and the target checks reach the host in one read
(:func:`hungarian`): the cost of each stack of layers ``[L, B, Q, M]`` is computed on the device per
image (no ``[B*Q, N]`` cross-image matrix), and the assignment goes back as one ``[L, B, M]`` query index
per stack (a copy to the device, no read).

Errors: labels that are not a list of ``{"class_labels": [n] int, "boxes": [n, 4] float}``, boxes that
are not finite or leave [0, 1] (a negative width or height, pixel coordinates), class ids outside
``[0, num_classes)`` raise ``ValueError`` naming the image; a non-finite matching cost (NaN / Inf
predictions, which make scipy fail inside transformers) names the layer and the image.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


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
    (free, :func:`check_labels`), values with the cost's host read (:func:`hungarian`)."""
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


def corners_to_center(b: Tensor) -> Tensor:
    """(x1, y1, x2, y2) -> (cx, cy, w, h), transformers' ``corners_to_center_format``."""
    x0, y0, x1, y1 = b.unbind(-1)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def pairwise_giou(a: Tensor, b: Tensor) -> Tensor:
    """GIoU ``[..., Q, M]`` between xyxy boxes ``a [..., Q, 4]`` and ``b [..., M, 4]``, transformers'
    (DETR's) formula: no epsilon, intersection and enclosure clamped at 0. Each coordinate apart: every
    intermediate a contiguous ``[..., Q, M]`` (half the time of ``[..., Q, M, 2]`` slices, the same values)."""
    ax1, ay1, ax2, ay2 = (x[..., :, None] for x in a.unbind(-1))
    bx1, by1, bx2, by2 = (x[..., None, :] for x in b.unbind(-1))
    area_a, area_b = (ax2 - ax1) * (ay2 - ay1), (bx2 - bx1) * (by2 - by1)
    inter = ((torch.min(ax2, bx2) - torch.max(ax1, bx1)).clamp(min=0)
             * (torch.min(ay2, by2) - torch.max(ay1, by1)).clamp(min=0))
    union = area_a + area_b - inter
    area_c = ((torch.max(ax2, bx2) - torch.min(ax1, bx1)).clamp(min=0)
              * (torch.max(ay2, by2) - torch.min(ay1, by1)).clamp(min=0))
    return inter / union - (area_c - union) / area_c


def paired_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU ``[...]`` of xyxy pairs ``a [..., 4]``, ``b [..., 4]``: transformers' ``box_iou`` (no epsilon)
    on the diagonal, as RT-DETR's varifocal target takes it."""
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    wh = (torch.min(a[..., 2:], b[..., 2:]) - torch.max(a[..., :2], b[..., :2])).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area_a + area_b - inter)


@dataclass(frozen=True)
class MatchCost:
    """The matcher's weights, and its class term: ``focal`` = (alpha, gamma) of the sigmoid focal cost
    (Deformable DETR: (0.25, 2); RT-DETR: ``matcher_alpha``, ``matcher_gamma``), None: ``-softmax``."""

    class_cost: float = 1.0
    bbox_cost: float = 5.0
    giou_cost: float = 2.0
    focal: tuple[float, float] | None = None


@torch.no_grad()
def matching_cost(logits_LBQC: Tensor, boxes_LBQ4: Tensor, t: PaddedTargets, cost: MatchCost) -> Tensor:
    """The matching cost of every layer's queries against its own image's boxes ``[L, B, Q, M]``."""
    L, B, Q, C = logits_LBQC.shape
    M = t.labels_BM.shape[1]
    # a class id out of range is refused by name after this read (_target_problems): clamped here so
    # the gather does not fail first (a RuntimeError on the CPU, a device-side assert on CUDA)
    labels_LBQM = t.labels_BM.clamp(0, C - 1)[None, :, None, :].expand(L, B, Q, M)
    if cost.focal is None:
        class_LBQM = -logits_LBQC.softmax(-1).gather(-1, labels_LBQM)
    else:
        alpha, gamma = cost.focal
        p_LBQM = logits_LBQC.sigmoid().gather(-1, labels_LBQM)
        neg = (1 - alpha) * (p_LBQM ** gamma) * (-(1 - p_LBQM + 1e-8).log())
        pos = alpha * ((1 - p_LBQM) ** gamma) * (-(p_LBQM + 1e-8).log())
        class_LBQM = pos - neg
    l1_LBQM = sum((boxes_LBQ4[..., k, None] - t.boxes_BM4[None, :, None, :, k]).abs() for k in range(4))  # no [.., 4] temporary
    giou_LBQM = pairwise_giou(center_to_corners(boxes_LBQ4), center_to_corners(t.boxes_BM4)[None])
    return cost.bbox_cost * l1_LBQM + cost.class_cost * class_LBQM + cost.giou_cost * -giou_LBQM


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


def assign(cost_LBQM: np.ndarray, counts, layer_names=None) -> np.ndarray:
    """scipy's Hungarian solver per (layer, image) on the host: the query of each target slot
    ``[L, B, M]`` (-1: padding, or a box left unmatched when an image has more boxes than queries).
    ``layer_names``: how an error names each layer (default: DETR's decoder layers, the last one final)."""
    from scipy.optimize import linear_sum_assignment

    L, B, Q, M = cost_LBQM.shape
    query = np.full((L, B, M), -1, dtype=np.int64)
    for b, n in enumerate(counts):
        if n == 0:
            continue
        for layer in range(L):
            c = cost_LBQM[layer, b, :, :n]
            if not np.isfinite(c).all():
                which = (layer_names[layer] if layer_names is not None else
                         "the last decoder layer" if layer == L - 1 else f"auxiliary decoder layer {layer}")
                raise ValueError(f"the matching cost of {which} (of {L}), image {b}, is not finite: its predicted "
                                 f"boxes or logits hold NaN or Inf")
            rows, cols = linear_sum_assignment(c)
            query[layer, b, cols] = rows
    return query


def hungarian(stacks, t: PaddedTargets, cost: MatchCost, num_classes: int, names=None) -> list[Tensor]:
    """The query of each target slot ``[L, B, M]`` (on the device; -1: none) for each stack of layers
    ``(logits_LBQC, boxes_LBQ4)`` in ``stacks`` (their Q may differ): every stack's cost and the target
    checks in one host read. ``names``: per stack, how an error names each of its layers."""
    device = t.labels_BM.device
    M = t.labels_BM.shape[1]
    if not M:
        return [torch.full((lg.shape[0], lg.shape[1], 0), -1, dtype=torch.long, device=device) for lg, _ in stacks]
    costs = [matching_cost(lg.detach(), bx.detach(), t, cost) for lg, bx in stacks]
    host = torch.cat([*(c.float().flatten() for c in costs), _target_problems(t, num_classes)]).cpu().numpy()
    if host[-2:].any():
        _raise_target_problem(host[-2:], t, num_classes)
    out, start = [], 0
    for i, c in enumerate(costs):
        size = c.numel()
        query = assign(host[start:start + size].reshape(c.shape), t.counts, None if names is None else names[i])
        out.append(torch.from_numpy(query).to(device, non_blocking=True))
        start += size
    return out


def by_index(t: PaddedTargets, groups: int, layers: int) -> Tensor:
    """The denoising queries' match (DN-DETR / RT-DETR's contrastive denoising groups): ``groups`` groups of
    ``2 M`` queries, the first M of each built from the image's targets in order (the rest negatives), so
    target slot ``g M + j`` is query ``g 2M + j`` for ``j`` below the image's box count, -1 above;
    ``[layers, B, groups M]`` on the device, no read."""
    M = t.labels_BM.shape[1]
    g = torch.arange(groups, device=t.mask_BM.device)
    j = torch.arange(M, device=t.mask_BM.device)
    query_GM = (g[:, None] * 2 * M + j[None, :])
    query_BGM = torch.where(t.mask_BM[:, None, :], query_GM[None], -1)
    return query_BGM.flatten(1)[None].expand(layers, -1, -1)
