"""Box detector: outputs, the two matchers on a hand-checked case, the four GIoU loss
modes giving the same loss and gradients, zero-box images, training lowers the loss,
collation, backbone loading, and bad targets."""
import pytest
import torch
import torchvision
from conftest import TINY

import fastzoo
from fastzoo.data.boxes import collate_boxes, collate_detection
from fastzoo.losses.giou import generalized_box_iou

QUERIES = TINY["boxdet"]["num_queries"]


def tiny(**kw):
    return fastzoo.create("boxdet_r50", **{**TINY["boxdet"], **kw})


def test_outputs_are_valid_boxes_and_logits():
    det = tiny(num_classes=3)
    out = det(torch.rand(2, 3, 64, 64))
    b = out["boxes"]
    assert b.shape == (2, QUERIES, 4) and out["logits"].shape == (2, QUERIES, 4)  # C + 1 logits
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


def test_batched_matcher_equals_matching_each_image_alone():
    """The matcher builds each image's cost against its own boxes in one padded [B, Q, M] tensor
    (one host copy per batch); the assignment is the one each image gets when matched alone
    (DETR's per-image cost, scipy on it), whatever the other images hold."""
    from scipy.optimize import linear_sum_assignment

    g = torch.Generator().manual_seed(5)
    counts = (3, 0, 6, 1)
    boxes = torch.cat([(xy := torch.rand(4, 6, 2, generator=g)) * 0.6, xy * 0.6 + 0.3], -1)
    outputs = {"boxes": boxes, "logits": torch.randn(4, 6, 3, generator=g)}
    targets = [torch.cat([(t := torch.rand(n, 2, generator=g) * 0.5), t + 0.2], -1) for n in counts]
    labels = [torch.randint(0, 2, (n,), generator=g) for n in counts]
    tb = collate_boxes(targets, labels)
    det = tiny(num_queries=6, num_classes=2)
    expected = []
    for b, (t, lab) in enumerate(zip(targets, labels)):
        cost = (5 * torch.cdist(boxes[b], t, p=1) - outputs["logits"][b].softmax(-1)[:, lab]
                - 2 * generalized_box_iou(boxes[b], t))  # [Q, n_b], DETR's default weights
        rows, cols = linear_sum_assignment(cost.numpy())
        expected += rows[cols.argsort()].tolist()
    assert det.match(outputs, tb).tolist() == expected


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
    assert (det.backbone.forward_features(x) - ref).abs().max().item() <= 1e-4  # fastzoo.equivalence's fp32 tolerance


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
        ([ok, ok.repeat(QUERIES + 1, 1)], None, f"more than num_queries={QUERIES}"),
    ]
    for targets, labels, match in cases:
        with pytest.raises(ValueError, match=match):
            det.loss(out, targets, labels)
    with pytest.raises(ValueError, match="loss='fused'"):
        tiny(loss="fused")
    with pytest.raises(ValueError, match="matcher="):
        tiny(matcher="greedy")


# -- the same function on 1 or N processes ------------------------------------------------
def _batch_with_empty_image():
    g = torch.Generator().manual_seed(5)
    images, boxes = _square_images(4, g)
    boxes[2] = torch.zeros(0, 4)
    boxes[3] = torch.cat([boxes[3], torch.tensor([[0.1, 0.1, 0.2, 0.3]])])
    boxes[0] = torch.cat([boxes[0], torch.tensor([[0.6, 0.1, 0.9, 0.2]]), torch.tensor([[0.0, 0.5, 0.3, 0.9]])])
    labels = [torch.randint(0, 2, (len(b),), generator=g) for b in boxes]
    return images, boxes, labels


def test_default_normalisation_is_detrs():
    """Class CE is F.cross_entropy's weighted mean (weights 1, no object eos_coef); L1 / GIoU per box."""
    det = tiny(num_classes=2, matcher="order").eval()
    images, boxes, labels = _batch_with_empty_image()
    out = det(images)
    parts = det.loss_components(out, boxes, labels)
    tb = collate_boxes(boxes, labels)
    target = torch.full((4, QUERIES), 2)
    target[tb.batch_index, tb.slot] = tb.labels
    ce = torch.nn.functional.cross_entropy(out["logits"].transpose(1, 2), target, torch.tensor([1.0, 1.0, 0.1]))
    assert parts["loss_ce"].item() == pytest.approx(ce.item(), rel=1e-6)  # sum order only
    l1 = (out["boxes"][tb.batch_index, tb.slot] - tb.boxes).abs().sum() / tb.num_boxes
    assert parts["loss_bbox"].item() == pytest.approx(l1.item(), rel=1e-6)


