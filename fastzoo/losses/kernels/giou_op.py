"""The fused GIoU loss as ``torch.library`` ops, with a hand-written backward.

``torch.ops.fastzoo.giou_loss_fwd(pred[N,4], target[N,4], eps) -> loss[N]`` and
``torch.ops.fastzoo.giou_loss_bwd(grad[N], pred, target, eps) -> (grad_pred, grad_target)``;
for padded pairs ``torch.ops.fastzoo.giou_loss_masked(pred[...,4], target[...,4], mask[...] | None,
eps, reduction) -> loss`` (reduction 0 none / 1 sum / 2 mean over the real pairs; ``mask=None``
reads validity from the target: an inverted box is padding) and its ``giou_loss_masked_bwd``.
The padded op is the whole loss in one kernel launch per direction: no gather of the real
pairs, no separate reduction, no host sync. pred and target may differ in dtype (bf16
predictions, fp32 targets); the loss is fp32 (fp64 if either is fp64).
Kernels, by device (``kernel_path`` says which one runs):

- ``"cpu-cpp"``: one C++ loop for the forward and one for the backward (``giou_cpu.cpp``),
  built on first use with ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja;
  cached in the torch extensions directory per torch version, compiler and Python: ``fastzoo.cpp_build``),
  on the calling thread, 16 boxes per vector
  block. Its autograd rule is registered in C++ too, so an eager call never goes back to Python.
- ``"cpu-vectorised"``: the same closed form in vectorised torch ops (below), used only if
  the C++ build fails -- with a warning that says why -- or when
  ``FASTZOO_GIOU_CPU=vectorised`` forces it.
- ``"triton"``: on CUDA, ``triton_giou.py``, imported only when a CUDA tensor arrives.
- ``"nki"``: on the "xla" device with ``neuronxcc`` installed (AWS Trainium / Inferentia2),
  ``nki_giou.py``; without it (e.g. torch-xla on TPU) ``"xla-vectorised"``, the closed form below
  compiled by XLA. Written against the NKI docs, not run on hardware.

``register_fake`` gives shapes to ``torch.compile`` and ``register_autograd`` wires the
backward op, so ``fullgraph=True`` traces through every path.

The backward is the derivative of torchvision's formula (see ``fastzoo/losses/giou.py``),
including autograd's rules at ties: ``max``/``min`` of two equal values send half of the
gradient to each (identical boxes, shared edges), and the intersection has zero gradient
unless it has positive width and height (touching boxes). With u = union + eps and
c = C + eps, for an upstream gradient g::

    dL/dunion = g * inter / u^2 - g / c        dL/dinter = -g / u - dL/dunion
    dL/dC     = g * (union + eps) / c^2        dL/darea_a = dL/darea_b = dL/dunion
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch import Tensor

from fastzoo.cpp_build import build, failure_text, is_built
from fastzoo.losses.kernels import compute_dtype  # shared with triton_giou, which this module imports

FORCE_ENV = "FASTZOO_GIOU_CPU"  # "vectorised": skip the C++ build (tests of the fallback)
CPP_NAME, CPP_SOURCE = "fastzoo_giou_cpu", Path(__file__).with_name("giou_cpu.cpp")
_cpu_path: str | None = None  # "cpu-cpp" | "cpu-vectorised", decided on first use


@torch.compiler.assume_constant_result  # under torch.compile: decided (and built) once, at trace time
def kernel_path(device_type: str) -> str:
    """"triton" on CUDA; "nki" on XLA where neuronxcc is installed, else "xla-vectorised"; on CPU
    "cpu-cpp" once the C++ kernel is built and loaded (first call builds it), else "cpu-vectorised"."""
    global _cpu_path
    if device_type == "cuda":
        return "triton"
    if device_type == "xla":
        from fastzoo.losses.kernels import nki_giou  # imports no Neuron package

        return "nki" if nki_giou.available() else "xla-vectorised"
    if _cpu_path is None:
        _cpu_path = _load_cpp_kernel()
    return _cpu_path


def cpp_loaded() -> bool:
    """Whether the C++ CPU kernels (and ``torch.ops.fastzoo.first_bad_box``) are loaded; builds nothing."""
    return _cpu_path == "cpu-cpp"


def build_needed(device_type: str) -> bool:
    """Whether the first fused GIoU call on ``device_type`` compiles the C++ kernel (~40 s): on CPU,
    not loaded yet and not in the build cache for this torch, compiler and Python."""
    return device_type == "cpu" and _cpu_path is None and not os.environ.get(FORCE_ENV) and not is_built(CPP_NAME, CPP_SOURCE)


def _load_cpp_kernel() -> str:
    forced = os.environ.get(FORCE_ENV)
    if forced == "vectorised":
        warnings.warn(f"fastzoo GIoU on CPU: {FORCE_ENV}=vectorised, using the vectorised closed form, not the C++ kernel",
                      stacklevel=3)
        return "cpu-vectorised"
    if forced:
        raise ValueError(f"{FORCE_ENV}={forced!r}: the only value is 'vectorised' (unset it for the C++ kernel)")
    try:
        # -ffp-contract=off: no fused multiply-adds, so values round as torchvision's ops do.
        # -fno-trapping-math: a division under a select may be computed in every lane (the block
        # loops vectorise); no value changes, only which lanes raise FP flags nobody reads.
        build(CPP_NAME, CPP_SOURCE,
              extra_cflags=("-O3", "-ffp-contract=off", "-fno-trapping-math"))
    except Exception as e:  # no compiler, no ninja, a failed build: say so, once
        warnings.warn(f"fastzoo GIoU on CPU: building the C++ kernel failed ({failure_text(e)}); "
                      "using the vectorised closed form, about 10x slower at 1000 boxes. Install a C++ compiler and "
                      "ninja (pip install ninja) to get the fused kernel.", stacklevel=3)
        return "cpu-vectorised"
    return "cpu-cpp"


def _tie_weight(a: Tensor, b: Tensor) -> Tensor:
    """d max(a, b) / da under autograd's rule: 1 if a > b, 1/2 if a == b, 0 if a < b."""
    return (a > b).to(a.dtype) + 0.5 * (a == b).to(a.dtype)


