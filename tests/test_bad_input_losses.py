"""Bad input to the losses (``giou_loss`` in each implementation, ``linear_cross_entropy``):
a ValueError naming the argument, and the inputs left as they were (no in-place clamping or
upcasting of a caller's tensor). Mixed dtypes and autocast are the subject of
tests/test_losses_autocast.py; ``causal_lm_loss`` with packed input, of the GPT-2 tests.
"""
import re

import pytest
import torch

from fastzoo.losses import giou_loss, giou_loss_padded, linear_cross_entropy

BOXES = torch.tensor([[0.1, 0.1, 0.5, 0.5], [0.2, 0.2, 0.6, 0.9], [0.0, 0.0, 1.0, 1.0]])
NAN, INF = float("nan"), float("inf")


def with_box(i, box):
    out = BOXES.clone()
    out[i] = torch.tensor(box)
    return out


GIOU_BAD = {
    "nan coordinate": (lambda: (with_box(1, [0.2, NAN, 0.6, 0.9]), BOXES), "pred: box 1 is not finite"),
    "inf coordinate": (lambda: (BOXES, with_box(2, [0.0, 0.0, INF, 1.0])), "target: box 2 is not finite"),
    "inverted box": (lambda: (with_box(0, [0.5, 0.1, 0.1, 0.5]), BOXES), "pred: box 0 has x2 < x1"),
    "shapes differ": (lambda: (BOXES, BOXES[:2]), "same shape"),
    "3 coordinates": (lambda: (BOXES[:, :3], BOXES[:, :3]), "last dimension 4"),
    "a scalar": (lambda: (torch.tensor(1.0), torch.tensor(1.0)), "last dimension 4"),
    "bool boxes": (lambda: (BOXES > 0.3, BOXES > 0.3), "real coordinates"),
    "complex boxes": (lambda: (BOXES.to(torch.complex64), BOXES), "real coordinates"),
    "a list": (lambda: ([[0.0, 0.0, 1.0, 1.0]], BOXES[:1]), "must be a tensor"),
    "huge values": (lambda: (with_box(0, [0.0, 0.0, 1e39, 1.0]), BOXES), "pred: box 0 is not finite"),  # inf in fp32
}


@pytest.mark.parametrize("impl", ["torch", "kernel"])
@pytest.mark.parametrize("case", list(GIOU_BAD))
def test_giou_bad_boxes_are_named(case, impl):
    make, needle = GIOU_BAD[case]
    pred, target = make()
    copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in (pred, target)]
    with pytest.raises(ValueError, match=re.escape(needle)):
        giou_loss(pred, target, impl=impl)
    for given, copy in zip((pred, target), copies):
        if isinstance(given, torch.Tensor):
            assert given.dtype == copy.dtype and torch.equal(given.nan_to_num(), copy.nan_to_num())


@pytest.mark.parametrize("arg,value,needle", [
    ("reduction", "avg", "reduction='avg'"),
    ("impl", "cuda", "impl='cuda'"),
])
def test_giou_bad_options_are_named(arg, value, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        giou_loss(BOXES, BOXES, **{arg: value})


@pytest.mark.parametrize("impl", ["torch", "kernel"])
def test_giou_empty_input_is_zero_like_torchvision(impl):
    """No boxes: torchvision's generalized_box_iou_loss gives 0 for mean and sum, still in the graph."""
    pred = BOXES[:0].clone().requires_grad_()
    for reduction in ("mean", "sum"):
        loss = giou_loss(pred, BOXES[:0], reduction=reduction, impl=impl)
        assert loss.item() == 0.0 and loss.requires_grad


def test_giou_padded_mask_must_fit():
    pred, target = BOXES[None], BOXES[None]
    with pytest.raises(ValueError, match="mask"):
        giou_loss_padded(pred, target, torch.ones(1, 2, dtype=torch.bool))


def test_integer_boxes_are_upcast_not_modified():
    pred, target = torch.tensor([[0, 0, 5, 5]]), torch.tensor([[1, 1, 6, 6]])
    loss = giou_loss(pred, target)
    assert pred.dtype == torch.int64 and loss.dtype == torch.float32
    assert abs(loss.item() - (1 - (16 / 34 - (36 - 34) / 36))) <= 1e-6  # IoU 16/34, hull 36


H, W, Y = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
LCE_BAD = {
    "target out of range": ((H, W, Y + 20), "target_N"),
    "target negative": ((H, W, Y - 20), "target_N"),
    "float targets": ((H, W, Y.float()), "target_N must hold integer class indices"),
    "target length": ((H, W, Y[:3]), "target_N must have shape"),
    "weight width": ((H, W[:, :4], Y), "weight_VD must be [V, D]"),
    "integer hidden": ((H.long(), W, Y), "must be floating point"),
}


@pytest.mark.parametrize("impl", ["reference", "fused"])
@pytest.mark.parametrize("case", list(LCE_BAD))
def test_linear_cross_entropy_bad_inputs_are_named(case, impl):
    args, needle = LCE_BAD[case]
    with pytest.raises(ValueError, match=re.escape(needle)):
        linear_cross_entropy(*args, impl=impl)


@pytest.mark.parametrize("arg,value", [("reduction", "avg"), ("impl", "fast")])
def test_linear_cross_entropy_bad_options_are_named(arg, value):
    with pytest.raises(ValueError, match=f"{arg}='{value}'"):
        linear_cross_entropy(H, W, Y, **{arg: value})
