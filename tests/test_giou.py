"""GIoU loss: equal to torchvision.ops.generalized_box_iou_loss (values and gradients) on
random and degenerate boxes, through the reference, the fused C++ CPU kernel, its vectorised
fallback and the Triton kernel; the four variable-count modes give the same number; bad boxes
are refused."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torchvision.ops import generalized_box_iou_loss as tv_giou_loss

import fastzoo.losses.giou as G
from fastzoo.losses.kernels import giou_op
from fastzoo.data.boxes import collate_boxes
from fastzoo.losses import (
    giou_loss,
    giou_loss_concat,
    giou_loss_kernel,
    giou_loss_padded,
    giou_loss_per_sample,
    kernel_path,
)
from tests.conftest import cuda_only


def random_boxes(n, g=None):
    xy = torch.rand(n, 2, generator=g)
    return torch.cat([xy, xy + torch.rand(n, 2, generator=g) * 0.5], -1)


def box_pairs():
    """Random pairs plus every degenerate case: identical, zero width / height / area,
    disjoint, touching edges and corners, nested, and equal coordinates (ties)."""
    g = torch.Generator().manual_seed(0)
    p, t = random_boxes(64, g), random_boxes(64, g)
    special = [
        ([0.1, 0.1, 0.5, 0.5], [0.1, 0.1, 0.5, 0.5]),  # identical
        ([0.2, 0.1, 0.2, 0.6], [0.1, 0.1, 0.5, 0.5]),  # zero width inside the other
        ([0.1, 0.3, 0.5, 0.3], [0.0, 0.0, 0.4, 0.4]),  # zero height
        ([0.3, 0.3, 0.3, 0.3], [0.3, 0.3, 0.3, 0.3]),  # identical points (zero enclosing area)
        ([0.3, 0.3, 0.3, 0.3], [0.1, 0.1, 0.5, 0.5]),  # a point inside a box
        ([0.0, 0.0, 0.2, 0.2], [0.5, 0.5, 0.9, 0.9]),  # disjoint
        ([0.0, 0.0, 0.2, 0.2], [0.2, 0.0, 0.4, 0.2]),  # touching edge
        ([0.0, 0.0, 0.2, 0.2], [0.2, 0.2, 0.4, 0.4]),  # touching corner
        ([0.1, 0.1, 0.9, 0.9], [0.3, 0.3, 0.5, 0.5]),  # nested
        ([0.1, 0.1, 0.5, 0.5], [0.1, 0.2, 0.5, 0.7]),  # shared left and right edges
        ([0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.5, 1.0]),  # three shared edges
    ]
    sp = torch.tensor([a for a, _ in special])
    st = torch.tensor([b for _, b in special])
    return torch.cat([p, sp]), torch.cat([t, st])



def ran(call) -> str:
    """Which GIoU path ``call()`` took, as ``fastzoo.explain`` reads it from the profiler (the one
    place that says which kernel executed): "torch" (no fused op ran), "compiled" (the fused op's
    C++ / Triton kernel) or "vectorised" (the fused op's closed form in torch ops)."""
    from fastzoo import explain

    rows = explain(torch.nn.Identity(), torch.zeros(1), loss=lambda _: call(), allow_fallback=True).rows
    fused = [n for row in rows for n in row.executed if n.startswith("fastzoo::")]
    if not fused:
        return "torch"
    return "compiled" if fused[0].endswith("(compiled kernel)") else "vectorised"

def loss_and_grads(fn, p, t, dtype=torch.float32, reduction="none"):
    a = p.to(dtype).clone().requires_grad_()
    b = t.to(dtype).clone().requires_grad_()
    loss = fn(a, b, reduction)
    w = torch.linspace(-1, 2, loss.numel(), device=loss.device).reshape(loss.shape)  # a non-uniform upstream gradient
    (loss * w).sum().backward()
    return loss.detach(), a.grad, b.grad


TV = lambda a, b, r: tv_giou_loss(a, b, reduction=r)  # noqa: E731


@pytest.mark.parametrize("impl", ["torch", "kernel"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_matches_torchvision_fp32(impl, reduction):
    p, t = box_pairs()
    ref = loss_and_grads(TV, p, t, reduction=reduction)
    out = loss_and_grads(lambda a, b, r: giou_loss(a, b, reduction=r, impl=impl), p, t, reduction=reduction)
    assert ran(lambda: giou_loss(p, t, impl=impl)) == {"torch": "torch", "kernel": "compiled"}[impl]
    assert out[0].dtype == torch.float32
    # values: same formula and op order in fp32 -> at most a few ulp
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)
    # grads: the kernel's closed form reassociates autograd's chain; degenerate pairs have
    # grads up to ~1/eps, hence a relative tolerance
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", "kernel"])
@pytest.mark.parametrize("dtype,ulp", [(torch.float16, 2 ** -10), (torch.bfloat16, 2 ** -7)])
def test_low_precision_is_computed_in_fp32(impl, dtype, ulp):
    p, t = box_pairs()
    ref = loss_and_grads(TV, p, t, dtype)
    out = loss_and_grads(lambda a, b, r: giou_loss(a, b, reduction=r, impl=impl), p, t, dtype)
    assert ran(lambda: giou_loss(p.to(dtype), t.to(dtype), impl=impl)) == {"torch": "torch", "kernel": "compiled"}[impl]
    assert out[0].dtype == torch.float32 and out[1].dtype == dtype  # fp32 loss, grads in the boxes' dtype
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)  # both compute in fp32 on the same rounded boxes
    # grads are fp32 values rounded to dtype: at most one rounding step apart
    torch.testing.assert_close(out[1], ref[1], rtol=2 * ulp, atol=1e-5)
    torch.testing.assert_close(out[2], ref[2], rtol=2 * ulp, atol=1e-5)


def test_fp64_is_computed_in_fp64():
    p, t = box_pairs()
    ref = loss_and_grads(TV, p, t, torch.float64)
    out = loss_and_grads(lambda a, b, r: giou_loss(a, b, reduction=r, impl="kernel"), p, t, torch.float64)
    assert ran(lambda: giou_loss(p.double(), t.double(), impl="kernel")) == "compiled"
    assert out[0].dtype == torch.float64 and out[1].dtype == torch.float64
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-12)  # same op order in fp64
    # fp64 grads up to ~1/eps = 1e7 on degenerate pairs: relative, ~1e4 ulp of reassociation
    torch.testing.assert_close(out[1], ref[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-12, atol=1e-12)


def test_kernel_path_is_reported():
    """This machine has a C++ compiler and ninja: the C++ kernel must be what runs (a failed
    build would report "cpu-vectorised" here and fail the test)."""
    p, t = box_pairs()
    assert kernel_path("cpu") == "cpu-cpp"
    assert kernel_path("cuda") == "triton"
    assert ran(lambda: giou_loss(p, t, impl="kernel")) == "compiled"
    assert ran(lambda: giou_loss(p, t, impl="auto")) == "compiled"  # auto = the fused kernel, never the naive path silently
    assert ran(lambda: giou_loss(p, t, impl="torch")) == "torch"


def test_cpp_kernel_on_large_and_strided_inputs():
    """Above the kernel's grain (16384 boxes) the loop is split across threads; a strided
    [N, 4] view goes in without a copy in Python. Both must give torchvision's numbers."""
    g = torch.Generator().manual_seed(1)
    n = 40_000
    p, t = random_boxes(n, g), random_boxes(n, g)
    ref = loss_and_grads(TV, p, t, reduction="sum")
    out = loss_and_grads(lambda a, b, r: giou_loss(a, b, reduction=r, impl="kernel"), p, t, reduction="sum")
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-3)  # a sum of 40k fp32 terms: summation order
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-5)  # as in the fp32 test
    pp, tt = box_pairs()
    pred_strided = torch.stack([pp, pp], 1)[:, 1]  # [N, 4] with row stride 8
    assert not pred_strided.is_contiguous()
    ref = loss_and_grads(TV, pred_strided, tt)
    out = loss_and_grads(lambda a, b, r: giou_loss(a.expand(2, -1, -1)[1], b, reduction=r, impl="kernel"), pred_strided, tt)
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-5)


