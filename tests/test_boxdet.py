"""Box detector: outputs, the two matchers on a hand-checked case, the four GIoU loss
modes giving the same loss and gradients, zero-box images, training lowers the loss,
collation, backbone loading, and bad targets."""
import pytest
import torch
import torchvision

import fastzoo
from fastzoo.data.boxes import collate_boxes, collate_detection
from fastzoo.losses.giou import generalized_box_iou

TINY = dict(layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), hidden_dim=32)


def tiny(**kw):
    return fastzoo.create("boxdet_r50", **{**TINY, "num_queries": 6, **kw})


def test_outputs_are_valid_boxes_and_logits():
    det = tiny(num_classes=3)
    out = det(torch.rand(2, 3, 64, 64))
    b = out["boxes"]
    assert b.shape == (2, 6, 4) and out["logits"].shape == (2, 6, 4)  # C + 1 logits
    assert (b >= 0).all() and (b <= 1).all()
    assert (b[..., 2] >= b[..., 0]).all() and (b[..., 3] >= b[..., 1]).all()


def _two_query_case():
    """Query 0 sits on target 1 and query 1 on target 0: ``order`` pairs them crosswise."""
    boxes = torch.tensor([[[0.5, 0.5, 0.9, 0.9], [0.1, 0.1, 0.3, 0.3]]])
    outputs = {"boxes": boxes, "logits": torch.zeros(1, 2, 2)}
    targets = [torch.tensor([[0.1, 0.1, 0.3, 0.3], [0.5, 0.5, 0.9, 0.9]])]
    return outputs, targets


def test_hungarian_finds_the_assignment_order_misses():
    outputs, targets = _two_query_case()
    tb = collate_boxes(targets)
    hung, order = tiny(num_queries=2, matcher="hungarian"), tiny(num_queries=2, matcher="order")
    assert hung.match(outputs, tb).tolist() == [1, 0]  # target 0 <- query 1, target 1 <- query 0
    assert order.match(outputs, tb).tolist() == [0, 1]
    h, o = hung.loss_components(outputs, targets), order.loss_components(outputs, targets)
    assert h["loss_bbox"].item() == pytest.approx(0.0, abs=1e-7)  # exact boxes
    assert h["loss_giou"].item() == pytest.approx(0.0, abs=1e-5)  # 1 - 0.04 / (0.04 + eps)
    # by hand: each crossed pair is off by 0.4, 0.4, 0.6, 0.6 -> (2.0 + 2.0) / 2 boxes
    assert o["loss_bbox"].item() == pytest.approx(2.0, abs=1e-6)
    # crossed pairs: IoU 0, union 0.2, enclosing 0.64 -> loss 1 + 0.44 / 0.64 each, mean over 2 boxes
    assert o["loss_giou"].item() == pytest.approx(1 + 0.44 / 0.64, abs=1e-5)


def test_hungarian_is_optimal_on_a_random_case():
    """Against brute force over all assignments of 3 targets to 4 queries."""
    import itertools

    g = torch.Generator().manual_seed(3)
    xy = torch.rand(1, 4, 2, generator=g)
    boxes = torch.cat([xy * 0.5, xy * 0.5 + 0.3], -1)
    outputs = {"boxes": boxes, "logits": torch.randn(1, 4, 3, generator=g)}
    txy = torch.rand(3, 2, generator=g) * 0.5
    tb = collate_boxes([torch.cat([txy, txy + 0.2], -1)], [torch.tensor([0, 1, 1])])
    det = tiny(num_queries=4, num_classes=2)
    cost = (5 * torch.cdist(boxes[0], tb.boxes, p=1) - outputs["logits"][0].softmax(-1)[:, tb.labels]
            - 2 * generalized_box_iou(boxes[0], tb.boxes))  # [Q, N], DETR's default weights
    best = min(itertools.permutations(range(4), 3), key=lambda q: sum(cost[q[j], j] for j in range(3)))
    assert det.match(outputs, tb).tolist() == list(best)


@pytest.mark.parametrize("matcher", ["order", "hungarian"])
def test_four_loss_modes_same_loss_and_grads(matcher):
    torch.manual_seed(0)
    det = tiny(num_classes=2, matcher=matcher).eval()
    images = torch.rand(3, 3, 64, 64)
    targets = [torch.tensor([[0.1, 0.1, 0.4, 0.5]]), torch.zeros(0, 4), torch.tensor([[0.5, 0.5, 0.9, 0.9], [0.0, 0.2, 0.3, 0.3]])]
    labels = [torch.tensor([1]), torch.zeros(0, dtype=torch.long), torch.tensor([0, 1])]
    with torch.no_grad():
        out = det(images)
    results = {}
    for mode in ("per_sample", "concat", "padded", "kernel"):
        det.config.loss = mode
        leaf = {k: v.clone().requires_grad_() for k, v in out.items()}  # grads w.r.t. the model's outputs
        parts = det.loss_components(leaf, targets, labels)
        parts["loss"].backward()
        results[mode] = ({k: v.item() for k, v in parts.items()}, leaf["boxes"].grad)
    ref_parts, ref_grad = results["concat"]
    for mode, (parts, grad) in results.items():
        for k in ref_parts:
            assert parts[k] == pytest.approx(ref_parts[k], rel=1e-6, abs=1e-7), (mode, k)  # summation order only
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7, msg=mode)  # closed form vs autograd


