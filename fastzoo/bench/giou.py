"""GIoU loss on detection-shaped batches: B images x up to 256 box slots, few real boxes each.

Forward + backward of the summed loss over the real (pred, target) pairs, five ways:
a Python loop over images calling torchvision per image (the naive version), ``concat`` (gather the real pairs, one
call), ``padded`` (every slot, masked), ``kernel`` (fastzoo's fused kernel on the real
pairs), and the peer: ``torchvision.ops.generalized_box_iou_loss`` on the concatenated
real pairs. Parity compares the loss and its gradient with torchvision in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastzoo.bench.harness import Case, Group, Step, Suite, Unavailable


@dataclass(frozen=True)
class GIoUSetting:
    name: str
    images: int
    slots: int
    max_boxes: int  # real boxes per image: uniform in [1, max_boxes]

    def describe(self) -> str:
        return f"{self.images} images x {self.slots} box slots, 1-{self.max_boxes} real boxes per image"


TARGET_SETTING = GIoUSetting("256 images, 256 slots", 256, 256, 4)


def _giou_loss():
    try:
        from fastzoo.losses import giou_loss
    except ImportError as e:
        raise Unavailable("needs `fastzoo.losses.giou_loss` (branch det) in this checkout") from e
    return giou_loss


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
    valid = torch.arange(s.slots)[None, :] < counts[:, None]  # [B, N]: real boxes first, padding after
    # Padding slots hold a fixed valid box pair, so the padded variant never divides by zero.
    pred0 = random_boxes(s.images * s.slots, g).view(s.images, s.slots, 4).to(device, dtype)
    target = random_boxes(s.images * s.slots, g).view(s.images, s.slots, 4).to(device, dtype)
    valid = valid.to(device)
    counts_list = counts.tolist()

    def leaf():
        return pred0.clone().requires_grad_(True)

    def loss_step(losses_of) -> Step:
        """``losses_of(pred)`` -> the loss of every real pair, image by image; the step backpropagates their sum."""
        pred = leaf()

        def run():
            pred.grad = None
            losses = losses_of(pred)
            losses.sum().backward()
            return losses

        def outputs():  # per pair, so that the tolerance does not grow with the number of boxes
            return {"output": run().detach().float(), "grad:pred": pred.grad.float().clone()}

        return Step(run=run, items=int(counts.sum()), outputs=outputs)

    def torchvision_concat(pred):
        from torchvision.ops import generalized_box_iou_loss

        return generalized_box_iou_loss(pred[valid], target[valid])

    def per_sample(pred):  # the naive version: one call per image on its real boxes
        from torchvision.ops import generalized_box_iou_loss

        return torch.cat([generalized_box_iou_loss(pred[i, :n], target[i, :n]) for i, n in enumerate(counts_list)])

    def concat(pred, impl="torch"):
        return _giou_loss()(pred[valid], target[valid], reduction="none", impl=impl)

    def padded(pred):
        return _giou_loss()(pred, target, reduction="none")[valid]

    def reference():
        pred = pred0.float().clone().requires_grad_(True)
        from torchvision.ops import generalized_box_iou_loss

        losses = generalized_box_iou_loss(pred[valid], target.float()[valid])
        losses.sum().backward()
        return {"output": losses.detach(), "grad:pred": pred.grad}

    def fz(loss_of):
        def build():
            _giou_loss()  # fails early, with what is missing
            return loss_step(loss_of)
        return build

    cases = [
        Case("torchvision on concatenated real pairs", lambda: loss_step(torchvision_concat), peer=True, reference=True),
        Case("per-sample loop (torchvision per image)", lambda: loss_step(per_sample)),
        Case("fastzoo concat", fz(concat)),
        Case("fastzoo padded", fz(padded)),
        Case("fastzoo kernel", fz(lambda pred: concat(pred, impl="kernel"))),
    ]
    config = {"batch": s.describe(), "step": "forward + backward of the summed loss",
              "peer": "torchvision.ops.generalized_box_iou_loss on the concatenated real pairs",
              "real boxes": int(counts.sum())}
    return Suite("giou", [Group(f"{s.name} | fwd+bwd", cases, reference=reference, unit="boxes/s")],
                 config=config, dtype=dtype, device=device)
