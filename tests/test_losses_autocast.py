"""Every loss path under autocast and with mixed dtypes: bf16 / fp16 predictions
against fp32 targets, on CPU, through every GIoU implementation and layout, the fused LM-head
cross-entropy and DETR's set loss; each matches the fp32 reference within the dtype's
tolerance (the detection script's ``--amp bf16`` recipe runs in tests/test_finetune_detection.py)."""
import pytest
import torch
from torchvision.ops import generalized_box_iou_loss as tv_giou_loss

from fastzoo.data.boxes import collate_boxes
from fastzoo.losses import giou_loss, giou_loss_padded
from tests.test_giou import box_pairs, random_boxes, ran

# one rounding of the boxes to the dtype (8 / 11 significant bits), amplified by up to ~4 in the
# loss's differences of coordinates: rtol on the values; grads the same, relative to their scale
TOL = {torch.bfloat16: 2 ** -6, torch.float16: 2 ** -8}
DTYPES = [torch.bfloat16, torch.float16]


def _fp32_reference(p, t, reduction):
    a = p.float().clone().requires_grad_()
    loss = tv_giou_loss(a, t.float(), reduction=reduction)
    loss.sum().backward()
    return loss.detach(), a.grad


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_low_precision_predictions_with_fp32_targets(impl, dtype):
    """bf16 / fp16 predictions against fp32 targets (an autocast region's boxes) run on every
    path, not torch's "pred is BFloat16 but target is Float": each is read in its own dtype, computed in fp32."""
    p, t = box_pairs()
    a = p.to(dtype).requires_grad_()
    loss = giou_loss(a, t, reduction="none", impl=impl)
    loss.sum().backward()
    assert ran(lambda: giou_loss(a, t, impl=impl)) == ("compiled" if impl == "kernel" else "torch")
    assert loss.dtype == torch.float32 and a.grad.dtype == dtype
    ref, ref_grad = _fp32_reference(p.to(dtype), t, "none")  # the same rounded predictions, in fp32
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)  # fp32 math on identical inputs
    torch.testing.assert_close(a.grad.float(), ref_grad, rtol=TOL[dtype], atol=1e-5)  # grads rounded to dtype


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("mask_form", [True, False], ids=["mask", "from-target"])
def test_padded_loss_with_mixed_dtypes_both_ways(impl, mask_form):
    """bf16 pred / fp32 target and fp32 pred / fp64 target (the math runs in the wider one)."""
    preds, targets = [random_boxes(n) for n in (3, 0, 2)], [random_boxes(n) for n in (3, 0, 2)]
    tb = collate_boxes(targets)
    pad = collate_boxes(preds).padded
    for pdt, tdt, tol in ((torch.bfloat16, torch.float32, 1e-6), (torch.float32, torch.float64, 1e-12)):
        a = pad.to(pdt).requires_grad_()
        loss = giou_loss_padded(a, tb.padded.to(tdt), tb.mask if mask_form else None, reduction="mean", impl=impl)
        loss.backward()
        assert loss.dtype == torch.promote_types(tdt, torch.float32) and a.grad.dtype == pdt
        ref = tv_giou_loss(torch.cat(preds).to(pdt).to(loss.dtype), torch.cat(targets).to(loss.dtype), reduction="mean")
        torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)  # same rounded inputs, computed in the wider dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_giou_path_under_autocast(dtype):
    """A box head under autocast returns low-precision boxes; every GIoU path takes them with
    fp32 targets and matches the fp32 run within the dtype's tolerance (loss and head grads)."""
    g = torch.Generator().manual_seed(0)
    counts = (3, 1, 0, 4)
    tb = collate_boxes([random_boxes(n, g) for n in counts])
    head = torch.nn.Linear(8, 4)
    x = torch.randn(len(counts), tb.mask.shape[1], 8, generator=g)

    def run(path, autocast):
        head.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            s = head(x).sigmoid()
            pred_BM4 = torch.cat([s[..., :2] * 0.5, s[..., :2] * 0.5 + s[..., 2:] * 0.5], -1)  # valid boxes
            assert pred_BM4.dtype == (dtype if autocast else torch.float32)
            if path.startswith("padded"):
                impl = path.split("-")[1]
                loss = giou_loss_padded(pred_BM4, tb.padded, reduction="mean", impl=impl, validate=False)
            else:
                loss = giou_loss(pred_BM4[tb.mask], tb.boxes, reduction="mean", impl=path)
        loss.backward()
        return loss.detach(), head.weight.grad.clone()

    for path in ("kernel", "torch", "padded-kernel", "padded-torch"):
        (l32, g32), (low, glow) = run(path, False), run(path, True)
        assert low.dtype == torch.float32, path
        assert abs(low - l32) <= 4 * TOL[dtype] * abs(l32), path
        assert (glow - g32).abs().max() <= 4 * TOL[dtype] * g32.abs().max(), path