def _forward_vectorised(pred: Tensor, target: Tensor, eps: float) -> Tensor:
    ct = compute_dtype(pred.dtype, target.dtype)
    x1, y1, x2, y2 = pred.to(ct).unbind(-1)
    x1g, y1g, x2g, y2g = target.to(ct).unbind(-1)
    iw = torch.minimum(x2, x2g) - torch.maximum(x1, x1g)
    ih = torch.minimum(y2, y2g) - torch.maximum(y1, y1g)
    inter = torch.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    area_c = (torch.maximum(x2, x2g) - torch.minimum(x1, x1g)) * (torch.maximum(y2, y2g) - torch.minimum(y1, y1g))
    return 1 - (inter / (union + eps) - (area_c - union) / (area_c + eps))


def _backward_vectorised(grad: Tensor, pred: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    ct = compute_dtype(pred.dtype, target.dtype)
    g = grad.to(ct)
    x1, y1, x2, y2 = pred.to(ct).unbind(-1)
    x1g, y1g, x2g, y2g = target.to(ct).unbind(-1)
    w1, h1, w2, h2 = x2 - x1, y2 - y1, x2g - x1g, y2g - y1g
    iw = torch.minimum(x2, x2g) - torch.maximum(x1, x1g)
    ih = torch.minimum(y2, y2g) - torch.maximum(y1, y1g)
    overlap = (iw > 0) & (ih > 0)
    inter = torch.where(overlap, iw * ih, 0.0)
    union = w1 * h1 + w2 * h2 - inter
    cw = torch.maximum(x2, x2g) - torch.minimum(x1, x1g)
    ch = torch.maximum(y2, y2g) - torch.minimum(y1, y1g)
    u, c = union + eps, cw * ch + eps
    g_union = g * inter / (u * u) - g / c
    g_inter = torch.where(overlap, -g / u - g_union, 0.0)
    g_area_c = g * (union + eps) / (c * c)
    g_iw, g_ih = g_inter * ih, g_inter * iw
    g_cw, g_ch = g_area_c * ch, g_area_c * cw
    # intersection: ix1 = max(x1, x1g) (d/dix1 = -g_iw), ix2 = min(x2, x2g) (+g_iw);
    # enclosing box: cx1 = min(x1, x1g) (-g_cw), cx2 = max(x2, x2g) (+g_cw); same in y.
    tx1, ty1 = _tie_weight(x1, x1g), _tie_weight(y1, y1g)  # share of max(x1, x1g) going to x1
    tx2, ty2 = _tie_weight(x2g, x2), _tie_weight(y2g, y2)  # share of min(x2, x2g) going to x2
    gp = torch.stack([
        -g_iw * tx1 - g_cw * (1 - tx1) - g_union * h1,
        -g_ih * ty1 - g_ch * (1 - ty1) - g_union * w1,
        g_iw * tx2 + g_cw * (1 - tx2) + g_union * h1,
        g_ih * ty2 + g_ch * (1 - ty2) + g_union * w1,
    ], -1)
    gt = torch.stack([
        -g_iw * (1 - tx1) - g_cw * tx1 - g_union * h2,
        -g_ih * (1 - ty1) - g_ch * ty1 - g_union * w2,
        g_iw * (1 - tx2) + g_cw * tx2 + g_union * h2,
        g_ih * (1 - ty2) + g_ch * ty2 + g_union * w2,
    ], -1)
    return gp.to(pred.dtype), gt.to(target.dtype)


# The Python bodies below are the "cpu-vectorised" kernels: a CPU kernel registered by the
# C++ library (once loaded) takes precedence over them.
@torch.library.custom_op("fastzoo::giou_loss_fwd", mutates_args=())
def giou_loss_fwd(pred: Tensor, target: Tensor, eps: float) -> Tensor:
    return _forward_vectorised(pred, target, eps)


@giou_loss_fwd.register_kernel("cuda")
def _giou_loss_fwd_cuda(pred: Tensor, target: Tensor, eps: float) -> Tensor:
    from fastzoo.losses.kernels import triton_giou

    return triton_giou.forward(pred.contiguous(), target.contiguous(), eps)


@giou_loss_fwd.register_kernel("xla")
def _giou_loss_fwd_xla(pred: Tensor, target: Tensor, eps: float) -> Tensor:
    if kernel_path("xla") != "nki":
        return _forward_vectorised(pred, target, eps)
    from fastzoo.losses.kernels import nki_giou

    return nki_giou.forward(pred, target, eps)


@giou_loss_fwd.register_fake
def _(pred, target, eps):
    return pred.new_empty(pred.shape[:-1], dtype=compute_dtype(pred.dtype, target.dtype))


@torch.library.custom_op("fastzoo::giou_loss_bwd", mutates_args=())
def giou_loss_bwd(grad: Tensor, pred: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return _backward_vectorised(grad, pred, target, eps)


@giou_loss_bwd.register_kernel("cuda")
def _giou_loss_bwd_cuda(grad: Tensor, pred: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    from fastzoo.losses.kernels import triton_giou

    return triton_giou.backward(grad, pred.contiguous(), target.contiguous(), eps)


@giou_loss_bwd.register_kernel("xla")
def _giou_loss_bwd_xla(grad: Tensor, pred: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if kernel_path("xla") != "nki":
        return _backward_vectorised(grad, pred, target, eps)
    from fastzoo.losses.kernels import nki_giou

    return nki_giou.backward(grad, pred, target, eps)


@giou_loss_bwd.register_fake
def _(grad, pred, target, eps):
    return torch.empty_like(pred), torch.empty_like(target)


def _setup_context(ctx, inputs, output):
    pred, target, eps = inputs
    ctx.save_for_backward(pred, target)
    ctx.eps = eps


def _backward(ctx, grad):
    pred, target = ctx.saved_tensors
    grad_pred, grad_target = giou_loss_bwd(grad.contiguous(), pred, target, ctx.eps)
    return (
        grad_pred if ctx.needs_input_grad[0] else None,
        grad_target if ctx.needs_input_grad[1] else None,
        None,
    )


giou_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


# -- padded pairs, the masked reduction fused in ------------------------------------------
REDUCTION_CODES = {"none": 0, "sum": 1, "mean": 2}


def padding_rows(target: Tensor) -> Tensor:
    """[...] bool: rows of a padded target [..., 4] that are padding, marked by an inverted box
    (x2 < x1 or y2 < y1; ``fastzoo.losses.giou.PAD_BOX``). NaN is not padding: it stays visible."""
    return (target[..., 2] < target[..., 0]) | (target[..., 3] < target[..., 1])


@torch.library.custom_op("fastzoo::giou_valid_rows", mutates_args=())
def giou_valid_rows(target: Tensor) -> Tensor:
    """[...] bool: the rows of a padded target [..., 4] that are real pairs (``~padding_rows``). The
    C++ kernel's autograd reads the boxes once through this op and hands the mask to both
    directions, which then read one byte per slot instead of a box."""
    return ~padding_rows(target)


@giou_valid_rows.register_fake
def _(target):
    return target.new_empty(target.shape[:-1], dtype=torch.bool)


def valid_rows(target: Tensor, mask: Tensor | None) -> Tensor:
    """The real pairs of a padded batch: ``mask`` when given, else read from the target's padding."""
    return mask if mask is not None else ~padding_rows(target)


def _masked_vectorised(pred: Tensor, target: Tensor, mask: Tensor | None, eps: float, reduction: int) -> Tensor:
    valid = valid_rows(target, mask)
    loss = torch.where(valid, _forward_vectorised(pred, target, eps), 0.0)  # padding's NaN never selected
    if reduction == 0:
        return loss
    total = loss.sum(dtype=torch.float64)  # fp64 accumulation, as the C++ and Triton kernels
    if reduction == 2:
        total = total / valid.sum().clamp_min(1)  # over no pairs: 0 (torchvision's empty mean)
    return total.to(loss.dtype)


def _masked_backward_vectorised(grad, pred, target, mask, eps: float, reduction: int, need_pred: bool,
                                need_target: bool) -> tuple[Tensor, Tensor]:
    valid = valid_rows(target, mask)
    ct = compute_dtype(pred.dtype, target.dtype)
    g = grad.to(ct)
    if reduction == 2:
        g = (g.double() / valid.sum().clamp_min(1)).to(ct)
    g = torch.where(valid, g.expand(valid.shape), 0.0)
    unit = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=ct, device=pred.device)  # padding may hold NaN: no NaN * 0
    gp, gt = _backward_vectorised(g, torch.where(valid[..., None], pred.to(ct), unit),
                                  torch.where(valid[..., None], target.to(ct), unit), eps)
    return (gp.to(pred.dtype) if need_pred else pred.new_empty(0),
            gt.to(target.dtype) if need_target else target.new_empty(0))


@torch.library.custom_op("fastzoo::giou_loss_masked", mutates_args=())
def giou_loss_masked(pred: Tensor, target: Tensor, mask: Tensor | None, eps: float, reduction: int) -> Tensor:
    return _masked_vectorised(pred, target, mask, eps, reduction)


@giou_loss_masked.register_kernel("cuda")
def _giou_loss_masked_cuda(pred, target, mask, eps, reduction):
    from fastzoo.losses.kernels import triton_giou

    m = mask.contiguous() if mask is not None else None
    return triton_giou.masked_forward(pred.contiguous(), target.contiguous(), m, eps, reduction)


@giou_loss_masked.register_fake
def _(pred, target, mask, eps, reduction):
    return pred.new_empty(pred.shape[:-1] if reduction == 0 else (), dtype=compute_dtype(pred.dtype, target.dtype))


@torch.library.custom_op("fastzoo::giou_loss_masked_bwd", mutates_args=())
def giou_loss_masked_bwd(grad: Tensor, pred: Tensor, target: Tensor, mask: Tensor | None, eps: float,
                         reduction: int, need_pred: bool, need_target: bool) -> tuple[Tensor, Tensor]:
    """(grad_pred, grad_target); one not needed is an empty tensor (the target usually needs none)."""
    return _masked_backward_vectorised(grad, pred, target, mask, eps, reduction, need_pred, need_target)


@giou_loss_masked_bwd.register_kernel("cuda")
def _giou_loss_masked_bwd_cuda(grad, pred, target, mask, eps, reduction, need_pred, need_target):
    from fastzoo.losses.kernels import triton_giou

    m = mask.contiguous() if mask is not None else None
    return triton_giou.masked_backward(grad, pred.contiguous(), target.contiguous(), m, eps, reduction, need_pred,
                                       need_target)


@giou_loss_masked_bwd.register_fake
def _(grad, pred, target, mask, eps, reduction, need_pred, need_target):
    return (torch.empty_like(pred) if need_pred else pred.new_empty(0),
            torch.empty_like(target) if need_target else target.new_empty(0))


def _setup_masked(ctx, inputs, output):
    pred, target, mask, eps, reduction = inputs
    ctx.save_for_backward(pred, target, mask)
    ctx.eps, ctx.reduction = eps, reduction


def _backward_masked(ctx, grad):
    pred, target, mask = ctx.saved_tensors
    need_pred, need_target = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_pred, grad_target = giou_loss_masked_bwd(grad.contiguous(), pred, target, mask, ctx.eps, ctx.reduction,
                                                  need_pred, need_target)
    return grad_pred if need_pred else None, grad_target if need_target else None, None, None, None


giou_loss_masked.register_autograd(_backward_masked, setup_context=_setup_masked)


def fused_giou_loss(pred: Tensor, target: Tensor, eps: float = 1e-7) -> Tensor:
    """Elementwise loss for boxes [..., 4] through the op (rows flattened to [N, 4]).
    [N, 4] input goes in as it is: a reshape would add two view nodes to the autograd
    graph, a third of the whole forward+backward time at 1000 boxes on CPU."""
    if pred.dim() == 2:
        return giou_loss_fwd(pred, target, float(eps))
    loss_N = giou_loss_fwd(pred.reshape(-1, 4), target.reshape(-1, 4), float(eps))
    return loss_N.reshape(pred.shape[:-1])
