"""The detector's Hungarian matcher per training step: 256 images x 100 queries, 1-4 boxes each.

The peer: DETR's ``HungarianMatcher`` algorithm (Carion et al. 2020, ``models/matcher.py``)
-- the cost of every query against every box of the *batch*, ``[B*Q, N]``, copied to the host
and split per image. fastzoo's
``BoxDetector.match`` -- each image's queries against its own boxes only, in the padded layout
``[B, Q, M]`` (M = most boxes in an image), one host copy per batch. Both then run scipy's
``linear_sum_assignment`` per image. Parity: the same assignment.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.tasks import DETECTION


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


def detr_match(boxes_BQ4, logits_BQK, targets, cost_class=1.0, cost_bbox=5.0, cost_giou=2.0) -> torch.Tensor:
    """DETR's matcher on xyxy boxes: the whole batch's cost, then per-image slices (the query of
    each target box, concatenated order)."""
    from scipy.optimize import linear_sum_assignment

    from fastzoo.losses.giou import generalized_box_iou

    B, Q = boxes_BQ4.shape[:2]
    out_prob = logits_BQK.flatten(0, 1).softmax(-1)
    out_bbox = boxes_BQ4.flatten(0, 1)
    cost = (cost_bbox * torch.cdist(out_bbox, targets.boxes, p=1) - cost_class * out_prob[:, targets.labels]
            - cost_giou * generalized_box_iou(out_bbox, targets.boxes))
    cost = cost.view(B, Q, -1).cpu()
    query = torch.empty(targets.num_boxes, dtype=torch.long)
    start = 0
    for b, c in enumerate(cost.split(list(targets.counts), -1)):
        rows, cols = linear_sum_assignment(c[b].numpy())
        query[start + torch.as_tensor(cols, dtype=torch.long)] = torch.as_tensor(rows, dtype=torch.long)
        start += targets.counts[b]
    return query.to(boxes_BQ4.device)


def matcher_suite(setting: MatcherSetting = TARGET_SETTING, *, device="cpu", seed: int = 0) -> Suite:
    import fastzoo
    from fastzoo.bench.giou import random_boxes
    from fastzoo.registry import specs
    from fastzoo.data.boxes import collate_boxes

    device, s = torch.device(device), setting
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, s.max_boxes + 1, (s.images,), generator=g).tolist()
    targets = collate_boxes([random_boxes(n, g) for n in counts],
                            [torch.randint(0, s.num_classes, (n,), generator=g) for n in counts]).to(device)
    outputs = {"boxes": random_boxes(s.images * s.queries, g).view(s.images, s.queries, 4).to(device),
               "logits": torch.randn(s.images, s.queries, s.num_classes + 1, generator=g).to(device)}
    # only the matcher runs: the detector's tiny config carries its settings (DETR's cost weights)
    spec = next(spec for spec in specs() if spec.task is DETECTION)
    det = fastzoo.create(spec.variants[0].name, **{**spec.tiny, "num_queries": s.queries, "num_classes": s.num_classes,
                                                   "matcher": "hungarian"}).to(device)

    def step(match) -> Step:
        return Step(run=lambda: match(), items=s.images,
                    outputs=lambda: {"output": match().float()})

    def detr():
        return detr_match(outputs["boxes"], outputs["logits"], targets)

    def fastzoo_match():
        return det.match(outputs, targets)

    cases = [Case("DETR's matcher (batch cost [B*Q, N])", lambda: step(detr), peer=True, reference=True),
             Case("fastzoo match (per-image cost [B, Q, M])", lambda: step(fastzoo_match))]
    config = {"batch": s.describe(), "step": "the matcher alone (cost on the device, one host copy, scipy per image)",
              "real boxes": sum(counts)}
    group = Group(f"{s.name} | matcher per step", cases, reference=lambda: {"output": detr().float()}, unit="images/s",
                  cpu_memory=True)
    return Suite("matcher", [group], config=config, device=device)


BATCH_FIELD = "images"  # the setting's field --batch-size sets


def cli_suite(setting, *, device, dtype) -> Suite:
    """``fastzoo bench`` with this module's ``TARGET_SETTING`` changed by ``--set`` / ``--batch-size``."""
    return matcher_suite(setting, device=device)

