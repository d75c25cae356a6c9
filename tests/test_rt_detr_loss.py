"""RT-DETR's set loss (``fastzoo.losses.set_prediction.rt_detr_loss``) against transformers'
``RTDetrForObjectDetectionLoss`` on the same drawn predictions and labels: every ``loss_dict`` term (varifocal,
L1, GIoU of the last layer, the auxiliary layers, the encoder's proposals, the denoising groups), the total, and
the gradients with respect to every logit and box, in fp32, for each ``giou_impl``; one host read per step; bad
input refused by name."""
import pytest
import torch
from detection_checks import boxes_labels
from transformers import RTDetrConfig
from transformers.loss.loss_rt_detr import RTDetrForObjectDetectionLoss
from transformers.models.rt_detr.modeling_rt_detr import get_contrastive_denoising_training_group

from fastzoo.losses.set_prediction import GIOU_IMPLS, rt_detr_loss

L, Q, C = 3, 10, 6
LOSS_TOL = 2e-5  # fp32: every term and the total are sums of O(100) products of O(1) values, summed in another order
GRAD_TOL = 1e-6  # fp32: gradients are O(1e-3 .. 1e-1) (each term divided by the box count)


def draw(counts, denoising: bool, seed=0):
    """Predictions as RT-DETR's decoder gives them (with the denoising queries first when training) and the
    denoising metadata of transformers' own group builder on these labels (its RNG seeded)."""
    labels = boxes_labels(counts, C, torch.Generator().manual_seed(seed))
    meta = None
    if denoising:
        torch.manual_seed(seed)
        _, _, _, meta = get_contrastive_denoising_training_group(
            labels, C, Q, torch.nn.Embedding(C + 1, 8), num_denoising_queries=12, label_noise_ratio=0.5,
            box_noise_scale=1.0)
    DN = meta["dn_num_split"][0] if meta else 0
    g = torch.Generator().manual_seed(seed + 1)
    B = len(counts)
    outputs = dict(logits=torch.randn(L, B, DN + Q, C, generator=g) * 2, raw=torch.randn(L, B, DN + Q, 4, generator=g),
                   enc_logits=torch.randn(B, Q, C, generator=g) * 2, enc_raw=torch.randn(B, Q, 4, generator=g))
    return outputs, labels, meta


def config(**overrides):
    cfg = RTDetrConfig(num_labels=C, **{k: v for k, v in overrides.items() if k != "giou_impl"})
    cfg.giou_impl = overrides.get("giou_impl", "kernel")
    return cfg


def run(fn, outputs, labels, meta, cfg):
    """loss, loss_dict and the gradients wrt logits, boxes (pre-sigmoid), encoder logits and boxes."""
    leaves = {k: v.clone().requires_grad_() for k, v in outputs.items()}
    logits, boxes = leaves["logits"], leaves["raw"].sigmoid()
    enc_logits, enc_boxes = leaves["enc_logits"], leaves["enc_raw"].sigmoid()
    if fn == "transformers":
        loss, loss_dict, _ = RTDetrForObjectDetectionLoss(
            logits[-1], labels, "cpu", boxes[-1], cfg, logits.transpose(0, 1), boxes.transpose(0, 1),
            enc_topk_logits=enc_logits, enc_topk_bboxes=enc_boxes, denoising_meta_values=meta)
    else:
        loss, loss_dict = rt_detr_loss(logits, boxes, labels, cfg, enc_topk_logits=enc_logits, enc_topk_bboxes=enc_boxes,
                                       denoising_meta_values=meta)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return loss.detach(), {k: v.detach() for k, v in loss_dict.items()}, dict(zip(leaves, grads))


def assert_equal_to_transformers(outputs, labels, meta, cfg):
    loss0, terms0, grads0 = run("transformers", outputs, labels, meta, cfg)
    loss1, terms1, grads1 = run("fastzoo", outputs, labels, meta, cfg)
    assert list(terms1) == list(terms0)  # transformers' keys, in its order
    for k in terms0:
        assert abs(float(terms1[k]) - float(terms0[k])) <= LOSS_TOL, (k, float(terms1[k]), float(terms0[k]))
    assert abs(float(loss1) - float(loss0)) <= LOSS_TOL * len(terms0)
    for k, g0 in grads0.items():
        if g0 is None:  # transformers' graph does not reach it (the encoder without auxiliary_loss)
            assert grads1[k] is None or not grads1[k].any(), k
            continue
        assert (grads1[k] - g0).abs().max() <= GRAD_TOL, (k, float((grads1[k] - g0).abs().max()))
    return terms0