def test_box_check_in_cpp_matches_the_torch_ops():
    """first_bad_box runs in C++ on CPU once the kernel is loaded; fp64 boxes are compared in
    fp64 (an inversion of 1e-12 is caught, and 1e300 is finite)."""
    assert kernel_path("cpu") == "cpu-cpp" and giou_op.cpp_loaded()
    b = random_boxes(10).double()
    assert G.first_bad_box(b) is None
    b[7, 2] = b[7, 0] - 1e-12
    assert G.first_bad_box(b) == 7
    b[7, 2] = b[7, 0] + 1e300
    b[3, 1] = float("nan")
    assert G.first_bad_box(b) == 3
    assert G.first_bad_box(b.reshape(2, 5, 4)) == 3  # rows of the flattened boxes
    assert G.first_bad_box(b[:0]) is None


def test_vectorised_fallback_is_said_and_equal():
    """FASTZOO_GIOU_CPU=vectorised stands in for a machine without a compiler: the op falls
    back to the vectorised closed form, warns once, reports "cpu-vectorised", and still gives
    torchvision's values and grads (a fresh process: the C++ kernel, once loaded, owns CPU)."""
    code = textwrap.dedent("""
        import warnings
        import torch
        from torchvision.ops import generalized_box_iou_loss
        import fastzoo.losses.giou as G
        from tests.test_giou import box_pairs, loss_and_grads, ran
        p, t = box_pairs()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert G.kernel_path("cpu") == "cpu-vectorised"
            G.giou_loss(p, t, impl="kernel")
        assert len(caught) == 1 and "FASTZOO_GIOU_CPU=vectorised" in str(caught[0].message), caught
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2 ** -6), (torch.float64, 1e-12)):
            for reduction in ("none", "mean"):
                ref = loss_and_grads(lambda a, b, r: generalized_box_iou_loss(a, b, reduction=r), p, t, dtype, reduction)
                out = loss_and_grads(lambda a, b, r: G.giou_loss(a, b, reduction=r, impl="kernel"), p, t, dtype, reduction)
                assert ran(lambda: G.giou_loss(p.to(dtype), t.to(dtype), reduction=reduction, impl="kernel")) == "vectorised"
                torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)
                torch.testing.assert_close(out[1], ref[1], rtol=tol, atol=1e-5)
                torch.testing.assert_close(out[2], ref[2], rtol=tol, atol=1e-5)
        b = p.clone()
        b[5, 3] = b[5, 1] - 0.1
        assert G.first_bad_box(b) == 5  # the torch-ops check
        print("ok")
    """)
    env = {**os.environ, giou_op.FORCE_ENV: "vectorised", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_empty_and_batched_shapes():
    e = torch.zeros(0, 4, requires_grad=True)
    for impl in ("torch", "kernel"):
        assert giou_loss(e, e, impl=impl).shape == (0,)
        m = giou_loss(e, e, reduction="mean", impl=impl)
        assert m.item() == 0.0 and m.requires_grad  # torchvision's convention: 0, still in the graph
    p, t = box_pairs()
    a, b = p[:60].reshape(3, 20, 4), t[:60].reshape(3, 20, 4)
    torch.testing.assert_close(giou_loss(a, b, impl="kernel"), tv_giou_loss(a, b), rtol=0, atol=1e-6)


def _matched(counts, seed=0):
    """Per-image matched (pred, target) pairs with the given box counts."""
    g = torch.Generator().manual_seed(seed)
    return [random_boxes(n, g) for n in counts], [random_boxes(n, g) for n in counts]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("counts", [(3, 0, 5, 1), (0, 0), (4,)])
def test_four_modes_give_the_same_number(counts, reduction):
    preds, targets = _matched(counts)
    tb, pb = collate_boxes(targets), collate_boxes(preds)
    n = sum(counts)
    flat_t = torch.cat(targets) if n else torch.zeros(0, 4)
    flat_p = torch.cat(preds) if n else torch.zeros(0, 4)
    expected = tv_giou_loss(flat_p, flat_t, reduction=reduction)

    def run(mode):
        base = pb.boxes.clone().requires_grad_()  # every mode differentiates the same leaf
        if mode == "per_sample":
            loss = giou_loss_per_sample(list(base.split(pb.counts)), tb.per_image(), reduction=reduction)
        elif mode == "concat":
            loss = giou_loss_concat(base, tb.boxes, reduction=reduction)
        elif mode.startswith("padded"):  # padded-<impl>-<validity>
            _, impl, validity = mode.split("-")
            padded = torch.zeros_like(pb.padded).index_put((pb.batch_index, _slots(pb.counts)), base)
            mask = tb.mask if validity == "mask" else None
            loss = giou_loss_padded(padded, tb.padded, mask, reduction=reduction, impl=impl)
        else:
            loss = giou_loss_kernel(base, tb.boxes, reduction=reduction)
        loss.backward()
        return loss.detach(), base.grad

    modes = ("per_sample", "concat", "padded-torch-mask", "padded-torch-target", "padded-kernel-mask",
             "padded-kernel-target", "kernel")
    results = {m: run(m) for m in modes}
    for mode, (value, grad) in results.items():
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6, msg=mode)  # summation order only
        torch.testing.assert_close(grad, results["concat"][1], rtol=1e-5, atol=1e-6, msg=mode)


