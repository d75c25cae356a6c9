"""Triton kernels for multi-scale deformable attention (CUDA): forward and hand-written backward.

Called by the ``torch.ops.fastzoo.msda_triton_*`` ops (``deformable_op.py``), which import this
module (and so Triton) only when the ``triton`` kernel is asked for. One program handles one
(batch, query, head): its ``K`` sampling points (every level's) are one vector, each of the four bilinear
neighbours a [points, D] gather of value rows, summed with the points' weights in fp32.
Sampling is ``deformable_cpu.cpp``'s: grid_sample's coordinates (bilinear, align_corners=False,
zeros outside). The backward recomputes the neighbours, writes the gradients of the locations and
weights per point and adds the value gradient with fp32 atomics (its order, and so its last bits,
may vary from run to run, as in the CUDA kernel Deformable DETR ships).

Each launch runs inside a profiler range named as the op (``fastzoo::msda_triton_forward`` /
``_backward``): the op's Python body is not recorded by the profiler itself, and ``fastzoo.explain``
looks for these names. Inputs fp32 / bf16 / fp16 (computed in fp32), outputs in the input dtype. Not verified on GPU
hardware here; ``tests/test_deformable_attention.py`` runs these kernels under Triton's CPU
interpreter (``TRITON_INTERPRET=1``) against the reference, and ``benchmarks/gpu_suite.sh`` runs
them on a GPU.
"""
from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

from fastzoo.errors import BackendUnavailableError

# Imported by this module alone, and this module only by deformable_op's Triton ops; at module
# level because ``@triton.jit`` functions find the helpers they call among their module's globals.
try:
    import triton
    import triton.language as tl
except ImportError as e:  # impl="triton" on a machine without Triton
    raise BackendUnavailableError(
        "multi-scale deformable attention with impl=\"triton\" needs Triton, which is not installed: "
        "`pip install triton`, or use impl=\"reference\"") from e


@triton.jit
def _program(H, Q):
    """This program's (batch, query, head) as one index, ``(b * Q + q) * H + h``, its head and its batch."""
    pid = tl.program_id(0).to(tl.int64)
    return pid, pid % H, pid // H // Q


@triton.jit
def _points(shapes, starts, level_of, loc, w, pid, LP, BLOCK_LP: tl.constexpr):
    """This program's points: mask, level height / width / first token, pixel coordinates and their floors,
    weight."""
    k = tl.arange(0, BLOCK_LP)
    km = k < LP
    lvl = tl.load(level_of + k, mask=km, other=0)
    hl = tl.load(shapes + 2 * lvl, mask=km, other=1)
    wl = tl.load(shapes + 2 * lvl + 1, mask=km, other=1)
    st = tl.load(starts + lvl, mask=km, other=0)
    i = pid * LP + k
    x = tl.load(loc + 2 * i, mask=km, other=0.0).to(tl.float32)
    y = tl.load(loc + 2 * i + 1, mask=km, other=0.0).to(tl.float32)
    a = tl.load(w + i, mask=km, other=0.0).to(tl.float32)
    ix = ((2.0 * x - 1.0 + 1.0) * wl.to(tl.float32) - 1.0) * 0.5  # grid_sample's unnormalisation
    iy = ((2.0 * y - 1.0 + 1.0) * hl.to(tl.float32) - 1.0) * 0.5
    return k, km, i, hl, wl, st, ix, iy, tl.floor(ix), tl.floor(iy), a


@triton.jit
def _neighbour(corner: tl.constexpr, ix, iy, fx, fy):
    """Neighbour ``corner`` (x then y: 0 .. 3) of every point: its pixel and its bilinear weights,
    (1 - |ix - cx|) and (1 - |iy - cy|) as grid_sample's four products."""
    dx: tl.constexpr = corner % 2
    dy: tl.constexpr = corner // 2
    wx = (ix - fx) if dx == 1 else (fx + 1.0 - ix)
    wy = (iy - fy) if dy == 1 else (fy + 1.0 - iy)
    return fx + dx, fy + dy, wx, wy


@triton.jit
def _corner(b, h, S, H, D, km, hl, wl, st, cx, cy, d, dm):
    """One neighbour of every point: the [points, D] offsets of its value rows and their load mask
    (the neighbour inside its level)."""
    inside = km & (cx >= 0.0) & (cx < wl.to(tl.float32)) & (cy >= 0.0) & (cy < hl.to(tl.float32))
    xi = tl.where(inside, cx, 0.0).to(tl.int64)
    yi = tl.where(inside, cy, 0.0).to(tl.int64)
    tok = b * S + st + yi * wl + xi
    return (tok * H + h)[:, None] * D + d[None, :], inside[:, None] & dm[None, :]


