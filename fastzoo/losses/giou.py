"""Generalized IoU loss (Rezatofighi et al. 2019, "Generalized Intersection over Union")
for xyxy boxes, equal to ``torchvision.ops.generalized_box_iou_loss`` in values and
gradients, and four ways to apply it to images with different numbers of boxes.

The formula (torchvision's, from fvcore; ``eps`` is added to both denominators)::

    inter = area of the intersection (0 unless it has positive width AND height)
    union = area(a) + area(b) - inter
    C     = area of the smallest box enclosing a and b
    loss  = 1 - (inter / (union + eps) - (C - union) / (C + eps))

fp16 / bf16 boxes are computed in fp32 and the loss is fp32, as torchvision does; integer
boxes (e.g. pixel coordinates) are upcast to fp32 first, as torchvision's ``_upcast_non_float``
does. pred and target may have different float dtypes (bf16 predictions from an autocast
region against fp32 targets): every path computes in fp32 (fp64 if either is fp64).

Two implementations behind one function, :func:`giou_loss` (``impl=``):

- ``"torch"``: the formula above in plain PyTorch ops; autograd differentiates it.
- ``"kernel"``: one fused op, ``torch.ops.fastzoo.giou_loss_fwd`` (see ``kernels/giou_op.py``)
  with a hand-written backward: a Triton kernel on CUDA, a C++ loop on CPU (built on first
  use; if the build fails, the same closed form in vectorised torch ops, with a warning).
  Registered through ``torch.library``, so it traces under ``torch.compile(fullgraph=True)``.
  ``kernel_path(device)`` says which one a device gets ("triton", "cpu-cpp" or
  "cpu-vectorised"); ``fastzoo.explain`` says which one a call actually ran (from the profiler).

Variable box counts (all four give the same number for the same matched pairs):

- :func:`giou_loss_per_sample` -- a Python loop over images (the naive baseline);
- :func:`giou_loss_concat` -- all pairs concatenated, one call;
- :func:`giou_loss_padded` -- ``[B, M, 4]`` padded pairs, validity from a ``[B, M]`` mask or
  from the target itself (an inverted box, :data:`PAD_BOX`, marks padding), through one fused
  op (``impl="kernel"``, the default) that also does the masked sum / mean: no gather, no
  dynamic shapes, no host sync;
- :func:`giou_loss_kernel` -- concatenated pairs through the fused elementwise kernel.

``fastzoo.data.boxes.collate_boxes`` builds all three layouts in one go on the CPU.

Validation (``validate=True``): shapes and dtypes are checked for free; values (NaN/Inf,
x2 < x1, y2 < y1) need one host sync on a GPU, so training loops that validated their
targets in the collator pass ``validate=False`` (predictions from a model's box head are
valid by construction). Shape errors are raised whatever ``validate`` says.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastzoo.kernel_ranges import kernel_range
from fastzoo.losses.registry import Loss

REDUCTIONS = ("none", "mean", "sum")
PAD_BOX = (0.0, 0.0, -1.0, -1.0)  # an inverted box: marks a padded slot of a padded target
IMPLS = ("auto", "torch", "kernel")


# -- checks -----------------------------------------------------------------------------
def check_boxes(boxes: torch.Tensor, name: str, *, values: bool = True) -> None:
    """Raise ValueError naming ``name`` unless ``boxes`` is a float [..., 4] tensor of finite
    xyxy boxes with x2 >= x1 and y2 >= y1 (zero width/height is legal)."""
    if not isinstance(boxes, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of xyxy boxes [..., 4], got {type(boxes).__name__}")
    if boxes.ndim == 0 or boxes.shape[-1] != 4:
        raise ValueError(f"{name} must have last dimension 4 (x1, y1, x2, y2), got shape {tuple(boxes.shape)}")
    if not boxes.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {boxes.dtype}")
    if not values or boxes.numel() == 0:
        return
    i = first_bad_box(boxes)
    if i is not None:
        b = boxes.detach().reshape(-1, 4)
        what = "is not finite" if not torch.isfinite(b[i]).all() else "has x2 < x1 or y2 < y1"
        raise ValueError(f"{name}: box {i} {what}: {b[i].tolist()}; boxes must be finite xyxy with x2 >= x1, y2 >= y1")


def first_bad_box(boxes: torch.Tensor) -> int | None:
    """Row of the first non-finite or inverted box of ``boxes`` [..., 4] (flattened), or None.
    One host sync on a GPU; one C++ pass on CPU once the C++ GIoU kernel is loaded."""
    if boxes.device.type == "cpu" and _giou_op().cpp_loaded():
        i = torch.ops.fastzoo.first_bad_box(boxes)
        return None if i < 0 else i
    b = boxes.detach().reshape(-1, 4)
    bad = ~torch.isfinite(b).all(-1) | (b[:, 2] < b[:, 0]) | (b[:, 3] < b[:, 1])
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def _upcast_integer(boxes, name: str):
    """Integer boxes -> fp32, as torchvision's ``_upcast_non_float`` (which also upcasts fp16/bf16;
    both paths here compute those in fp32 without a copy)."""
    if not isinstance(boxes, torch.Tensor) or boxes.is_floating_point():
        return boxes
    if boxes.dtype == torch.bool or boxes.is_complex():
        raise ValueError(f"{name} must hold real coordinates (floating point or integer), got {boxes.dtype}")
    return boxes.float()


def _check_options(reduction: str, impl: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: choose one of {', '.join(REDUCTIONS)}")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {', '.join(IMPLS)}")


def _check_pair(pred, target) -> None:
    """Shapes, dtypes and devices (free); the values are check_boxes's job."""
    check_boxes(pred, "pred", values=False)
    check_boxes(target, "target", values=False)
    if pred.shape != target.shape:
        raise ValueError(f"pred and target must have the same shape, got {tuple(pred.shape)} and {tuple(target.shape)}")
    if pred.device != target.device:
        raise ValueError(f"pred is on {pred.device} and target on {target.device}; put them on one device")


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean() if loss.numel() > 0 else 0.0 * loss.sum()  # torchvision: 0, still in the graph
    if reduction == "sum":
        return loss.sum()
    return loss