@pytest.mark.parametrize("giou_impl", list(GIOU_IMPLS))
@pytest.mark.parametrize("denoising", [False, True], ids=["eval", "train-denoising"])
def test_equal_to_transformers(giou_impl, denoising):
    """Images with 2, 0 and 5 boxes; 3 decoder layers + the encoder's proposals (+ 2 denoising groups)."""
    outputs, labels, meta = draw([2, 0, 5], denoising)
    terms = assert_equal_to_transformers(outputs, labels, meta, config(giou_impl=giou_impl))
    assert len(terms) == 3 * (L + 1 + L * denoising)
    if denoising:
        assert meta["dn_num_group"] == 2 and any(k.endswith("_dn_0") for k in terms)


@pytest.mark.parametrize("overrides", [
    dict(auxiliary_loss=False), dict(use_focal_loss=False), dict(matcher_alpha=0.4, matcher_gamma=1.5),
    dict(focal_loss_alpha=0.5, focal_loss_gamma=1.0, weight_loss_vfl=2.0, weight_loss_bbox=3.0, weight_loss_giou=0.5),
], ids=["no-aux", "softmax-matcher", "matcher-focal-constants", "loss-constants"])
def test_declared_parts_equal_transformers(overrides):
    """The config's parts: no auxiliary terms, the softmax matching cost, the matcher's and the loss's constants."""
    outputs, labels, meta = draw([3, 1], denoising=True, seed=3)
    assert_equal_to_transformers(outputs, labels, meta, config(**overrides))


def test_more_boxes_than_queries_and_no_boxes_equal_transformers():
    """An image with more boxes than queries (Q of them matched; the denoising groups hold them all) beside an
    empty one; and a batch without any box (no denoising groups then: transformers' builder returns none)."""
    outputs, labels, meta = draw([Q + 3, 0], denoising=True, seed=5)
    assert_equal_to_transformers(outputs, labels, meta, config())
    outputs, labels, meta = draw([0, 0], denoising=True, seed=6)
    assert meta is None
    assert_equal_to_transformers(outputs, labels, meta, config())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_within_the_low_precision_rule(dtype):
    """Low-precision predictions under CPU autocast (what an autocast forward gives): against the fp32 loss on the
    same values, fastzoo's every term, total and gradient within 3x transformers' own error under the same autocast
    (the equivalence rule's low-precision bound), plus a floor of fp32 rounding for the terms both get exactly."""
    outputs, labels, meta = draw([2, 0, 5], denoising=True)
    low = {k: v.to(dtype) for k, v in outputs.items()}
    cfg = config()
    loss32, terms32, grads32 = run("transformers", {k: v.float() for k, v in low.items()}, labels, meta, cfg)
    with torch.autocast("cpu", dtype=dtype):
        loss_hf, terms_hf, grads_hf = run("transformers", low, labels, meta, cfg)
        loss_fz, terms_fz, grads_fz = run("fastzoo", low, labels, meta, cfg)
    assert loss_fz.dtype == torch.float32  # the terms accumulate in fp32, as transformers' under autocast
    for k in terms32:
        bound = 3 * abs(float(terms_hf[k]) - float(terms32[k])) + LOSS_TOL
        assert abs(float(terms_fz[k]) - float(terms32[k])) <= bound, k
    assert abs(float(loss_fz) - float(loss32)) <= 3 * abs(float(loss_hf) - float(loss32)) + LOSS_TOL * len(terms32)
    for k, g32 in grads32.items():
        bound = 3 * (grads_hf[k].float() - g32).abs().max() + GRAD_TOL
        assert (grads_fz[k].float() - g32).abs().max() <= bound, k


def test_one_host_read_per_step():
    """transformers reads the device per matched layer (the cost copy, the matcher's box checks) and for the box
    count; here every Hungarian-matched layer's cost and the label checks come back together, the denoising
    groups are matched by index."""
    from fastzoo.bench.set_loss import host_reads

    outputs, labels, meta = draw([2, 0, 5], denoising=True)
    cfg = config()
    assert host_reads(lambda: run("fastzoo", outputs, labels, meta, cfg)) == 1
    assert host_reads(lambda: run("transformers", outputs, labels, meta, cfg)) > L + 1