def test_shares_with_global_counts_add_up_to_the_whole_batch_loss():
    """What two processes compute (each its half, normalised by the all-reduced image and box
    counts) sums to one process's loss on the whole batch, gradients included; with the
    backbone BN frozen (the default) each image's outputs do not depend on its batch-mates
    even in train mode. The halves hold 4 and 2 boxes (the old per-process normalisation
    was off here)."""
    torch.manual_seed(0)
    det = tiny(num_classes=2).train()
    assert det.config.frozen_bn and not det.backbone.bn1.training
    images, boxes, labels = _batch_with_empty_image()
    whole = det(images)
    halves = [det(images[:2]), det(images[2:])]
    for k in whole:  # same program per image, batch size differs: conv kernels may sum differently
        torch.testing.assert_close(torch.cat([h[k] for h in halves]), whole[k], rtol=1e-5, atol=1e-6)
    params = [p for p in det.parameters() if p.requires_grad]
    ref = det.loss(whole, boxes, labels)
    g_ref = torch.autograd.grad(ref, params)
    n_img, n_box = torch.tensor(4.0), torch.tensor(float(sum(len(b) for b in boxes)))
    shares = [det.loss(h, boxes[i:i + 2], labels[i:i + 2], num_images=n_img, num_boxes=n_box)
              for h, i in zip(halves, (0, 2))]
    assert sum(shares).item() == pytest.approx(ref.item(), rel=1e-5)  # fp32 sum order
    g = torch.autograd.grad(sum(shares), params)
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(g, g_ref))
    assert worst <= 1e-4  # relative, per tensor: fp32 reassociation in convs of batch 2 vs 4
    # the old normalisation (each half by its own boxes and images) is a different function
    local = [det.loss(h, boxes[i:i + 2], labels[i:i + 2]) for h, i in zip(halves, (0, 2))]
    assert abs(sum(local).item() / 2 - ref.item()) > 1e-3


def test_backbone_bn_trains_when_not_frozen():
    det = tiny(frozen_bn=False).train()
    assert det.backbone.bn1.training and det.backbone.bn1.weight.requires_grad
    before = det.backbone.bn1.running_mean.clone()
    det(torch.rand(2, 3, 64, 64))
    assert not torch.equal(det.backbone.bn1.running_mean, before)


def test_collator_checks_labels_once_and_the_loss_trusts_it():
    det = tiny(num_classes=2)
    ok = torch.tensor([[0.1, 0.1, 0.5, 0.5]])
    batch = [(torch.rand(3, 64, 64), ok, torch.tensor([1])), (torch.rand(3, 64, 64), ok, torch.tensor([0]))]
    images, tb = collate_detection(batch, num_classes=2)
    assert tb.checked_classes == 2 and tb.to("cpu").checked_classes == 2
    det.loss(det(images), tb)
    with pytest.raises(ValueError, match=r"labels must be class ids in \[0, 2\)"):
        collate_detection([batch[0], (batch[1][0], ok, torch.tensor([2]))], num_classes=2)
    unchecked = collate_boxes([ok, ok], [torch.tensor([0]), torch.tensor([5])])  # no num_classes: the loss checks
    with pytest.raises(ValueError, match=r"labels must be class ids in \[0, 2\)"):
        det.loss(det(images), unchecked)


def test_a_resnet_checkpoint_is_refused_as_a_whole_detector(tmp_path):
    backbone = {k: TINY["boxdet"][k] for k in ("layers", "channels")}  # the tiny detector's ResNet
    resnet = fastzoo.create("resnet50", **backbone)
    torch.save(fastzoo.export_state_dict(resnet, "torchvision"), tmp_path / "r50.pth")
    with pytest.raises(fastzoo.errors.CheckpointError, match=r"ResNet checkpoint.*det.load_backbone\(source\)"):
        fastzoo.create("boxdet_r50", pretrained=tmp_path / "r50.pth")
    det = tiny(num_classes=3)
    with pytest.raises(fastzoo.errors.CheckpointError, match="ResNet checkpoint"):
        fastzoo.load_pretrained(det, tmp_path / "r50.pth")
    det.load_backbone(tmp_path / "r50.pth")  # the way that works
    assert torch.equal(det.backbone.conv1.weight, resnet.conv1.weight)
    torch.save(det.state_dict(), tmp_path / "det.pth")  # a plain state dict file of a detector loads whole
    again = fastzoo.create("boxdet_r50", pretrained=tmp_path / "det.pth")
    assert again.config.num_classes == 3 and again.config.num_queries == QUERIES
    assert again.config.hidden_dim == TINY["boxdet"]["hidden_dim"]
    assert all(torch.equal(v, det.state_dict()[k]) for k, v in again.state_dict().items())