def _slots(counts):
    return torch.cat([torch.arange(n) for n in counts]) if sum(counts) else torch.zeros(0, dtype=torch.long)


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_padded_mode_ignores_garbage_in_padding(impl):
    preds, targets = _matched((2, 1))
    tb = collate_boxes(targets)
    pred = collate_boxes(preds).padded.clone()
    pred[1, 1] = float("nan")  # a padded slot: must not leak into loss or gradient
    target = tb.padded.clone()
    target[1, 1] = torch.tensor([0.9, 0.9, 0.1, float("inf")])
    pred.requires_grad_()
    loss = giou_loss_padded(pred, target, tb.mask, impl=impl)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(pred.grad).all()
    assert (pred.grad[1, 1] == 0).all()
    torch.testing.assert_close(loss, tv_giou_loss(torch.cat(preds), torch.cat(targets), reduction="sum"))


def test_compiles_fullgraph_through_the_custom_op():
    """The op traces under torch.compile(fullgraph=True) (fake + autograd registrations);
    aot_eager runs the traced graph without C++ codegen, which would take minutes here."""
    p, t = box_pairs()
    f = torch.compile(lambda a, b: giou_loss(a, b, reduction="sum", impl="kernel", validate=False),
                      fullgraph=True, backend="aot_eager")
    a, a_ref = p.clone().requires_grad_(), p.clone().requires_grad_()
    loss, ref = f(a, t), tv_giou_loss(a_ref, t, reduction="sum")
    loss.backward(), ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-6, atol=1e-5)  # summation order only
    torch.testing.assert_close(a.grad, a_ref.grad, rtol=1e-4, atol=1e-5)  # as in the fp32 test