def test_rt_detr_suite_equals_transformers_and_reads_the_host_once_per_step():
    """The benchmark's claim at tiny size: each giou_impl equal to transformers (loss and every gradient, the
    harness's fp32 rule); the padded modes read the host once, transformers 5 times per Hungarian-matched layer
    (the cost copy, 4 box checks; 3 decoder layers and the encoder here), twice per denoising layer (the GIoU's box
    checks) and once for the box count."""
    from fastzoo.bench import run_suite
    from fastzoo.bench.set_loss import RTDetrLossSetting, rt_detr_suite

    suite = rt_detr_suite(RTDetrLossSetting("tiny", 3, queries=10, max_boxes=4, layers=3, num_classes=7, num_denoising=8))
    reads = suite.config["host reads per step"]
    assert reads["fastzoo kernel"] == reads["fastzoo padded"] == 1 and reads["transformers"] == (L + 1) * 5 + L * 2 + 1
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    assert [r.status for r in report.rows] == ["ok"] * 5, [(r.label, r.status, r.max_err) for r in report.rows]


def _call(outputs, labels, meta, cfg, change=None):
    args = dict(logits=outputs["logits"], boxes=outputs["raw"].sigmoid(), enc_topk_logits=outputs["enc_logits"],
                enc_topk_bboxes=outputs["enc_raw"].sigmoid(), denoising_meta_values=meta, config=cfg, labels=labels)
    args.update(change or {})
    return rt_detr_loss(args.pop("logits"), args.pop("boxes"), args.pop("labels"), args.pop("config"), **args)


def _bad_split(meta):
    return {**meta, "dn_num_split": [meta["dn_num_split"][0] - 2, meta["dn_num_split"][1] + 2]}


@pytest.mark.parametrize("change, match", [
    (lambda o, m: dict(enc_topk_logits=None), r"enc_topk_logits and enc_topk_bboxes must be \[2, 10, 6\]"),
    (lambda o, m: dict(enc_topk_bboxes=o["enc_raw"][:, :4].sigmoid()), "enc_topk_logits and enc_topk_bboxes"),
    (lambda o, m: dict(logits=o["logits"][..., :-1]), "logits have 5 classes; num_labels=6"),
    (lambda o, m: dict(boxes=o["raw"][..., :3]), r"logits must be \[L, B, Q, C\] and boxes \[L, B, Q, 4\]"),
    (lambda o, m: dict(denoising_meta_values={"dn_num_group": 2}), "denoising_meta_values must be transformers' dict"),
    (lambda o, m: dict(denoising_meta_values=_bad_split(m)), r"denoising_meta_values\['dn_num_split'\]"),
    (lambda o, m: dict(denoising_meta_values={**m, "dn_positive_idx": m["dn_positive_idx"][::-1]}),
     r"denoising_meta_values\['dn_positive_idx'\] has \[4, 12\] positives"),
    (lambda o, m: dict(labels=[{"class_labels": torch.tensor([0, 1, 2]), "boxes": torch.rand(3, 4)}]),
     "labels must be a list of 2 dicts"),
    (lambda o, m: dict(config=config(giou_impl="fused")), "giou_impl='fused': choose one of"),
    (lambda o, m: dict(config=config(matcher_class_cost=0.0, matcher_bbox_cost=0.0, matcher_giou_cost=0.0)),
     "matcher_class_cost, matcher_bbox_cost and matcher_giou_cost are all 0"),
    (lambda o, m: dict(config=object()), "config lacks RT-DETR's loss fields num_labels"),
])
def test_bad_input_is_refused_by_name(change, match):
    outputs, labels, meta = draw([3, 1], denoising=True)
    with pytest.raises(ValueError, match=match):
        _call(outputs, labels, meta, config(), change(outputs, meta))


def test_non_finite_encoder_proposals_are_named():
    outputs, labels, meta = draw([3, 1], denoising=False)
    outputs["enc_raw"][1, 4, 0] = float("nan")
    with pytest.raises(ValueError, match=r"encoder's top-k proposals .*image 1, is not finite"):
        _call(outputs, labels, meta, config())