ISSUE_SNIPPET = """
import sys
import fastzoo

kernels = [m for m in sys.modules if m.split(".")[0] in ("triton", "flash_attn", "xformers", "transformer_engine", "neuronxcc")]
import torch, torchvision  # torchvision itself imports triton where it is installed: after the check
torch.save(torchvision.models.resnet50().state_dict(), sys.argv[1])
r = fastzoo.create("resnet50", pretrained=sys.argv[1], channels_last=True)
det = fastzoo.create("boxdet_r50", num_queries=100, loss="kernel")
images = torch.rand(2, 3, 64, 64)
targets = [torch.tensor([[0.1, 0.2, 0.5, 0.6]]), torch.zeros(0, 4)]   # n_i = 0 for the second image
out = det(images)
loss = det.loss(out, targets)
loss.backward()
pred, target = out["boxes"][0, :1].detach(), targets[0]
g = fastzoo.losses.giou_loss(pred, target, reduction="mean", impl="kernel")
assert torch.isfinite(loss) and torch.isfinite(g), (loss, g)
images2, tb = fastzoo.data.boxes.collate_detection([(images[0], targets[0]), (images[1], targets[1])])
assert tb.counts == (1, 0)
assert "fastzoo.train" not in sys.modules  # loaded on first use only
assert callable(fastzoo.train.train)
print("ok", kernels)
"""


def test_user_snippet_after_a_bare_import_fastzoo(tmp_path):
    """The losses / boxes / train code as a user runs it: only ``import fastzoo``, then fastzoo.losses,
    fastzoo.data.boxes and fastzoo.train as attributes (a fresh interpreter: other tests'
    imports cannot hide a missing one); ``import fastzoo`` imports no kernel library."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", ISSUE_SNIPPET, str(tmp_path / "r50.pth")], cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok []", proc.stdout


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (each a device sync on a GPU):
    ``_local_scalar_dense`` (``bool()``, ``int()``, ``.item()``) and ``nonzero`` (data-sized output)."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss", ["per_sample", "concat", "padded", "kernel"])
@pytest.mark.parametrize("matcher", ["order", "hungarian"])
def test_loss_on_a_list_of_targets_reads_the_device_once(loss, matcher):
    """Boxes finite and upright, normalised (not pixels), labels in range: one reduction, one
    host read for the batch (the Hungarian matcher's cost copy is a `.cpu()`, not counted: it
    is the matcher's one transfer). A collated BoxTargets (checked on the CPU) needs none. The
    loss equals the collated path's."""
    torch.manual_seed(0)
    det = tiny(num_classes=3, loss=loss, matcher=matcher)
    out = det(torch.rand(2, 3, 64, 64))
    targets = [torch.tensor([[0.1, 0.1, 0.5, 0.5]]), torch.tensor([[0.2, 0.2, 0.4, 0.9], [0.0, 0.0, 1.0, 1.0]])]
    labels = [torch.tensor([1]), torch.tensor([0, 2])]
    with _HostReads() as reads:
        from_list = det.loss(out, targets, labels)
    assert reads.count == 1
    collated = collate_boxes(targets, labels, num_classes=3)
    with _HostReads() as reads:
        from_collated = det.loss(out, collated)
    assert reads.count == 0
    assert torch.equal(from_list, from_collated)


@pytest.mark.parametrize("targets, labels, match", [
    ([torch.tensor([[0.1, 0.1, float("nan"), 0.5]])], None, r"boxes\[0\]: box 0 is not finite"),
    ([torch.tensor([[0.5, 0.1, 0.1, 0.5]])], None, r"boxes\[0\]: box 0 has x2 < x1"),
    ([torch.tensor([[10.0, 10.0, 50.0, 50.0]])], None, r"boxes reach 50.*normalised to \[0, 1\]"),
    ([torch.tensor([[0.1, 0.1, 0.5, 0.5]])], [torch.tensor([3])], r"labels must be class ids in \[0, 3\)"),
])
def test_each_check_of_the_one_read_still_names_its_problem(targets, labels, match):
    det = tiny(num_classes=3, num_queries=2)
    out = det(torch.rand(1, 3, 64, 64))
    with pytest.raises(ValueError, match=match):
        det.loss(out, targets, labels)
