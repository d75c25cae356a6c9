"""GIoU loss on detection-shaped batches: B images x 256 box slots, about a tenth of them real.

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

Each group also times its floor (:func:`fastzoo.bench.limits.autograd_floor_step`: one
autograd call on the same tensors -- clone, one elementwise op, sum, backward), interleaved
with the cases, and reports every case's time ÷ the floor's and its bytes/s (pred and target
read, the mask read, pred's gradient written) as a share of the same-run copy bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from fastzoo.bench import limits as machine
from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.losses import giou as G


@dataclass(frozen=True)
class GIoUSetting:
    name: str
    images: int
    slots: int
    max_boxes: int  # real boxes per image: uniform in [1, max_boxes]

    def describe(self) -> str:
        return f"{self.images} images x {self.slots} box slots, 1-{self.max_boxes} real boxes per image"


# 1-51 real boxes of 256 slots: 10 % of the slots on average, the floor goal's setting
TARGET_SETTING = GIoUSetting("256 images x 256 slots, 10% real", 256, 256, 51)


def random_boxes(n: int, g: torch.Generator) -> Tensor:
    """[n, 4] valid xyxy boxes in [0, 1]."""
    xy = torch.rand(n, 2, generator=g) * 0.7
    wh = torch.rand(n, 2, generator=g) * 0.3 + 0.01
    return torch.cat([xy, xy + wh], dim=1)


@dataclass
class Batch:
    """One padded batch: real boxes first in each image, as ``collate_boxes`` lays them out."""

    pred_BM4: Tensor  # the predictions every step starts from (a fresh leaf per case)
    target_BM4: Tensor
    target_marked_BM4: Tensor  # padding marked by PAD_BOX in the target itself (collate_boxes's form)
    valid_BM: Tensor
    counts: list[int]  # real boxes per image
    pred_N4: Tensor  # the real pairs, gathered once (what a matcher hands the loss)
    target_N4: Tensor

    @property
    def real(self) -> int:
        return sum(self.counts)


def make_batch(s: GIoUSetting, device: torch.device, dtype: torch.dtype, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, s.max_boxes + 1, (s.images,), generator=g)
    valid = (torch.arange(s.slots)[None, :] < counts[:, None]).to(device)
    pred = random_boxes(s.images * s.slots, g).view(s.images, s.slots, 4).to(device, dtype)
    target = random_boxes(s.images * s.slots, g).view(s.images, s.slots, 4).to(device, dtype)
    marked = torch.where(valid[..., None], target, torch.tensor(G.PAD_BOX, dtype=dtype, device=device))
    return Batch(pred, target, marked, valid, counts.tolist(), pred[valid], target[valid])


def step_bytes(boxes: int, dtype: torch.dtype, masked: bool) -> int:
    """Bytes a fwd+bwd must move at least: pred and target read, pred's gradient written (and the
    bool mask read, for a padded batch)."""
    return boxes * (3 * 4 * dtype.itemsize + (1 if masked else 0))


def loss_step(loss_of: Callable[[Tensor], Tensor], start: Tensor, items: int, nbytes: int) -> Step:
    """Forward + backward of ``loss_of(pred)`` on a fresh leaf copy of ``start``."""
    pred = start.clone().requires_grad_(True)

    def run():
        pred.grad = None
        loss = loss_of(pred)
        loss.backward()
        return loss

    def outputs():
        loss = run()
        return {"output": loss.detach().float().reshape(1), "grad:pred": pred.grad.float().clone()}

    return Step(run=run, items=items, outputs=outputs, bytes=nbytes)


def floor_step(x: Tensor, other: Tensor, items: int, nbytes: int) -> Step:
    return Step(run=machine.autograd_floor_step(x, other), items=items, bytes=nbytes)


def torchvision_mean(pred: Tensor, target: Tensor) -> Tensor:
    """The peer: torchvision's GIoU loss, mean over the pairs."""
    from torchvision.ops import generalized_box_iou_loss  # the [bench] extra

    return generalized_box_iou_loss(pred, target, reduction="mean")


FLOOR_LABEL = "floor: one autograd call (clone, x * target, sum, backward)"


