"""DETR's Hungarian matcher per training step: 256 images x 100 queries, 1-4 boxes each.

The peer: DETR's ``HungarianMatcher`` algorithm (Carion et al. 2020, ``models/matcher.py``, as
transformers' ``DetrHungarianMatcher``) -- the cost of every query against every box of the
*batch*, ``[B*Q, N]``, copied to the host and split per image. fastzoo's set loss
(``fastzoo.losses.set_matching``: ``matching_cost`` and ``assign``) -- each image's queries
against its own boxes only, in the padded layout ``[B, Q, M]`` (M = most boxes in an image), one
host copy per batch. Both then run scipy's ``linear_sum_assignment`` per image. Parity: the same
assignment.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.losses.set_matching import MatchCost, assign, center_to_corners, matching_cost, pad_targets, pairwise_giou


@dataclass(frozen=True)
class MatcherSetting:
    name: str
    images: int
    queries: int
    max_boxes: int
    num_classes: int = 91  # COCO's label space, as DETR

    def describe(self) -> str:
        return f"{self.images} images x {self.queries} queries, 1-{self.max_boxes} boxes per image, {self.num_classes} classes"


TARGET_SETTING = MatcherSetting("256 images, 100 queries", 256, 100, 4)


def detr_match(boxes_BQ4, logits_BQC, labels, cost_class=1.0, cost_bbox=5.0, cost_giou=2.0) -> torch.Tensor:
    """DETR's matcher on cxcywh boxes: the whole batch's cost, then per-image slices; the query
    of each target box, concatenated order."""
    from scipy.optimize import linear_sum_assignment

    B, Q = boxes_BQ4.shape[:2]
    tgt_boxes = torch.cat([t["boxes"] for t in labels])
    tgt_ids = torch.cat([t["class_labels"] for t in labels])
    out_prob = logits_BQC.flatten(0, 1).softmax(-1)
    out_bbox = boxes_BQ4.flatten(0, 1)
    cost = (cost_bbox * torch.cdist(out_bbox, tgt_boxes, p=1) - cost_class * out_prob[:, tgt_ids]
            - cost_giou * pairwise_giou(center_to_corners(out_bbox), center_to_corners(tgt_boxes)))
    cost = cost.view(B, Q, -1).cpu()
    counts = [len(t["boxes"]) for t in labels]
    query = torch.empty(sum(counts), dtype=torch.long)
    start = 0
    for b, c in enumerate(cost.split(counts, -1)):
        rows, cols = linear_sum_assignment(c[b].numpy())
        query[start + torch.as_tensor(cols, dtype=torch.long)] = torch.as_tensor(rows, dtype=torch.long)
        start += counts[b]
    return query.to(boxes_BQ4.device)


def fastzoo_match(boxes_BQ4, logits_BQC, labels) -> torch.Tensor:
    """The set loss's matching (one layer): per-image padded cost, one host copy, the same scipy
    solver; the query of each target box in the same concatenated order as :func:`detr_match`."""
    t = pad_targets(labels, boxes_BQ4.shape[0], boxes_BQ4.device)
    cost = matching_cost(logits_BQC[None], boxes_BQ4[None], t, MatchCost(1.0, 5.0, 2.0))
    query_BM = torch.from_numpy(assign(cost.cpu().numpy(), t.counts)[0])
    return query_BM[t.mask_BM.cpu()].to(boxes_BQ4.device)


def matcher_suite(setting: MatcherSetting = TARGET_SETTING, *, device="cpu", seed: int = 0) -> Suite:
    from fastzoo.bench.giou import random_boxes

    device, s = torch.device(device), setting
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, s.max_boxes + 1, (s.images,), generator=g).tolist()
    labels = [{"boxes": _cxcywh(random_boxes(n, g)).to(device),
               "class_labels": torch.randint(0, s.num_classes, (n,), generator=g).to(device)} for n in counts]
    boxes = _cxcywh(random_boxes(s.images * s.queries, g)).view(s.images, s.queries, 4).to(device)
    logits = torch.randn(s.images, s.queries, s.num_classes + 1, generator=g).to(device)

    def step(match) -> Step:
        return Step(run=lambda: match(boxes, logits, labels), items=s.images,
                    outputs=lambda: {"output": match(boxes, logits, labels).float()})

    cases = [Case("DETR's matcher (batch cost [B*Q, N])", lambda: step(detr_match), peer=True, reference=True),
             Case("fastzoo match (per-image cost [B, Q, M])", lambda: step(fastzoo_match))]
    config = {"batch": s.describe(), "step": "the matcher alone (cost on the device, one host copy, scipy per image)",
              "real boxes": sum(counts)}
    group = Group(f"{s.name} | matcher per step", cases,
                  reference=lambda: {"output": detr_match(boxes, logits, labels).float()}, unit="images/s",
                  cpu_memory=True)
    return Suite("matcher", [group], config=config, device=device)


def _cxcywh(xyxy: torch.Tensor) -> torch.Tensor:
    return torch.cat([(xyxy[..., :2] + xyxy[..., 2:]) / 2, xyxy[..., 2:] - xyxy[..., :2]], -1)


BATCH_FIELD = "images"  # the setting's field --batch-size sets


def cli_suite(setting, *, device, dtype) -> Suite:
    """``fastzoo bench`` with this module's ``TARGET_SETTING`` changed by ``--set`` / ``--batch-size``."""
    return matcher_suite(setting, device=device)

