"""GIoU loss on detection-shaped batches: B images x up to 256 box slots, few real boxes each.

Forward + backward of the mean loss over the real (pred, target) pairs, in the layouts of
:mod:`fastzoo.losses.giou`: a Python loop over images (the naive baseline), ``concat`` (the
real pairs gathered, one call), ``padded`` (every slot, masked, plain ops), ``kernel`` (the
real pairs gathered, through the fused elementwise op) and the padded kernel (the fused op on
the padded tensors, validity from a mask or from the targets, the masked mean inside: no
gather); the peer is ``torchvision.ops.generalized_box_iou_loss`` on the concatenated real
pairs. Gathering the real pairs is part of every step that needs it, as it is in a training
loop on padded data. A second group times the loss alone on pairs already concatenated
(what a matcher hands the loss): torchvision vs the fused kernel, both on the same [N, 4]
leaf. Parity: the loss and the gradient of the predicted boxes against torchvision in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastzoo.bench.harness import Case, Group, Step, Suite, Unavailable
from fastzoo.losses.giou import PAD_BOX


@dataclass(frozen=True)
class GIoUSetting:
    name: str
    images: int
    slots: int
    max_boxes: int  # real boxes per image: uniform in [1, max_boxes]

    def describe(self) -> str:
        return f"{self.images} images x {self.slots} box slots, 1-{self.max_boxes} real boxes per image"


TARGET_SETTING = GIoUSetting("256 images, 256 slots", 256, 256, 4)


def _losses():
    try:
        from fastzoo import losses
    except ImportError as e:
        raise Unavailable("needs `fastzoo.losses` (branch det) in this checkout") from e
    return losses


def random_boxes(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, 4] valid xyxy boxes in [0, 1]."""
    xy = torch.rand(n, 2, generator=g) * 0.7
    wh = torch.rand(n, 2, generator=g) * 0.3 + 0.01
    return torch.cat([xy, xy + wh], dim=1)


def giou_suite(setting: GIoUSetting = TARGET_SETTING, *, device="cpu", dtype=torch.float32, seed: int = 0) -> Suite:
    device = torch.device(device)
    s = setting
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, s.max_boxes + 1, (s.images,), generator=g)
    valid = (torch.arange(s.slots)[None, :] < counts[:, None]).to(device)  # [B, N]: real boxes first
    pred0 = random_boxes(s.images * s.slots, g).view(s.images, s.slots, 4).to(device, dtype)
    target = random_boxes(s.images * s.slots, g).view(s.images, s.slots, 4).to(device, dtype)
    counts_list = counts.tolist()

    def loss_step(loss_of, start=pred0) -> Step:
        pred = start.clone().requires_grad_(True)

        def run():
            pred.grad = None
            loss = loss_of(pred)
            loss.backward()
            return loss

        def outputs():
            loss = run()
            return {"output": loss.detach().float().reshape(1), "grad:pred": pred.grad.float().clone()}

        return Step(run=run, items=int(counts.sum()), outputs=outputs)

    pred_cat0, target_cat = pred0[valid], target[valid]  # the real pairs, gathered once

    def torchvision_concat(pred, target=target):
        from torchvision.ops import generalized_box_iou_loss

        return generalized_box_iou_loss(pred[valid], target[valid], reduction="mean")

    # Predictions from a box head are valid by construction: no value checks (a host sync on GPU).
    def per_sample(pred):
        preds = [pred[i, :n] for i, n in enumerate(counts_list)]
        targets = [target[i, :n] for i, n in enumerate(counts_list)]
        return _losses().giou_loss_per_sample(preds, targets, reduction="mean", validate=False)

    def concat(pred):
        return _losses().giou_loss_concat(pred[valid], target[valid], reduction="mean", validate=False)

    def padded(pred):
        return _losses().giou_loss_padded(pred, target, valid, reduction="mean", impl="torch", validate=False)

    def padded_kernel_mask(pred):
        return _losses().giou_loss_padded(pred, target, valid, reduction="mean", impl="kernel", validate=False)

    target_marked = torch.where(valid[..., None], target, torch.tensor(PAD_BOX, dtype=dtype, device=device))

    def padded_kernel_target(pred):  # the padding is in the targets, as collate_boxes writes them
        return _losses().giou_loss_padded(pred, target_marked, reduction="mean", impl="kernel", validate=False)

    def kernel(pred):
        return _losses().giou_loss_kernel(pred[valid], target[valid], reduction="mean", validate=False)

    def reference():
        pred = pred0.float().clone().requires_grad_(True)
        loss = torchvision_concat(pred, target.float())
        loss.backward()
        return {"output": loss.detach().reshape(1), "grad:pred": pred.grad}

    def reference_pairs():
        from torchvision.ops import generalized_box_iou_loss

        pred = pred_cat0.float().clone().requires_grad_(True)
        loss = generalized_box_iou_loss(pred, target_cat.float(), reduction="mean")
        loss.backward()
        return {"output": loss.detach().reshape(1), "grad:pred": pred.grad}

    def fz(loss_of, start=pred0):
        def build():
            _losses()  # fails early, saying what is missing
            return loss_step(loss_of, start)
        return build

    def torchvision_pairs(pred):
        from torchvision.ops import generalized_box_iou_loss

        return generalized_box_iou_loss(pred, target_cat, reduction="mean")

    def kernel_pairs(pred):
        return _losses().giou_loss_kernel(pred, target_cat, reduction="mean", validate=False)

    pair_cases = [
        Case("torchvision (pairs given)", lambda: loss_step(torchvision_pairs, pred_cat0), peer=True, reference=True),
        Case("fastzoo kernel (pairs given)", fz(kernel_pairs, pred_cat0)),
    ]

    cases = [
        Case("torchvision on concatenated real pairs", lambda: loss_step(torchvision_concat), peer=True, reference=True),
        Case("fastzoo per-sample loop", fz(per_sample)),
        Case("fastzoo concat", fz(concat)),
        Case("fastzoo padded", fz(padded)),
        Case("fastzoo kernel", fz(kernel)),
        Case("fastzoo padded kernel (mask)", fz(padded_kernel_mask)),
        Case("fastzoo padded kernel (validity from target)", fz(padded_kernel_target)),
    ]
    config = {"batch": s.describe(), "step": "forward + backward of the mean loss over the real pairs",
              "peer": "torchvision.ops.generalized_box_iou_loss on the concatenated real pairs",
              "real boxes": int(counts.sum()), "validation": "validate=False (predictions are valid boxes)"}
    try:
        config["kernel path"] = _losses().kernel_path(device)
    except Unavailable:
        pass
    groups = [
        Group(f"{s.name} | fwd+bwd, gather included", cases, reference=reference, unit="boxes/s"),
        Group(f"{s.name} | fwd+bwd, loss on concatenated pairs", pair_cases, reference=reference_pairs, unit="boxes/s"),
    ]
    return Suite("giou", groups,
                 config=config, dtype=dtype, device=device)
