"""Triton kernels for the GIoU loss (CUDA): the elementwise loss and its hand-written backward,
and the padded form with the masked sum / mean fused in.

Called by the ``torch.ops.fastzoo.giou_loss_*`` ops (``giou_op.py``) for CUDA tensors; giou_op
imports this module (and so Triton) only when a CUDA tensor arrives, never when fastzoo is
imported. One program
handles ``BLOCK`` boxes; each box's four coordinates are loaded as four strided columns.

Arithmetic matches the C++ CPU kernel (``giou_cpu.cpp``) operation for operation:

- pred and target are each read in their own dtype (bf16 predictions with fp32 targets under
  autocast) and computed in fp32, or fp64 if either is fp64;
- ``eps`` is read from a one-element tensor of that compute dtype (a Python float argument
  would reach the kernel as fp32, rounding ``eps`` differently from the CPU in fp64);
- divisions are IEEE round-to-nearest (``div_rn``; Triton's default fp32 ``/`` is approximate)
  and no multiply-adds are fused (``enable_fp_fusion=False``; the C++ is built with
  ``-ffp-contract=off``);
- the masked sum accumulates in fp64 (per block, then over blocks), as the C++ kernel does;
- offsets are int64 (:func:`block_rows`): past 2^29 boxes the element offsets pass 2^31;
- each launch runs under its tensors' device (``torch.cuda.device``), not the current GPU.

Not verified on GPU hardware here; ``tests/test_giou.py`` runs these kernels under Triton's CPU
interpreter (``TRITON_INTERPRET=1``) against torchvision.
"""
from __future__ import annotations

import contextlib

import torch

from fastzoo.errors import BackendUnavailableError
from fastzoo.losses.kernels import compute_dtype

# Triton is imported by this module alone, and this module only by giou_op's CUDA kernels (never
# by ``import fastzoo``). It stays at module level here because ``@triton.jit`` functions find
# the helpers they call (load_box, div, ...) among their module's globals, not in a closure.
try:
    import triton
    import triton.language as tl
except ImportError as e:  # a CUDA tensor reached the fused GIoU op on a machine without Triton
    raise BackendUnavailableError(
        "the fused GIoU kernel on CUDA needs Triton, which is not installed: `pip install triton`, "
        "or use giou_loss(..., impl=\"torch\")") from e

BLOCK = 256
NONE, SUM, MEAN = 0, 1, 2  # reduction codes of the masked op


@triton.jit
def block_rows(BLOCK: tl.constexpr):
    # int64: the element offset rows * 4 passes 2^31 at 2^29 boxes, where int32 wraps
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.static_assert(rows.dtype == tl.int64)
    return rows


@triton.jit
def load_box(ptr, rows, mask, CT: tl.constexpr):
    # out-of-range rows read the unit box (0, 0, 1, 1): finite, never used
    x1 = tl.load(ptr + rows * 4 + 0, mask=mask, other=0.0).to(CT)
    y1 = tl.load(ptr + rows * 4 + 1, mask=mask, other=0.0).to(CT)
    x2 = tl.load(ptr + rows * 4 + 2, mask=mask, other=1.0).to(CT)
    y2 = tl.load(ptr + rows * 4 + 3, mask=mask, other=1.0).to(CT)
    return x1, y1, x2, y2


@triton.jit
def div(a, b):
    # IEEE round-to-nearest: Triton's default fp32 "/" is approximate; fp64 "/" is IEEE already
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def giou_loss_rows(x1, y1, x2, y2, x1g, y1g, x2g, y2g, eps):
    iw = tl.minimum(x2, x2g) - tl.maximum(x1, x1g)
    ih = tl.minimum(y2, y2g) - tl.maximum(y1, y1g)
    inter = tl.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    area_c = (tl.maximum(x2, x2g) - tl.minimum(x1, x1g)) * (tl.maximum(y2, y2g) - tl.minimum(y1, y1g))
    return 1.0 - (div(inter, union + eps) - div(area_c - union, area_c + eps))


