"""Triton kernels for the GIoU loss: forward and a hand-written backward (CUDA).

Called by the ``torch.ops.fastzoo.giou_loss_*`` ops (``giou_op.py``) for CUDA tensors.
Triton is imported inside :func:`_kernels`, never when fastzoo is imported. One program
handles ``BLOCK`` boxes; each box's four coordinates are loaded as four strided columns,
computed in fp32 (fp64 stays fp64), and the gradient math is the closed form documented
in ``giou_op.py``, ties split in half as autograd does.
"""
from __future__ import annotations

from functools import lru_cache

import torch

BLOCK = 256


@lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def giou_fwd_kernel(pred_ptr, target_ptr, loss_ptr, n, eps, CT: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < n
        x1 = tl.load(pred_ptr + rows * 4 + 0, mask=mask, other=0.0).to(CT)
        y1 = tl.load(pred_ptr + rows * 4 + 1, mask=mask, other=0.0).to(CT)
        x2 = tl.load(pred_ptr + rows * 4 + 2, mask=mask, other=1.0).to(CT)
        y2 = tl.load(pred_ptr + rows * 4 + 3, mask=mask, other=1.0).to(CT)
        x1g = tl.load(target_ptr + rows * 4 + 0, mask=mask, other=0.0).to(CT)
        y1g = tl.load(target_ptr + rows * 4 + 1, mask=mask, other=0.0).to(CT)
        x2g = tl.load(target_ptr + rows * 4 + 2, mask=mask, other=1.0).to(CT)
        y2g = tl.load(target_ptr + rows * 4 + 3, mask=mask, other=1.0).to(CT)
        iw = tl.minimum(x2, x2g) - tl.maximum(x1, x1g)
        ih = tl.minimum(y2, y2g) - tl.maximum(y1, y1g)
        inter = tl.where((iw > 0) & (ih > 0), iw * ih, 0.0)
        union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
        area_c = (tl.maximum(x2, x2g) - tl.minimum(x1, x1g)) * (tl.maximum(y2, y2g) - tl.minimum(y1, y1g))
        loss = 1.0 - (inter / (union + eps) - (area_c - union) / (area_c + eps))
        tl.store(loss_ptr + rows, loss, mask=mask)

    @triton.jit
    def giou_bwd_kernel(grad_ptr, pred_ptr, target_ptr, gpred_ptr, gtarget_ptr, n, eps,
                        CT: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < n
        g = tl.load(grad_ptr + rows, mask=mask, other=0.0).to(CT)
        x1 = tl.load(pred_ptr + rows * 4 + 0, mask=mask, other=0.0).to(CT)
        y1 = tl.load(pred_ptr + rows * 4 + 1, mask=mask, other=0.0).to(CT)
        x2 = tl.load(pred_ptr + rows * 4 + 2, mask=mask, other=1.0).to(CT)
        y2 = tl.load(pred_ptr + rows * 4 + 3, mask=mask, other=1.0).to(CT)
        x1g = tl.load(target_ptr + rows * 4 + 0, mask=mask, other=0.0).to(CT)
        y1g = tl.load(target_ptr + rows * 4 + 1, mask=mask, other=0.0).to(CT)
        x2g = tl.load(target_ptr + rows * 4 + 2, mask=mask, other=1.0).to(CT)
        y2g = tl.load(target_ptr + rows * 4 + 3, mask=mask, other=1.0).to(CT)
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
        g_union = g * inter / (u * u) - g / c
        g_inter = tl.where(overlap, -g / u - g_union, 0.0)
        g_area_c = g * (union + eps) / (c * c)
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
        out = gpred_ptr + rows * 4
        tl.store(out + 0, -g_iw * tx1 - g_cw * (1 - tx1) - g_union * h1, mask=mask)
        tl.store(out + 1, -g_ih * ty1 - g_ch * (1 - ty1) - g_union * w1, mask=mask)
        tl.store(out + 2, g_iw * tx2 + g_cw * (1 - tx2) + g_union * h1, mask=mask)
        tl.store(out + 3, g_ih * ty2 + g_ch * (1 - ty2) + g_union * w1, mask=mask)
        out = gtarget_ptr + rows * 4
        tl.store(out + 0, -g_iw * (1 - tx1) - g_cw * tx1 - g_union * h2, mask=mask)
        tl.store(out + 1, -g_ih * (1 - ty1) - g_ch * ty1 - g_union * w2, mask=mask)
        tl.store(out + 2, g_iw * (1 - tx2) + g_cw * tx2 + g_union * h2, mask=mask)
        tl.store(out + 3, g_ih * (1 - ty2) + g_ch * ty2 + g_union * w2, mask=mask)

    return triton, tl, giou_fwd_kernel, giou_bwd_kernel


def _ct(dtype: torch.dtype):
    _, tl, _, _ = _kernels()
    return tl.float64 if dtype == torch.float64 else tl.float32


def forward(pred: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """loss[N] (fp32, or fp64 for fp64 boxes) for contiguous pred/target [N, 4]."""
    triton, _, fwd, _ = _kernels()
    n = pred.shape[0]
    out_dtype = torch.float64 if pred.dtype == torch.float64 else torch.float32
    loss = torch.empty(n, device=pred.device, dtype=out_dtype)
    if n:
        fwd[(triton.cdiv(n, BLOCK),)](pred, target, loss, n, eps, CT=_ct(pred.dtype), BLOCK=BLOCK)
    return loss


def backward(grad: torch.Tensor, pred: torch.Tensor, target: torch.Tensor, eps: float):
    """(grad_pred, grad_target), each [N, 4] in its input's dtype."""
    triton, _, _, bwd = _kernels()
    n = pred.shape[0]
    ct = torch.float64 if pred.dtype == torch.float64 else torch.float32
    gp = torch.empty(pred.shape, device=pred.device, dtype=ct)
    gt = torch.empty(target.shape, device=target.device, dtype=ct)
    if n:
        bwd[(triton.cdiv(n, BLOCK),)](grad.contiguous(), pred, target, gp, gt, n, eps, CT=_ct(pred.dtype), BLOCK=BLOCK)
    return gp.to(pred.dtype), gt.to(target.dtype)