def test_zero_box_images_are_legal():
    det = tiny()
    out = det(torch.rand(2, 3, 64, 64))
    parts = det.loss_components(out, [torch.zeros(0, 4), torch.zeros(0, 4)])
    assert parts["loss_bbox"].item() == 0 and parts["loss_giou"].item() == 0
    assert torch.isfinite(parts["loss_ce"]) and parts["loss_ce"].item() > 0  # every query learns "no object"
    parts["loss"].backward()
    assert torch.isfinite(det.class_embed.weight.grad).all()


def _square_images(n, g):
    """Synthetic data: a bright square on noise; its box is the target."""
    images = torch.rand(n, 3, 64, 64, generator=g) * 0.2
    boxes = []
    for i in range(n):
        x, y = torch.randint(0, 40, (2,), generator=g).tolist()
        s = 16 + int(torch.randint(0, 8, (1,), generator=g))
        images[i, :, y : y + s, x : x + s] = 1.0
        boxes.append(torch.tensor([[x, y, x + s, y + s]], dtype=torch.float32) / 64)
    return images, boxes


def test_a_few_training_steps_lower_the_loss():
    g = torch.Generator().manual_seed(0)
    det = tiny(num_queries=4, loss="kernel")
    images, boxes = _square_images(4, g)
    opt = torch.optim.AdamW(det.parameters(), lr=2e-3)
    losses = []
    for _ in range(12):
        loss = det.loss(det(images), boxes)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses  # fitting 4 images: well below the start


def test_collated_targets_equal_the_list_form():
    g = torch.Generator().manual_seed(1)
    images, boxes = _square_images(3, g)
    boxes[1] = torch.zeros(0, 4)
    loader = torch.utils.data.DataLoader(list(zip(images, boxes)), batch_size=3, collate_fn=collate_detection)
    batch_images, tb = next(iter(loader))
    assert tb.counts == (1, 0, 1) and tb.padded.shape == (3, 1, 4) and tb.mask.tolist() == [[True], [False], [True]]
    assert all(torch.equal(a, b) for a, b in zip(tb.per_image(), boxes))
    det = tiny().eval()
    out = det(batch_images)
    assert det.loss(out, tb).item() == pytest.approx(det.loss(out, boxes).item(), rel=1e-6)


def test_backbone_loads_a_torchvision_resnet50():
    tv = torchvision.models.resnet50().eval()
    det = fastzoo.create("boxdet_r50", num_queries=4).eval()
    det.load_backbone(tv)  # fc dropped, everything else strict
    x = torch.rand(1, 3, 64, 64)
    ref = torch.nn.Sequential(*list(tv.children())[:-2])(x)
    assert (det.backbone.forward_features(x) - ref).abs().max().item() <= 1e-4  # DESIGN.md fp32 tolerance


def test_save_pretrained_round_trip(tmp_path):
    det = tiny(num_classes=2).eval()
    det.save_pretrained(tmp_path / "det")
    again = fastzoo.create("boxdet_r50", pretrained=tmp_path / "det").eval()
    x = torch.rand(1, 3, 64, 64)
    a, b = det(x), again(x)
    assert torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["logits"], b["logits"])


def test_bad_targets_and_options_raise():
    det = tiny(num_classes=2)
    out = det(torch.rand(2, 3, 64, 64))
    ok = torch.tensor([[0.1, 0.1, 0.5, 0.5]])
    cases = [
        ([ok, torch.tensor([[0.1, float("nan"), 0.5, 0.5]])], None, r"boxes\[1\]: box 0 is not finite"),
        ([ok, torch.tensor([[0.1, 0.1, float("inf"), 0.5]])], None, r"boxes\[1\]: box 0 is not finite"),
        ([torch.tensor([[0.6, 0.1, 0.5, 0.5]]), ok], None, r"boxes\[0\]: box 0 has x2 < x1"),
        ([ok, torch.zeros(1, 5)], None, r"boxes\[1\] must be an \[n, 4\] tensor"),
        ([ok], None, "targets has 1 images but the outputs have 2"),
        ([ok, ok], [torch.tensor([0]), torch.tensor([2])], r"labels must be class ids in \[0, 2\)"),
        ([ok, ok.repeat(7, 1)], None, "more than num_queries=6"),
    ]
    for targets, labels, match in cases:
        with pytest.raises(ValueError, match=match):
            det.loss(out, targets, labels)
    with pytest.raises(ValueError, match="loss='fused'"):
        tiny(loss="fused")
    with pytest.raises(ValueError, match="matcher="):
        tiny(matcher="greedy")