@triton.jit
def stored(x, ptr):
    # to the gradient's dtype (the input's); fp64 -> bf16 goes through fp32: the one-step
    # conversion gave NaN (seen under TRITON_INTERPRET; bf16 predictions with fp64 targets)
    if ptr.dtype.element_ty == tl.bfloat16:
        return x.to(tl.float32).to(tl.bfloat16)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def store_giou_grads(gpred_ptr, gtarget_ptr, rows, mask, g, x1, y1, x2, y2, x1g, y1g, x2g, y2g, eps,
                     STORE_PRED: tl.constexpr, STORE_TARGET: tl.constexpr):
    w1 = x2 - x1
    h1 = y2 - y1
    w2 = x2g - x1g
    h2 = y2g - y1g
    iw = tl.minimum(x2, x2g) - tl.maximum(x1, x1g)
    ih = tl.minimum(y2, y2g) - tl.maximum(y1, y1g)
    overlap = (iw > 0) & (ih > 0)
    inter = tl.where(overlap, iw * ih, 0.0)
    union = w1 * h1 + w2 * h2 - inter
    cw = tl.maximum(x2, x2g) - tl.minimum(x1, x1g)
    ch = tl.maximum(y2, y2g) - tl.minimum(y1, y1g)
    u = union + eps
    c = cw * ch + eps
    g_union = div(g * inter, u * u) - div(g, c)
    g_inter = tl.where(overlap, -div(g, u) - g_union, 0.0)
    g_area_c = div(g * (union + eps), c * c)
    g_iw = g_inter * ih
    g_ih = g_inter * iw
    g_cw = g_area_c * ch
    g_ch = g_area_c * cw
    # share of max(x1, x1g) going to x1 (autograd's rule: 1 if >, 1/2 if ==, 0 if <); same for y;
    # share of min(x2, x2g) going to x2.
    tx1 = tl.where(x1 > x1g, 1.0, tl.where(x1 == x1g, 0.5, 0.0))
    ty1 = tl.where(y1 > y1g, 1.0, tl.where(y1 == y1g, 0.5, 0.0))
    tx2 = tl.where(x2g > x2, 1.0, tl.where(x2g == x2, 0.5, 0.0))
    ty2 = tl.where(y2g > y2, 1.0, tl.where(y2g == y2, 0.5, 0.0))
    if STORE_PRED:  # stores cast to the gradient's dtype (the input's)
        out = gpred_ptr + rows * 4
        tl.store(out + 0, stored(-g_iw * tx1 - g_cw * (1 - tx1) - g_union * h1, out), mask=mask)
        tl.store(out + 1, stored(-g_ih * ty1 - g_ch * (1 - ty1) - g_union * w1, out), mask=mask)
        tl.store(out + 2, stored(g_iw * tx2 + g_cw * (1 - tx2) + g_union * h1, out), mask=mask)
        tl.store(out + 3, stored(g_ih * ty2 + g_ch * (1 - ty2) + g_union * w1, out), mask=mask)
    if STORE_TARGET:
        out = gtarget_ptr + rows * 4
        tl.store(out + 0, stored(-g_iw * (1 - tx1) - g_cw * tx1 - g_union * h2, out), mask=mask)
        tl.store(out + 1, stored(-g_ih * (1 - ty1) - g_ch * ty1 - g_union * w2, out), mask=mask)
        tl.store(out + 2, stored(g_iw * (1 - tx2) + g_cw * tx2 + g_union * h2, out), mask=mask)
        tl.store(out + 3, stored(g_ih * (1 - ty2) + g_ch * ty2 + g_union * w2, out), mask=mask)


@triton.jit
def row_valid(mask_ptr, rows, in_range, x1g, y1g, x2g, y2g, HAS_MASK: tl.constexpr):
    # padding: mask False, or (no mask) an inverted target box; NaN is not padding
    if HAS_MASK:
        return in_range & (tl.load(mask_ptr + rows, mask=in_range, other=0) != 0)
    return in_range & ~((x2g < x1g) | (y2g < y1g))


@triton.jit
def giou_fwd_kernel(pred_ptr, target_ptr, loss_ptr, eps_ptr, n, CT: tl.constexpr, BLOCK: tl.constexpr):
    rows = block_rows(BLOCK)
    mask = rows < n
    eps = tl.load(eps_ptr)
    x1, y1, x2, y2 = load_box(pred_ptr, rows, mask, CT)
    x1g, y1g, x2g, y2g = load_box(target_ptr, rows, mask, CT)
    tl.store(loss_ptr + rows, giou_loss_rows(x1, y1, x2, y2, x1g, y1g, x2g, y2g, eps), mask=mask)