@triton.jit
def _forward_kernel(value, shapes, starts, level_of, loc, w, out, S, H, D, Q, LP,
                    BLOCK_LP: tl.constexpr, BLOCK_D: tl.constexpr):
    pid, h, b = _program(H, Q)
    k, km, i, hl, wl, st, ix, iy, fx, fy, a = _points(shapes, starts, level_of, loc, w, pid, LP, BLOCK_LP)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for corner in tl.static_range(4):
        cx, cy, wx, wy = _neighbour(corner, ix, iy, fx, fy)
        off, m = _corner(b, h, S, H, D, km, hl, wl, st, cx, cy, d, dm)
        v = tl.load(value + off, mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(v * (a * wx * wy)[:, None], axis=0)
    tl.store(out + pid * D + d, acc.to(out.dtype.element_ty), mask=dm)


@triton.jit
def _backward_kernel(grad, value, shapes, starts, level_of, loc, w, grad_value, grad_loc, grad_w, S, H, D, Q, LP,
                     BLOCK_LP: tl.constexpr, BLOCK_D: tl.constexpr):
    pid, h, b = _program(H, Q)
    k, km, i, hl, wl, st, ix, iy, fx, fy, a = _points(shapes, starts, level_of, loc, w, pid, LP, BLOCK_LP)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    g = tl.load(grad + pid * D + d, mask=dm, other=0.0).to(tl.float32)
    sampled = tl.zeros([BLOCK_LP], dtype=tl.float32)
    gix = tl.zeros([BLOCK_LP], dtype=tl.float32)
    giy = tl.zeros([BLOCK_LP], dtype=tl.float32)
    for corner in tl.static_range(4):
        cx, cy, wx, wy = _neighbour(corner, ix, iy, fx, fy)
        sx = 1.0 if corner % 2 == 1 else -1.0  # d wx / d ix
        sy = 1.0 if corner // 2 == 1 else -1.0
        off, m = _corner(b, h, S, H, D, km, hl, wl, st, cx, cy, d, dm)
        v = tl.load(value + off, mask=m, other=0.0).to(tl.float32)
        gv = tl.sum(v * g[None, :], axis=1)  # g . value row, per point
        sampled += wx * wy * gv
        gix += sx * wy * gv
        giy += sy * wx * gv
        tl.atomic_add(grad_value + off, (a * wx * wy)[:, None] * g[None, :], mask=m)
    tl.store(grad_w + i, sampled.to(grad_w.dtype.element_ty), mask=km)
    # d ix / d loc_x = W: ix = ((2 x - 1 + 1) W - 1) / 2
    tl.store(grad_loc + 2 * i, (a * gix * wl.to(tl.float32)).to(grad_loc.dtype.element_ty), mask=km)
    tl.store(grad_loc + 2 * i + 1, (a * giy * hl.to(tl.float32)).to(grad_loc.dtype.element_ty), mask=km)


def _prepare(value, spatial_shapes, level_start_index, points_per_level, sampling_locations, attention_weights):
    """Contiguous inputs, the level of each of the K points, and the sizes the kernels take."""
    value, loc, w = value.contiguous(), sampling_locations.contiguous(), attention_weights.contiguous()
    shapes, starts = spatial_shapes.to(torch.int64).contiguous(), level_start_index.to(torch.int64).contiguous()
    levels = torch.arange(points_per_level.numel(), device=value.device)
    level_of = torch.repeat_interleave(levels, points_per_level.to(device=value.device, dtype=torch.int64))
    B, S, H, D = value.shape
    Q, K = loc.shape[1], loc.shape[3]
    blocks = dict(BLOCK_LP=triton.next_power_of_2(K), BLOCK_D=triton.next_power_of_2(D))
    return value, shapes, starts, level_of, loc, w, (B, S, H, D, Q, K), blocks


def _on(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def forward(*args):
    value, shapes, starts, level_of, loc, w, (B, S, H, D, Q, K), blocks = _prepare(*args)
    out = value.new_empty((B, Q, H * D))
    if out.numel():
        with _on(value), record_function("fastzoo::msda_triton_forward"):
            _forward_kernel[(B * Q * H,)](value, shapes, starts, level_of, loc, w, out, S, H, D, Q, K, **blocks)
    return out


def backward(grad, *args):
    value, shapes, starts, level_of, loc, w, (B, S, H, D, Q, K), blocks = _prepare(*args)
    grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
    grad_loc, grad_w = torch.empty_like(loc), torch.empty_like(w)
    if grad_w.numel():
        with _on(value), record_function("fastzoo::msda_triton_backward"):
            _backward_kernel[(B * Q * H,)](grad.contiguous(), value, shapes, starts, level_of, loc, w, grad_value,
                                           grad_loc, grad_w, S, H, D, Q, K, **blocks)
    return grad_value.to(value.dtype), grad_loc, grad_w