@cuda_only()
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_kernel_matches_torchvision_on_gpu(dtype):
    p, t = box_pairs()
    p, t = p.cuda(), t.cuda()
    ref = loss_and_grads(TV, p, t, dtype)
    out = loss_and_grads(lambda a, b, r: giou_loss(a, b, reduction=r, impl="kernel"), p, t, dtype)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], ref[1], rtol=tol, atol=1e-5)
    torch.testing.assert_close(out[2], ref[2], rtol=tol, atol=1e-5)
    assert ran(lambda: giou_loss(p.to(dtype), t.to(dtype), impl="kernel")) == "compiled"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_in_the_interpreter():
    """The Triton forward and backward kernels, run by Triton's CPU interpreter
    (TRITON_INTERPRET=1, set before triton is imported, hence a subprocess): checks the
    kernels' logic against torchvision; the GPU test above checks the compiled code."""
    code = textwrap.dedent("""
        import torch
        from torchvision.ops import generalized_box_iou_loss
        from fastzoo.losses.kernels import triton_giou
        from tests.test_giou import box_pairs, ran
        p, t = box_pairs()
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            a, b = p.to(dtype).clone().requires_grad_(), t.to(dtype).clone().requires_grad_()
            ref = generalized_box_iou_loss(a, b)
            w = torch.linspace(-1, 2, ref.numel(), dtype=ref.dtype)
            (ref * w).sum().backward()
            loss = triton_giou.forward(a.detach(), b.detach(), 1e-7)
            gp, gt = triton_giou.backward(w, a.detach(), b.detach(), 1e-7)
            assert loss.dtype == ref.dtype and gp.dtype == dtype
            torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
            tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-4)
            torch.testing.assert_close(gp, a.grad, rtol=tol, atol=1e-5)
            torch.testing.assert_close(gt, b.grad, rtol=tol, atol=1e-5)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_failed_build_falls_back_with_the_reason(tmp_path):
    """No compiler (CXX names a missing one; an empty extensions directory, so nothing cached
    is loaded): the loss still works, through the vectorised form, and the warning says why."""
    code = textwrap.dedent("""
        import warnings
        import torch
        from torchvision.ops import generalized_box_iou_loss
        import fastzoo.losses.giou as G
        from tests.test_giou import box_pairs, ran
        p, t = box_pairs()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = G.giou_loss(p, t, impl="kernel")
        assert ran(lambda: G.giou_loss(p, t, impl="kernel")) == "vectorised" and G.kernel_path("cpu") == "cpu-vectorised"
        msgs = [str(w.message) for w in caught if "fastzoo GIoU" in str(w.message)]
        assert len(msgs) == 1 and "building the C++ kernel failed" in msgs[0] and "/nonexistent/c++" in msgs[0], msgs
        torch.testing.assert_close(loss, generalized_box_iou_loss(p, t), rtol=0, atol=1e-6)
        print("ok")
    """)
    env = {**os.environ, "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    env.pop(giou_op.FORCE_ENV, None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("impl", ["torch", "kernel"])
@pytest.mark.parametrize(
    "bad,match",
    [
        ([float("nan"), 0.0, 1.0, 1.0], "target: box 0 is not finite"),
        ([0.0, 0.0, float("inf"), 1.0], "target: box 0 is not finite"),
        ([0.5, 0.0, 0.2, 1.0], "target: box 0 has x2 < x1"),
        ([0.0, 0.5, 1.0, 0.2], "target: box 0 has x2 < x1 or y2 < y1"),
    ],
)
def test_bad_boxes_are_refused(impl, bad, match):
    p = torch.rand(3, 2).repeat(1, 2) + torch.tensor([0.0, 0.0, 0.1, 0.1])
    t = p.clone()
    t[0] = torch.tensor(bad)
    with pytest.raises(ValueError, match=match):
        giou_loss(p, t, impl=impl)


@pytest.mark.parametrize("impl", ["torch", "kernel"])
def test_integer_boxes_are_upcast_like_torchvision(impl):
    """torchvision upcasts non-float boxes to fp32 (``_upcast_non_float``); so do we. Pixel
    coordinates with every degenerate case: identical, touching, disjoint, nested, zero width."""
    pred = torch.tensor([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [2, 2, 5, 5], [3, 3, 3, 9], [7, 1, 9, 4]])
    target = torch.tensor([[0, 0, 10, 10], [10, 0, 20, 10], [30, 30, 40, 41], [0, 0, 10, 10], [1, 1, 6, 6], [5, 0, 12, 3]])
    for dtype in (torch.int64, torch.int32, torch.uint8):
        for reduction in ("none", "mean", "sum"):
            ref = tv_giou_loss(pred.to(dtype), target.to(dtype), reduction=reduction)
            out = giou_loss(pred.to(dtype), target.to(dtype), reduction=reduction, impl=impl)
            assert out.dtype == ref.dtype == torch.float32
            # same fp32 formula on the same upcast values: equal up to op order (1e-6 on losses in [0, 2])
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    # an integer target with float predictions: the predictions' gradient still equals torchvision's
    p1, p2 = pred.float().requires_grad_(), pred.float().requires_grad_()
    tv_giou_loss(p1, target, reduction="sum").backward()
    giou_loss(p2, target, reduction="sum", impl=impl).backward()
    torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-7)  # closed form vs autograd


def test_bad_shapes_and_options_are_refused():
    p = random_boxes(4)
    with pytest.raises(ValueError, match="pred must have last dimension 4"):
        giou_loss(p[:, :3], p)
    with pytest.raises(ValueError, match="same shape"):
        giou_loss(p, p[:3])
    with pytest.raises(ValueError, match="reduction="):
        giou_loss(p, p, reduction="avg")
    with pytest.raises(ValueError, match="impl="):
        giou_loss(p, p, impl="cuda")
    with pytest.raises(ValueError, match="pred must hold real coordinates"):
        giou_loss(p > 0.5, p)
    with pytest.raises(ValueError, match="preds has 2 images but targets has 1"):
        giou_loss_per_sample([p, p], [p])
    with pytest.raises(ValueError, match="mask must be a bool"):
        giou_loss_padded(p[None], p[None], torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="choose 'sum' or 'mean'"):
        giou_loss_concat(p, p, reduction="none")


def test_collated_targets_mark_their_padding():
    """collate_boxes pads with PAD_BOX, an inverted box: the padded targets alone say which
    slots are real (the mask=None form of giou_loss_padded), and no real box is inverted."""
    tb = collate_boxes([random_boxes(n) for n in (2, 0, 4)])
    assert torch.equal(~giou_op.padding_rows(tb.padded), tb.mask)
    assert tb.padded[1].tolist() == [list(G.PAD_BOX)] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_valid_rows_op_reads_padding_as_padding_rows_does(dtype):
    """The C++ kernel of torch.ops.fastzoo.giou_valid_rows (the mask the from-target form derives
    once and hands to both directions) against its definition, padding_rows: inverted in x only,
    in y only, zero-size boxes (real), NaN (real: it must stay visible), 13 slots (not a multiple
    of the 8 the kernel's loops skip at a time)."""
    assert G.kernel_path("cpu") == "cpu-cpp"
    rows = [[0, 0, 1, 1], [0, 0, -1, 1], [0, 0, 1, -1], list(G.PAD_BOX), [0.5, 0.5, 0.5, 0.5],
            [float("nan"), 0, 1, 1], [0, 0, float("nan"), -1], [2, 2, 1, 3], [0, 0, 0, 0], [1, 1, 2, 2],
            [0, 3, 1, 2], [0.1, 0.2, 0.3, 0.4], list(G.PAD_BOX)]
    target = torch.tensor(rows, dtype=dtype)
    got = torch.ops.fastzoo.giou_valid_rows(target)
    assert got.dtype == torch.bool and torch.equal(got, ~giou_op.padding_rows(target))
    assert got.tolist() == [True, False, False, False, True, True, False, False, True, True, False, True, False]


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("mask_form", [True, False], ids=["mask", "from-target"])
def test_padded_kernel_matches_torchvision_on_the_real_pairs(reduction, mask_form):
    """The fused padded op against torchvision on the gathered real pairs: values, and the
    gradient of every slot (the real ones torchvision's, padding exactly 0), for pred and target,
    with a non-uniform upstream gradient for "none"; above the C++ grain (16384 slots), so the
    loop and the reduction run on several threads."""
    g = torch.Generator().manual_seed(2)
    B, M = 300, 64
    counts = torch.randint(0, 5, (B,), generator=g)
    mask = torch.arange(M)[None, :] < counts[:, None]
    pred, target = random_boxes(B * M, g).view(B, M, 4), random_boxes(B * M, g).view(B, M, 4)
    target = torch.where(mask[..., None], target, torch.tensor(G.PAD_BOX))
    pred[~mask] = float("nan")  # whatever padding holds, it must not leak
    a, b = pred.clone().requires_grad_(), target.clone().requires_grad_()
    loss = giou_loss_padded(a, b, mask if mask_form else None, reduction=reduction, impl="kernel", validate=False)
    assert ran(lambda: giou_loss_padded(pred, target, mask if mask_form else None, impl="kernel", validate=False)) == "compiled"
    w = torch.linspace(-1, 2, loss.numel(), dtype=torch.float64).reshape(loss.shape)
    (loss * w).sum().backward()
    ra, rb = pred[mask].double().requires_grad_(), target[mask].double().requires_grad_()
    ref = tv_giou_loss(ra, rb, reduction=reduction)
    (ref * (w[mask] if reduction == "none" else w)).sum().backward()
    if reduction == "none":
        assert (loss[~mask] == 0).all()
        loss, ref = loss[mask], ref
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)  # fp32 math vs fp64, fp64 sum
    for grad, ref_grad in ((a.grad, ra.grad), (b.grad, rb.grad)):
        assert (grad[~mask] == 0).all()
        torch.testing.assert_close(grad[mask].double(), ref_grad, rtol=1e-4, atol=1e-6)  # as the fp32 test


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_padded_all_padding_gives_zero(impl):
    pred = torch.rand(3, 2, 4).requires_grad_()
    target = torch.tensor(G.PAD_BOX).repeat(3, 2, 1)
    for reduction in ("sum", "mean"):
        loss = giou_loss_padded(pred, target, reduction=reduction, impl=impl)
        (grad,) = torch.autograd.grad(loss, pred)
        assert loss.item() == 0.0 and (grad == 0).all()  # torchvision's mean of nothing is 0 too


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_padded_backward_of_no_pairs_is_empty(impl):
    """No pairs at all (a batch without boxes), per-row loss, its gradient reaching the op through a select:
    an empty gradient comes back (the C++ backward read the first element of an empty grad: a segfault)."""
    pred = torch.rand(8, 4).requires_grad_()
    loss = giou_loss_padded(pred[:0][None], torch.rand(1, 0, 4), reduction="none", eps=0.0, impl=impl, validate=False)[0]
    (grad,) = torch.autograd.grad(loss.sum(), pred)
    assert loss.shape == (0,) and (grad == 0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(mask=torch.ones(2, 3)), "mask must be a bool"),
    (dict(mask=torch.ones(3, 2, dtype=torch.bool)), "mask must be a bool"),
    (dict(target=torch.rand(2, 4, 4)), "must both be"),
    (dict(reduction="max"), "reduction="),
    (dict(impl="triton"), "impl="),
])
def test_padded_bad_arguments_are_named(bad, match):
    kw = dict(pred=torch.rand(2, 3, 4), target=torch.rand(2, 3, 4) + torch.tensor([0, 0, 1, 1]), mask=None) | bad
    with pytest.raises(ValueError, match=match):
        giou_loss_padded(kw.pop("pred"), kw.pop("target"), kw.pop("mask"), **kw)