@triton.jit
def giou_bwd_kernel(grad_ptr, pred_ptr, target_ptr, gpred_ptr, gtarget_ptr, eps_ptr, n,
                    CT: tl.constexpr, BLOCK: tl.constexpr):
    rows = block_rows(BLOCK)
    mask = rows < n
    eps = tl.load(eps_ptr)
    g = tl.load(grad_ptr + rows, mask=mask, other=0.0).to(CT)
    x1, y1, x2, y2 = load_box(pred_ptr, rows, mask, CT)
    x1g, y1g, x2g, y2g = load_box(target_ptr, rows, mask, CT)
    store_giou_grads(gpred_ptr, gtarget_ptr, rows, mask, g, x1, y1, x2, y2, x1g, y1g, x2g, y2g, eps, True, True)


@triton.jit
def giou_masked_fwd_kernel(pred_ptr, target_ptr, mask_ptr, out_ptr, sum_ptr, count_ptr, eps_ptr, n,
                           HAS_MASK: tl.constexpr, REDUCE: tl.constexpr, CT: tl.constexpr, BLOCK: tl.constexpr):
    rows = block_rows(BLOCK)
    in_range = rows < n
    eps = tl.load(eps_ptr)
    x1, y1, x2, y2 = load_box(pred_ptr, rows, in_range, CT)
    x1g, y1g, x2g, y2g = load_box(target_ptr, rows, in_range, CT)
    valid = row_valid(mask_ptr, rows, in_range, x1g, y1g, x2g, y2g, HAS_MASK)
    loss = tl.where(valid, giou_loss_rows(x1, y1, x2, y2, x1g, y1g, x2g, y2g, eps), 0.0)
    if REDUCE:  # one fp64 partial sum and count per block; the host side adds the blocks
        tl.store(sum_ptr + tl.program_id(0), tl.sum(loss.to(tl.float64), axis=0))
        tl.store(count_ptr + tl.program_id(0), tl.sum(valid.to(tl.int64), axis=0))
    else:
        tl.store(out_ptr + rows, loss, mask=in_range)


@triton.jit
def giou_masked_bwd_kernel(grad_ptr, pred_ptr, target_ptr, mask_ptr, gpred_ptr, gtarget_ptr, eps_ptr, n,
                           HAS_MASK: tl.constexpr, PER_ROW: tl.constexpr, STORE_PRED: tl.constexpr,
                           STORE_TARGET: tl.constexpr, CT: tl.constexpr, BLOCK: tl.constexpr):
    rows = block_rows(BLOCK)
    in_range = rows < n
    eps = tl.load(eps_ptr)
    if PER_ROW:
        g = tl.load(grad_ptr + rows, mask=in_range, other=0.0).to(CT)
    else:  # one scale for every row: the upstream gradient (sum) or it over the count (mean)
        g = tl.load(grad_ptr).to(CT) + tl.zeros([BLOCK], dtype=CT)
    x1, y1, x2, y2 = load_box(pred_ptr, rows, in_range, CT)
    x1g, y1g, x2g, y2g = load_box(target_ptr, rows, in_range, CT)
    valid = row_valid(mask_ptr, rows, in_range, x1g, y1g, x2g, y2g, HAS_MASK)
    # padding rows may hold anything: give them the unit box and a zero gradient
    x1 = tl.where(valid, x1, 0.0)
    y1 = tl.where(valid, y1, 0.0)
    x2 = tl.where(valid, x2, 1.0)
    y2 = tl.where(valid, y2, 1.0)
    x1g = tl.where(valid, x1g, 0.0)
    y1g = tl.where(valid, y1g, 0.0)
    x2g = tl.where(valid, x2g, 1.0)
    y2g = tl.where(valid, y2g, 1.0)
    g = tl.where(valid, g, 0.0)
    store_giou_grads(gpred_ptr, gtarget_ptr, rows, in_range, g, x1, y1, x2, y2, x1g, y1g, x2g, y2g, eps,
                     STORE_PRED, STORE_TARGET)


