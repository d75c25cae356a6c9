"""The GIoU loss forward and backward as NKI kernels for AWS Trainium / Inferentia2 (torch-xla tensors).

``giou_op`` sends the ``fastzoo::giou_loss_fwd`` / ``giou_loss_bwd`` ops here on the "xla"
device when ``neuronxcc`` is installed (``kernel_path("xla") == "nki"``). The math is
``giou_op``'s closed form (torchvision's formula, ``eps`` on both denominators; the backward with
autograd's tie rules), written once in :func:`tile_forward` / :func:`tile_backward` over an
``ops`` namespace of element-wise primitives, so that the kernels run it with ``nki.language``
ops and a CPU test runs the very same arithmetic with torch ops (:data:`TORCH_OPS`).

Layout (host side, plain PyTorch): N boxes are padded to ``128 * M`` and laid out planar as
``[4, 128, M]`` (box ``i`` at partition ``i // M``, column ``i % M``; 128 = ``nl.tile_size.pmax``,
the partitions of an SBUF tile). The kernels loop over ``M // F`` column tiles of width
``F <= 512`` (:func:`plan`), load each coordinate as a ``[128, F]`` fp32 tile, and store the loss
``[128, M]`` (or the gradients ``[4, 128, M]``). Padded slots hold the unit box (0, 0, 1, 1),
a valid box, so no NaN is computed; the host cuts them off (:func:`from_planar`).

NKI API used (Neuron SDK 2.21-2.27, the ``neuronxcc.nki`` "Beta 1" namespace that Neuron 2.28
removed): ``@nki.jit`` (framework auto-detected; on XLA tensors a torch-xla custom op),
``nl.ndarray(shape, dtype, buffer=nl.shared_hbm)``, ``nl.load(src, dtype=)``,
``nl.store(dst, value=)``, ``nl.affine_range``, ``nl.ds``, ``nl.minimum``, ``nl.maximum``,
``nl.greater`` / ``nl.equal`` (``dtype=nl.float32`` gives 1.0 / 0.0) and tile arithmetic
operators. Not run on hardware or in the simulator here (no neuronxcc on this machine).

To run the kernels in NKI's CPU simulator (needs ``neuronxcc``, no device)::

    from neuronxcc import nki
    fwd, bwd = nki_giou.kernels()
    loss_PM = nki.simulate_kernel(fwd, pred_4PM_numpy, target_4PM_numpy, 1e-7)

``tests/test_neuron.py::test_nki_giou_simulator_matches_torchvision`` does exactly that when
neuronxcc is installed.
"""
from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import torch

PMAX = 128  # nl.tile_size.pmax: partitions of an SBUF tile
FMAX = 512  # columns per tile
UNIT_BOX = (0.0, 0.0, 1.0, 1.0)  # what padded slots hold: a valid box, so no NaN reaches the loss


def available() -> bool:
    """Whether the NKI compiler is installed (imports nothing)."""
    try:
        return importlib.util.find_spec("neuronxcc") is not None
    except (ImportError, ValueError):
        return False


# -- host side: plain PyTorch, tested on CPU ------------------------------------------------------
def free_tile(m: int) -> int:
    """Tile width F for M columns: M itself up to 512, else 512 (``plan`` makes M a multiple)."""
    return min(m, FMAX)