def test_padded_kernel_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces the padded op, reduction included: no graph break,
    hence no host sync (a .item() or a data-dependent shape would break the graph)."""
    tb = collate_boxes([random_boxes(n) for n in (2, 0, 3)])
    pred = collate_boxes([random_boxes(n) for n in (2, 0, 3)]).padded
    f = torch.compile(lambda a, t: giou_loss_padded(a, t, reduction="mean", impl="kernel", validate=False),
                      fullgraph=True, backend="aot_eager")
    a, a_ref = pred.clone().requires_grad_(), pred.clone().requires_grad_()
    loss = f(a, tb.padded)
    ref = giou_loss_padded(a_ref, tb.padded, tb.mask, reduction="mean", impl="torch")
    loss.backward(), ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-6, atol=1e-6)  # summation order only
    torch.testing.assert_close(a.grad, a_ref.grad, rtol=1e-4, atol=1e-6)  # as in the fp32 test


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_padded_kernels_in_the_interpreter():
    """The padded Triton kernels (mask and from-target forms, every reduction, mixed dtypes)
    under Triton's CPU interpreter, against the C++ CPU kernel: the same arithmetic (fp64 sums,
    IEEE divisions, eps in the compute dtype), so equal to a few ulp."""
    code = textwrap.dedent("""
        import torch
        import fastzoo.losses.giou as G
        from fastzoo.losses.kernels import triton_giou, giou_op
        from tests.test_giou import random_boxes
        assert G.kernel_path("cpu") == "cpu-cpp"  # loads the C++ kernels: the reference below
        g = torch.Generator().manual_seed(0)
        B, M = 5, 7
        mask = torch.arange(M)[None, :] < torch.tensor([0, 3, 7, 1, 2])[:, None]
        p = random_boxes(B * M, g).view(B, M, 4)
        t = torch.where(mask[..., None], random_boxes(B * M, g).view(B, M, 4), torch.tensor(G.PAD_BOX))
        p[~mask] = float("nan")
        for pdt, tdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
            a, b = p.to(pdt), t.to(tdt)
            for m in (mask, None):
                for red in (0, 1, 2):
                    ref = giou_op.giou_loss_masked(a, b, m, 1e-7, red)  # the C++ kernel (CPU)
                    out = triton_giou.masked_forward(a, b, m, 1e-7, red)
                    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.shape, ref.shape)
                    tol = 1e-12 if ref.dtype == torch.float64 else 1e-6
                    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
                    grad = torch.linspace(-1, 2, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
                    gref = giou_op.giou_loss_masked_bwd(grad, a, b, m, 1e-7, red, True, True)
                    gout = triton_giou.masked_backward(grad, a, b, m, 1e-7, red, True, True)
                    only_pred = triton_giou.masked_backward(grad, a, b, m, 1e-7, red, True, False)
                    assert only_pred[1].numel() == 0 and torch.equal(only_pred[0], gout[0])
                    for x, y in zip(gout, gref):
                        assert x.dtype == y.dtype and torch.isfinite(x).all()
                        torch.testing.assert_close(x, y, rtol=1e-5 if x.dtype != torch.bfloat16 else 2 ** -7, atol=tol)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_triton_kernel_module_without_triton_names_the_package(monkeypatch):
    """The Triton GIoU module is imported only for CUDA tensors; on a machine without Triton it
    says what is missing and what to use instead, not a bare ModuleNotFoundError."""
    import importlib
    import sys

    from fastzoo.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "fastzoo.losses.kernels.triton_giou", raising=False)
    with pytest.raises(BackendUnavailableError, match="needs Triton.*impl=\"torch\""):
        importlib.import_module("fastzoo.losses.kernels.triton_giou")