# -- the reference math -----------------------------------------------------------------
def giou_loss_reference(pred: torch.Tensor, target: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Elementwise 1 - GIoU in plain PyTorch ops, torchvision's formula and op order."""
    ct = _giou_op().compute_dtype(pred.dtype, target.dtype)  # fp32, or fp64 if either is fp64
    pred, target = pred.to(ct), target.to(ct)  # no-ops (no autograd node) when already ct
    x1, y1, x2, y2 = pred.unbind(-1)
    x1g, y1g, x2g, y2g = target.unbind(-1)
    iw = torch.min(x2, x2g) - torch.max(x1, x1g)
    ih = torch.min(y2, y2g) - torch.max(y1, y1g)
    # Boxes that only touch (or miss) intersect in 0; torch.where keeps their gradient 0 as well.
    inter = torch.where((iw > 0) & (ih > 0), iw * ih, torch.zeros_like(iw))
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    iou = inter / (union + eps)
    area_c = (torch.max(x2, x2g) - torch.min(x1, x1g)) * (torch.max(y2, y2g) - torch.min(y1, y1g))
    return 1 - (iou - (area_c - union) / (area_c + eps))


def generalized_box_iou(a_N4: torch.Tensor, b_M4: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Pairwise GIoU [..., N, M] between xyxy boxes [..., N, 4] and [..., M, 4] (the matcher's
    cost; leading dims, e.g. images, are batched)."""
    return 1 - giou_loss_reference(a_N4[..., :, None, :], b_M4[..., None, :, :], eps)


# -- one function, two implementations --------------------------------------------------
def _giou_op():
    from fastzoo.losses.kernels import giou_op  # registers the torch.ops.fastzoo ops

    return giou_op


def kernel_path(device) -> str:
    """The fused path ``impl="kernel"`` takes on ``device``: "triton" on CUDA; "nki" on XLA with
    neuronxcc (Trainium), else "xla-vectorised"; on CPU "cpu-cpp" (the C++ kernel, built on first
    call) or "cpu-vectorised" if it could not be built."""
    return _giou_op().kernel_path(torch.device(device).type)


def kernel_build_needed(device) -> bool:
    """Whether the first fused call on ``device`` compiles the C++ kernel (~40 s, once per torch
    version, compiler and Python): scripts say so before it starts."""
    return _giou_op().build_needed(torch.device(device).type)


def giou_loss(
    pred: torch.Tensor,
    target: torch.Tensor,
    *,
    reduction: str = "none",
    eps: float = 1e-7,
    impl: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """1 - GIoU between xyxy boxes ``pred`` and ``target`` (same shape [..., 4]).

    ``reduction``: "none" | "mean" | "sum". Integer boxes are upcast to fp32 (as torchvision
    does). ``impl``: "torch" (plain ops), "kernel" (the
    fused op: Triton on CUDA, C++ on CPU) or "auto" (= "kernel"; every device
    fastzoo runs on has one). Matches ``torchvision.ops.generalized_box_iou_loss``.
    """
    _check_options(reduction, impl)
    pred, target = _upcast_integer(pred, "pred"), _upcast_integer(target, "target")
    _check_pair(pred, target)
    if impl != "torch":
        op = _giou_op()
        op.kernel_path(pred.device.type)  # builds the C++ kernel before the value checks, so that they run in C++ too
    if validate:
        check_boxes(pred, "pred")
        check_boxes(target, "target")
    if impl == "torch":
        with kernel_range("loss", "giou_loss", impl):
            return _reduce(giou_loss_reference(pred, target, eps), reduction)
    with kernel_range("loss", "giou_loss", impl):  # for fastzoo.explain; a no-op otherwise
        return _reduce(op.fused_giou_loss(pred, target, eps), reduction)


# -- variable box counts: four layouts, one number --------------------------------------
def _check_sum_or_mean(reduction: str) -> None:
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction={reduction!r}: the batched modes reduce over all pairs, choose 'sum' or 'mean'")


def giou_loss_per_sample(
    preds: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], *, reduction: str = "sum", eps: float = 1e-7, validate: bool = True
) -> torch.Tensor:
    """Loop over images: ``preds[i]`` and ``targets[i]`` are matched [n_i, 4] pairs (n_i may be 0)."""
    _check_sum_or_mean(reduction)
    if len(preds) != len(targets):
        raise ValueError(f"preds has {len(preds)} images but targets has {len(targets)}")
    if not preds:
        raise ValueError("preds is empty: need at least one image")
    total = sum(giou_loss(p, t, reduction="sum", eps=eps, impl="torch", validate=validate) for p, t in zip(preds, targets))
    n = sum(t.shape[0] for t in targets)
    return total / max(n, 1) if reduction == "mean" else total


def giou_loss_concat(pred: torch.Tensor, target: torch.Tensor, *, reduction: str = "sum", eps: float = 1e-7, validate: bool = True):
    """All images' matched pairs concatenated ([N, 4] each): one call."""
    _check_sum_or_mean(reduction)
    return giou_loss(pred, target, reduction=reduction, eps=eps, impl="torch", validate=validate)


def giou_loss_padded(
    pred: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    reduction: str = "sum",
    eps: float = 1e-7,
    impl: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Pairs padded to [B, M, 4] (any [..., 4]): one call on the padded tensors, no gather.

    Which slots are real: ``mask`` [B, M] (True = a real pair), or, with ``mask=None``, the
    target says: a padded slot holds an inverted box (x2 < x1 or y2 < y1, e.g. :data:`PAD_BOX`),
    which is how :func:`fastzoo.data.boxes.collate_boxes` pads ``BoxTargets.padded`` (real boxes
    are never inverted; a NaN target is not padding, it stays visible in the loss).
    Padded slots give exactly 0 loss and 0 gradient whatever ``pred`` holds there.

    ``reduction``: "sum" | "mean" (over the real pairs; 0 if there are none, as torchvision's
    mean of nothing) | "none" ([B, M], 0 in padding). ``impl``: "kernel" (= "auto") runs the
    fused op ``torch.ops.fastzoo.giou_loss_masked`` -- the loss, the masked reduction and, in
    the backward, the gradient of every slot in one kernel per direction (C++ on CPU, Triton on
    CUDA), with no host sync, so it traces under ``torch.compile(fullgraph=True)``; "torch" is
    the same in plain ops. pred and target may differ in dtype (bf16 predictions from an
    autocast region, fp32 targets); the loss is fp32 (fp64 if either is fp64).
    """
    _check_options(reduction, impl)
    pred, target = _upcast_integer(pred, "pred"), _upcast_integer(target, "target")
    check_boxes(pred, "pred", values=False)
    check_boxes(target, "target", values=False)
    if pred.ndim < 2 or pred.shape != target.shape:
        raise ValueError(f"pred and target must both be [B, M, 4], got {tuple(pred.shape)} and {tuple(target.shape)}")
    if pred.device != target.device:
        raise ValueError(f"pred is on {pred.device} and target on {target.device}; put them on one device")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != pred.shape[:-1]
                             or mask.dtype != torch.bool or mask.device != pred.device):
        raise ValueError(f"mask must be a bool {tuple(pred.shape[:-1])} tensor on {pred.device}, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
    if impl != "torch":
        op = _giou_op()
        op.kernel_path(pred.device.type)  # builds the C++ kernel on first use
    if validate:  # the real pairs only: one gather and a host sync (skip with validate=False)
        valid = _giou_op().valid_rows(target, mask)
        check_boxes(pred[valid], "pred")
        check_boxes(target[valid], "target")
    if impl == "torch":
        with kernel_range("loss", "giou_loss_padded", impl):
            return _padded_torch(pred, target, mask, reduction, eps)
    with kernel_range("loss", "giou_loss_padded", impl):  # for fastzoo.explain; a no-op otherwise
        return op.giou_loss_masked(pred, target, mask, float(eps), op.REDUCTION_CODES[reduction])


def _padded_torch(pred, target, mask, reduction: str, eps: float) -> torch.Tensor:
    """giou_loss_padded in plain ops: padding replaced by the unit box (so no NaN reaches the
    backward), its loss dropped with ``torch.where``; "mean" divides on the device."""
    valid = _giou_op().valid_rows(target, mask)
    unit = torch.tensor([0.0, 0.0, 1.0, 1.0], device=pred.device)
    pred = torch.where(valid[..., None], pred, unit.to(pred.dtype))
    target = torch.where(valid[..., None], target, unit.to(target.dtype))
    loss = torch.where(valid, giou_loss_reference(pred, target, eps), 0.0)
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / valid.sum().clamp_min(1) if reduction == "mean" else total


def giou_loss_kernel(pred: torch.Tensor, target: torch.Tensor, *, reduction: str = "sum", eps: float = 1e-7, validate: bool = True):
    """Concatenated pairs ([N, 4] each) through the fused kernel (Triton on CUDA, C++ on CPU)."""
    _check_sum_or_mean(reduction)
    return giou_loss(pred, target, reduction=reduction, eps=eps, impl="kernel", validate=validate)


GIOU = Loss(
    name="giou",
    description="generalized IoU loss of boxes (1 - GIoU), torchvision's generalized_box_iou_loss",
    functions=("giou_loss", "giou_loss_padded"),
    impls={"torch": "plain tensor ops", "kernel": "the fused op (Triton on CUDA, NKI on XLA, C++/vectorised on CPU)",
           "auto": "the fused op"},
    kernel_ops=r"^fastzoo::giou",
    fused_op=r"^fastzoo::giou",
    fused_impls=("kernel", "auto"),
    bench="fastzoo.bench.giou",
)