def plan(n: int) -> tuple[int, int]:
    """(M, F) for N boxes: the planar layout is [4, 128, M] with M a multiple of the tile width F."""
    m = max(1, -(-n // PMAX))
    f = free_tile(m)
    return -(-m // f) * f, f


def to_planar(boxes_N4: torch.Tensor, m: int) -> torch.Tensor:
    """[N, 4] boxes -> fp32 [4, 128, M], padded with :data:`UNIT_BOX`."""
    n = boxes_N4.shape[0]
    padded_Q4 = boxes_N4.new_tensor(UNIT_BOX, dtype=torch.float32).repeat(PMAX * m, 1)
    padded_Q4[:n] = boxes_N4.float()
    return padded_Q4.T.reshape(4, PMAX, m).contiguous()


def from_planar(x_PM: torch.Tensor, n: int) -> torch.Tensor:
    """[128, M] per-box values -> [N] (the padded slots dropped)."""
    return x_PM.reshape(-1)[:n]


def from_planar_boxes(x_4PM: torch.Tensor, n: int) -> torch.Tensor:
    """[4, 128, M] per-coordinate values -> [N, 4]."""
    return x_4PM.reshape(4, -1)[:, :n].T


# -- the arithmetic of one tile, written once ---------------------------------------------------
TORCH_OPS = SimpleNamespace(  # the primitives in torch: CPU tests run tile_forward/backward with these
    minimum=torch.minimum,
    maximum=torch.maximum,
    greater=lambda a, b: (a > b).float(),
    equal=lambda a, b: (a == b).float(),
)


def _tie(ops, a, b):
    """d max(a, b) / da under autograd's rule: 1 if a > b, 1/2 if a == b, 0 if a < b.
    ``_tie(b, a)`` is the complement, so no ``1 - tile`` is needed."""
    return ops.greater(a, b) + ops.equal(a, b) * 0.5


def tile_forward(ops, p, g, eps: float):
    """1 - GIoU for tiles ``p = (x1, y1, x2, y2)`` and ``g`` (the target), same op order as giou_op."""
    x1, y1, x2, y2 = p
    x1g, y1g, x2g, y2g = g
    iw = ops.minimum(x2, x2g) - ops.maximum(x1, x1g)
    ih = ops.minimum(y2, y2g) - ops.maximum(y1, y1g)
    inter = iw * ih * (ops.greater(iw, 0.0) * ops.greater(ih, 0.0))  # 0 unless positive width AND height
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    area_c = (ops.maximum(x2, x2g) - ops.minimum(x1, x1g)) * (ops.maximum(y2, y2g) - ops.minimum(y1, y1g))
    return (area_c - union) / (area_c + eps) - inter / (union + eps) + 1.0


def tile_backward(ops, grad, p, g, eps: float):
    """(d/dp, d/dg) as two 4-tuples of tiles: giou_op's ``_backward_vectorised``, written with
    complementary tie weights and ``* -1.0`` instead of ``1 - t`` and unary minus (exact rewrites)."""
    x1, y1, x2, y2 = p
    x1g, y1g, x2g, y2g = g
    w1, h1, w2, h2 = x2 - x1, y2 - y1, x2g - x1g, y2g - y1g
    iw = ops.minimum(x2, x2g) - ops.maximum(x1, x1g)
    ih = ops.minimum(y2, y2g) - ops.maximum(y1, y1g)
    overlap = ops.greater(iw, 0.0) * ops.greater(ih, 0.0)
    inter = iw * ih * overlap
    union = w1 * h1 + w2 * h2 - inter
    cw = ops.maximum(x2, x2g) - ops.minimum(x1, x1g)
    ch = ops.maximum(y2, y2g) - ops.minimum(y1, y1g)
    u, c = union + eps, cw * ch + eps
    g_union = grad * inter / (u * u) - grad / c
    g_inter = (grad / u + g_union) * (overlap * -1.0)
    g_area_c = grad * u / (c * c)
    g_iw, g_ih = g_inter * ih, g_inter * iw
    g_cw, g_ch = g_area_c * ch, g_area_c * cw
    # Shares of max(x1, x1g) (intersection left edge) and, complemented, of min(x1, x1g) (enclosing).
    ax, axg, ay, ayg = _tie(ops, x1, x1g), _tie(ops, x1g, x1), _tie(ops, y1, y1g), _tie(ops, y1g, y1)
    # Shares of min(x2, x2g) (intersection right edge) and, complemented, of max(x2, x2g).
    bx, bxg, by, byg = _tie(ops, x2g, x2), _tie(ops, x2, x2g), _tie(ops, y2g, y2), _tie(ops, y2, y2g)
    gp = (
        (g_iw * ax + g_cw * axg + g_union * h1) * -1.0,
        (g_ih * ay + g_ch * ayg + g_union * w1) * -1.0,
        g_iw * bx + g_cw * bxg + g_union * h1,
        g_ih * by + g_ch * byg + g_union * w1,
    )
    gt = (
        (g_iw * axg + g_cw * ax + g_union * h2) * -1.0,
        (g_ih * ayg + g_ch * ay + g_union * w2) * -1.0,
        g_iw * bxg + g_cw * bx + g_union * h2,
        g_ih * byg + g_ch * by + g_union * w2,
    )
    return gp, gt


# -- the NKI kernels ----------------------------------------------------------------------------
@functools.cache
def kernels():
    """(giou_fwd, giou_bwd) ``@nki.jit`` kernels on the planar layout; imports neuronxcc."""
    import neuronxcc.nki.language as nl
    from neuronxcc import nki

    ops = SimpleNamespace(
        minimum=nl.minimum,
        maximum=nl.maximum,
        greater=lambda a, b: nl.greater(a, b, dtype=nl.float32),
        equal=lambda a, b: nl.equal(a, b, dtype=nl.float32),
    )

    def load4(x_4PM, cols):
        return tuple(nl.load(x_4PM[i, :, cols], dtype=nl.float32) for i in range(4))

    @nki.jit
    def giou_fwd(pred_4PM, target_4PM, eps):
        _, p, m = pred_4PM.shape
        f = free_tile(m)
        loss_PM = nl.ndarray((p, m), dtype=nl.float32, buffer=nl.shared_hbm)
        for t in nl.affine_range(m // f):
            cols = nl.ds(t * f, f)
            loss = tile_forward(ops, load4(pred_4PM, cols), load4(target_4PM, cols), eps)
            nl.store(loss_PM[:, cols], value=loss)
        return loss_PM

    @nki.jit
    def giou_bwd(grad_PM, pred_4PM, target_4PM, eps):
        _, p, m = pred_4PM.shape
        f = free_tile(m)
        grad_pred_4PM = nl.ndarray((4, p, m), dtype=nl.float32, buffer=nl.shared_hbm)
        grad_target_4PM = nl.ndarray((4, p, m), dtype=nl.float32, buffer=nl.shared_hbm)
        for t in nl.affine_range(m // f):
            cols = nl.ds(t * f, f)
            grad = nl.load(grad_PM[:, cols], dtype=nl.float32)
            gp, gt = tile_backward(ops, grad, load4(pred_4PM, cols), load4(target_4PM, cols), eps)
            for i in range(4):
                nl.store(grad_pred_4PM[i, :, cols], value=gp[i])
                nl.store(grad_target_4PM[i, :, cols], value=gt[i])
        return grad_pred_4PM, grad_target_4PM

    return giou_fwd, giou_bwd


def forward(pred_N4: torch.Tensor, target_N4: torch.Tensor, eps: float) -> torch.Tensor:
    """Loss [N] (fp32; fp64 boxes are computed in fp32 too: Trainium has no fp64 arithmetic)."""
    n = pred_N4.shape[0]
    m, _ = plan(n)
    loss_PM = kernels()[0](to_planar(pred_N4, m), to_planar(target_N4, m), eps)
    return from_planar(loss_PM, n).to(torch.float64 if pred_N4.dtype == torch.float64 else torch.float32)


def backward(grad_N: torch.Tensor, pred_N4: torch.Tensor, target_N4: torch.Tensor, eps: float):
    """(grad_pred [N, 4], grad_target [N, 4]) in the boxes' dtypes; padded slots get zero upstream gradient."""
    n = pred_N4.shape[0]
    m, _ = plan(n)
    grad_PM = torch.zeros(PMAX * m, dtype=torch.float32, device=grad_N.device)
    grad_PM[:n] = grad_N.float()
    gp_4PM, gt_4PM = kernels()[1](grad_PM.reshape(PMAX, m), to_planar(pred_N4, m), to_planar(target_N4, m), eps)
    return from_planar_boxes(gp_4PM, n).to(pred_N4.dtype), from_planar_boxes(gt_4PM, n).to(target_N4.dtype)