def _launch(kernel, n: int, device: torch.device, *args, **meta):
    """Launch on ``device``'s GPU (Triton launches on the current one: on a multi-GPU machine a
    tensor on cuda:1 would otherwise be read by a kernel on cuda:0)."""
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:  # enable_fp_fusion=False: no fused multiply-adds, so values round as the CPU kernel's
        kernel[(triton.cdiv(n, BLOCK),)](*args, BLOCK=BLOCK, enable_fp_fusion=False, **meta)


def _ct(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _eps(eps: float, ct: torch.dtype, device) -> torch.Tensor:
    return torch.full((1,), eps, dtype=ct, device=device)


def forward(pred: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """loss[...] in the compute dtype for contiguous pred/target [..., 4]."""
    ct = compute_dtype(pred.dtype, target.dtype)
    n = pred.numel() // 4
    loss = torch.empty(pred.shape[:-1], device=pred.device, dtype=ct)
    if n:
        _launch(giou_fwd_kernel, n, pred.device, pred, target, loss, _eps(eps, ct, pred.device), n, CT=_ct(ct))
    return loss


def backward(grad: torch.Tensor, pred: torch.Tensor, target: torch.Tensor, eps: float):
    """(grad_pred, grad_target), each shaped and typed as its input."""
    ct = compute_dtype(pred.dtype, target.dtype)
    n = pred.numel() // 4
    gp, gt = torch.empty_like(pred), torch.empty_like(target)
    if n:
        _launch(giou_bwd_kernel, n, pred.device, grad.contiguous(), pred, target, gp, gt, _eps(eps, ct, pred.device), n, CT=_ct(ct))
    return gp, gt


def masked_forward(pred, target, mask, eps: float, reduction: int) -> torch.Tensor:
    """Padded loss: [...] (reduction NONE, 0 in padding) or the masked sum / mean (a 0-d tensor)."""
    ct = compute_dtype(pred.dtype, target.dtype)
    n = pred.numel() // 4
    blocks = max(-(-n // BLOCK), 1)
    out = torch.zeros(pred.shape[:-1], device=pred.device, dtype=ct) if reduction == NONE else pred.new_empty(0, dtype=ct)
    sums = torch.zeros(blocks, device=pred.device, dtype=torch.float64)
    counts = torch.zeros(blocks, device=pred.device, dtype=torch.int64)
    if n:
        _launch(giou_masked_fwd_kernel, n, pred.device, pred, target, mask if mask is not None else target, out, sums, counts, _eps(eps, ct, pred.device),
                n, HAS_MASK=mask is not None, REDUCE=reduction != NONE, CT=_ct(ct))
    if reduction == NONE:
        return out
    total = sums.sum()
    if reduction == MEAN:  # over no pairs: 0, as torchvision's mean of an empty loss
        total = total / counts.sum().clamp_min(1)
    return total.to(ct)


def masked_backward(grad, pred, target, mask, eps: float, reduction: int, need_pred: bool = True,
                    need_target: bool = True):
    """(grad_pred, grad_target) of the padded loss, zero in padding; an unneeded one is an empty
    tensor (the kernel skips its stores)."""
    ct = compute_dtype(pred.dtype, target.dtype)
    n = pred.numel() // 4
    gp = torch.empty_like(pred) if need_pred else pred.new_empty(0)
    gt = torch.empty_like(target) if need_target else target.new_empty(0)
    if not n:
        return gp, gt
    g = grad.to(ct).contiguous()
    if reduction == MEAN:
        valid = mask if mask is not None else ~((target[..., 2] < target[..., 0]) | (target[..., 3] < target[..., 1]))
        g = (g.double() / valid.sum().clamp_min(1)).to(ct)
    _launch(giou_masked_bwd_kernel, n, pred.device, g.reshape(-1), pred, target, mask if mask is not None else target,
            gp if need_pred else pred, gt if need_target else target, _eps(eps, ct, pred.device), n,
            HAS_MASK=mask is not None, PER_ROW=reduction == NONE, STORE_PRED=need_pred, STORE_TARGET=need_target,
            CT=_ct(ct))
    return gp, gt