# -- the padded batch, gathering included ------------------------------------------------------
# Predictions from a box head are valid by construction: no value checks (a host sync on GPU).
def padded_losses(b: Batch) -> dict[str, Callable[[Tensor], Tensor]]:
    """label -> the mean loss of the real pairs from the padded predictions, one per layout."""
    valid, target = b.valid_BM, b.target_BM4

    def per_sample(pred):
        preds = [pred[i, :n] for i, n in enumerate(b.counts)]
        targets = [target[i, :n] for i, n in enumerate(b.counts)]
        return G.giou_loss_per_sample(preds, targets, reduction="mean", validate=False)

    return {
        "fastzoo per-sample loop": per_sample,
        "fastzoo concat": lambda pred: G.giou_loss_concat(pred[valid], target[valid], reduction="mean", validate=False),
        "fastzoo padded": lambda pred: G.giou_loss_padded(pred, target, valid, reduction="mean", impl="torch",
                                                          validate=False),
        "fastzoo kernel": lambda pred: G.giou_loss_kernel(pred[valid], target[valid], reduction="mean", validate=False),
        "fastzoo padded kernel (mask)": lambda pred: G.giou_loss_padded(pred, target, valid, reduction="mean",
                                                                        impl="kernel", validate=False),
        # the padding is in the targets, as collate_boxes writes them
        "fastzoo padded kernel (validity from target)": lambda pred: G.giou_loss_padded(
            pred, b.target_marked_BM4, reduction="mean", impl="kernel", validate=False),
    }


def padded_group(s: GIoUSetting, b: Batch) -> Group:
    slots, nbytes = b.valid_BM.numel(), step_bytes(b.valid_BM.numel(), b.pred_BM4.dtype, masked=True)
    valid, target = b.valid_BM, b.target_BM4

    def torchvision_concat(pred, target=target):
        return torchvision_mean(pred[valid], target[valid])

    def reference():
        pred = b.pred_BM4.float().clone().requires_grad_(True)
        loss = torchvision_concat(pred, target.float())
        loss.backward()
        return {"output": loss.detach().reshape(1), "grad:pred": pred.grad}

    def case(label, loss_of, **kw):
        return Case(label, lambda: loss_step(loss_of, b.pred_BM4, b.real, nbytes), **kw)

    cases = [case("torchvision on concatenated real pairs", torchvision_concat, peer=True, reference=True)]
    cases += [case(label, loss_of) for label, loss_of in padded_losses(b).items()]
    cases.append(Case(FLOOR_LABEL, lambda: floor_step(b.pred_BM4, target, b.real, nbytes), floor=True))
    return Group(f"{s.name} | fwd+bwd, gather included ({slots} slots)", cases, reference=reference, unit="boxes/s")


# -- the real pairs, already concatenated --------------------------------------------------------
def pairs_group(s: GIoUSetting, b: Batch) -> Group:
    nbytes = step_bytes(b.real, b.pred_N4.dtype, masked=False)
    target = b.target_N4

    def reference():
        pred = b.pred_N4.float().clone().requires_grad_(True)
        loss = torchvision_mean(pred, target.float())
        loss.backward()
        return {"output": loss.detach().reshape(1), "grad:pred": pred.grad}

    def case(label, loss_of, **kw):
        return Case(label, lambda: loss_step(loss_of, b.pred_N4, b.real, nbytes), **kw)

    cases = [
        case("torchvision (pairs given)", lambda pred: torchvision_mean(pred, target), peer=True, reference=True),
        case("fastzoo kernel (pairs given)", lambda pred: G.giou_loss_kernel(pred, target, reduction="mean",
                                                                             validate=False)),
        Case(FLOOR_LABEL, lambda: floor_step(b.pred_N4, target, b.real, nbytes), floor=True),
    ]
    return Group(f"{s.name} | fwd+bwd, loss on concatenated pairs ({b.real} pairs)", cases, reference=reference,
                 unit="boxes/s")


def giou_suite(setting: GIoUSetting = TARGET_SETTING, *, device="cpu", dtype=torch.float32, seed: int = 0,
               limits: machine.Limits | bool = True) -> Suite:
    """Both groups on one batch. ``limits``: True measures the machine's limits in this run
    (:func:`fastzoo.bench.limits.measure`, quick), or pass ones measured for several suites; False:
    the floor rows alone."""
    device = torch.device(device)
    b = make_batch(setting, device, dtype, seed)
    if limits is True:
        limits = machine.measure(device, dtypes=(dtype,), quick=True)
    config = {"batch": setting.describe(), "step": "forward + backward of the mean loss over the real pairs",
              "peer": "torchvision.ops.generalized_box_iou_loss on the concatenated real pairs",
              "real boxes": b.real, "real share of the slots": f"{b.real / b.valid_BM.numel():.1%}",
              "validation": "validate=False (predictions are valid boxes)", "kernel path": G.kernel_path(device),
              "bytes per step": "pred and target read, pred's gradient written (+ the bool mask, padded)",
              "timing": "cases interleaved in rounds"}
    return Suite("giou", [padded_group(setting, b), pairs_group(setting, b)], config=config, dtype=dtype,
                 device=device, limits=limits or None, interleave=True)




BATCH_FIELD = "images"  # the setting's field --batch-size sets


def cli_suite(setting, *, device, dtype) -> Suite:
    """``fastzoo bench`` with this module's ``TARGET_SETTING`` changed by ``--set`` / ``--batch-size``."""
    return giou_suite(setting, device=device, dtype=dtype)