@pytest.mark.parametrize("giou", ["kernel", "padded"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_detr_set_loss_under_autocast_matches_fp32(dtype, giou):
    """DETR's set loss on low-precision predictions (what an autocast forward gives) against the
    same values in fp32: the same assignment (the values are equal); the class and L1 terms computed
    in fp32 (as transformers' loss under autocast: its weighted cross-entropy upcasts, its class
    weights are fp32), so equal to fp32 rounding; the GIoU term within the dtype's tolerance (the
    predicted corners are the dtype's, as transformers' ``center_to_corners_format`` gives them);
    the gradients, rounded to the dtype, within its tolerance."""
    from fastzoo.losses.set_prediction import set_prediction_loss

    g = torch.Generator().manual_seed(1)
    L, B, Q, C = 2, 3, 6, 4
    logits = torch.randn(L, B, Q, C + 1, generator=g).to(dtype)
    boxes = torch.rand(L, B, Q, 4, generator=g).mul(0.5).add(0.25).to(dtype)
    labels = [{"class_labels": torch.randint(0, C, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.3}
              for n in (2, 0, 3)]

    def loss_and_grads(lo, bo):
        lo, bo = lo.clone().requires_grad_(), bo.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=lo.dtype != torch.float32):
            loss, parts = set_prediction_loss(lo, bo, labels, num_classes=C, giou_impl=giou)
        loss.backward()
        return loss.detach(), parts, lo.grad.float(), bo.grad.float()

    l32, p32, gl32, gb32 = loss_and_grads(logits.float(), boxes.float())
    low, plow, gllow, gblow = loss_and_grads(logits, boxes)
    assert low.dtype == torch.float32 and all(v.dtype == torch.float32 for v in plow.values())
    for k in ("loss_ce", "loss_ce_0", "loss_bbox", "loss_bbox_0"):
        assert abs(plow[k] - p32[k]) <= 1e-6 * max(abs(p32[k]), 1.0), (k, plow[k], p32[k])
    for k in ("loss_giou", "loss_giou_0"):
        assert abs(plow[k] - p32[k]) <= 4 * TOL[dtype] * max(abs(p32[k]), 1e-3), (k, plow[k], p32[k])
    assert (gblow - gb32).abs().max() <= 4 * TOL[dtype] * gb32.abs().max()
    assert (gllow - gl32).abs().max() <= 4 * TOL[dtype] * gl32.abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_lm_loss_and_linear_cross_entropy_under_autocast(dtype):
    """The LM losses take an autocast region's low-precision logits / hidden states: fp32 loss,
    within the dtype's tolerance of the fp32 run (the fused loss has its own tests in test_linear_ce)."""
    from fastzoo.losses import causal_lm_loss, linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50)
    x = torch.randn(2, 12, 16, generator=g)
    labels = torch.randint(0, 50, (2, 12), generator=g)
    labels[1, 8:] = -100
    results = {}
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            logits = head(x)
            a = causal_lm_loss(logits, labels)
            b = linear_cross_entropy(x[:, :-1].reshape(-1, 16), head.weight, labels[:, 1:].reshape(-1))
        assert a.dtype == torch.float32 and b.dtype == torch.float32
        results[autocast] = (a.item(), b.item())
    for low, full in zip(results[True], results[False]):
        assert abs(low - full) <= 4 * TOL[dtype] * abs(full)
