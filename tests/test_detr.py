"""DETR against transformers' DetrForObjectDetection on the same weights: logits, boxes, every loss
term (auxiliary layers included) and every parameter gradient, with padded images of different
sizes, 0 to more-than-queries boxes per image, for every CPU attention backend with a backward and
every GIoU mode; checkpoints both ways (the older key names too); transformers' own tools on it."""
import pytest
import torch
from conftest import SPECS, backends
from detection_checks import backward
from detection_checks import boxes_labels as draw_labels

import fastzoo
from fastzoo.equivalence import draw_
from fastzoo.losses.set_prediction import GIOU_IMPLS, set_prediction_loss

TINY = dict(SPECS["detr"].tiny)
Q = TINY["num_queries"]
OUT_TOL = 1e-4  # fp32 rule: logits, boxes and losses, max abs difference
GRAD_TOL = 1e-4  # every gradient, max abs difference (gradients here are O(1e-2 .. 1))


# timm's ResNet-18 backbone in place of the tiny config's transformers ResNet (its sizes come from the name)
R18 = dict(use_timm_backbone=True, backbone="resnet18", embedding_size=None, hidden_sizes=None, depths=None)


def hf_detr(**overrides):
    """transformers' model at the tiny size, its weights drawn (``fastzoo.equivalence.draw_``), dropout off."""
    torch.manual_seed(0)
    hf = SPECS["detr"].original.build({**TINY, "dropout": 0.0, **overrides})
    draw_(hf, seed=1)
    return hf.train()


def boxes_labels(counts, seed=0):
    return draw_labels(counts, TINY["num_labels"], torch.Generator().manual_seed(seed))


def batch(seed=0):
    """3 images of different sizes padded to 64 x 80 (pixel_mask), with 2, 0 and 5 boxes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 3, 64, 80, generator=g)
    mask = torch.ones(3, 64, 80, dtype=torch.long)
    mask[1, :, 48:] = 0
    mask[2, 40:, :] = 0
    return x, mask, boxes_labels([2, 0, 5], seed=seed)


def compare(hf, ours, x, mask, labels):
    o1 = hf(pixel_values=x, pixel_mask=mask, labels=labels)
    o2 = ours(pixel_values=x, pixel_mask=mask, labels=labels)
    assert (o1.logits - o2.logits).abs().max() <= OUT_TOL
    assert (o1.pred_boxes - o2.pred_boxes).abs().max() <= OUT_TOL
    assert list(o1.loss_dict) == list(o2.loss_dict)
    for k in o1.loss_dict:
        assert abs(float(o1.loss_dict[k]) - float(o2.loss_dict[k])) <= OUT_TOL, k
    assert abs(float(o1.loss) - float(o2.loss)) <= OUT_TOL
    for a, b in zip(o1.auxiliary_outputs or [], o2.auxiliary_outputs or []):
        assert (a["logits"] - b["logits"]).abs().max() <= OUT_TOL
    g1, g2 = backward(hf, ours, o1.loss, o2.loss)
    assert set(g1) == set(g2) and len(g1) > 20
    worst = max(g1, key=lambda n: (g1[n] - g2[n]).abs().max())
    assert (g1[worst] - g2[worst]).abs().max() <= GRAD_TOL, worst
    return o2


@pytest.fixture(scope="module")
def hf_aux():
    return hf_detr(auxiliary_loss=True)


@pytest.mark.parametrize("attn", backends(backward=True), ids=lambda b: b[0] + "".join(f"-{v}" for v in b[1].values()))
def test_equal_to_transformers_for_every_backend(hf_aux, attn):
    """Padded images (the mask as key padding, or packed real tokens for varlen / nested), aux loss."""
    name, options = attn
    ours = fastzoo.create("detr", pretrained=hf_aux).set_attention(name, **options).train()
    compare(hf_aux, ours, *batch())


@pytest.mark.parametrize("mode", GIOU_IMPLS)
def test_equal_to_transformers_in_every_giou_mode(hf_aux, mode):
    ours = fastzoo.create("detr", pretrained=hf_aux, giou_impl=mode).train()
    compare(hf_aux, ours, *batch(seed=1))


def test_timm_backbone_path_equal_to_transformers():
    """The hub checkpoints' backbone: timm's ResNet-18 under transformers' timm path, unpadded batch."""
    hf = hf_detr(**R18)
    ours = fastzoo.create("detr", pretrained=hf).train()
    assert ours.config.use_timm_backbone and ours.config.backbone == "resnet18"
    x = torch.randn(2, 3, 64, 64)
    compare(hf, ours, x, torch.ones(2, 64, 64, dtype=torch.long), boxes_labels([1, 3]))


def test_frozen_backbone_parameters_are_transformers_choice_per_path():
    """transformers 5.17 freezes none of the timm backbone and all of its own ResNet backbone."""
    for overrides in ({}, R18):
        hf = hf_detr(**overrides)
        ours = fastzoo.create("detr", pretrained=hf)
        frozen = lambda m: {n for n, p in m.named_parameters() if not p.requires_grad}  # noqa: E731
        assert frozen(hf) == frozen(ours)
        assert bool(frozen(ours)) == (overrides == {})
    paper = fastzoo.create("detr", **TINY, freeze_backbone="stem_and_first_stage")
    trains = {n for n, p in paper.named_parameters() if p.requires_grad and "backbone" in n}
    assert trains and all(".stages.0." not in n and "embedder" not in n for n in trains)


def test_more_boxes_than_queries_and_all_images_empty_equal_transformers(hf_aux):
    ours = fastzoo.create("detr", pretrained=hf_aux).train()
    x, mask, _ = batch()
    compare(hf_aux, ours, x, mask, boxes_labels([Q + 3, 1, 0]))
    o1 = hf_aux(pixel_values=x, pixel_mask=mask, labels=boxes_labels([0, 0, 0]))
    o2 = ours(pixel_values=x, pixel_mask=mask, labels=boxes_labels([0, 0, 0]))
    assert abs(float(o1.loss) - float(o2.loss)) <= OUT_TOL


def test_older_checkpoint_key_names_load():
    """The hub's facebook/detr-resnet-50 names: backbone.conv_encoder, out_proj, a layer's fc1 / fc2."""
    hf = hf_detr()
    old = {}
    for k, v in hf.state_dict().items():
        k = k.replace("model.backbone.model.", "model.backbone.conv_encoder.model.").replace(".o_proj.", ".out_proj.")
        old[k.replace(".mlp.fc", ".fc")] = v
    assert any("conv_encoder" in k for k in old) and any(".out_proj." in k for k in old)
    ours = fastzoo.create("detr", pretrained=old, encoder_attention_heads=2, decoder_attention_heads=2)
    mine = ours.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in hf.state_dict().items())


def test_save_pretrained_round_trips_with_transformers(tmp_path):
    import transformers

    hf = hf_detr().eval()
    ours = fastzoo.create("detr", pretrained=hf).eval()
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.DetrForObjectDetection.from_pretrained(tmp_path / "ours").eval()
    hf.save_pretrained(tmp_path / "hf")
    again = fastzoo.create("detr", pretrained=tmp_path / "hf").eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = hf(pixel_values=x).logits
        assert (back(pixel_values=x).logits - ref).abs().max() <= OUT_TOL
        assert (again(pixel_values=x).logits - ref).abs().max() <= OUT_TOL


def test_image_processor_post_processes_the_output():
    from transformers import DetrImageProcessor

    hf = hf_detr().eval()
    ours = fastzoo.create("detr", pretrained=hf).eval()
    x = torch.randn(2, 3, 64, 64)
    proc = DetrImageProcessor()
    sizes = torch.tensor([[480, 640], [300, 200]])
    with torch.no_grad():
        r1 = proc.post_process_object_detection(hf(pixel_values=x), threshold=0.0, target_sizes=sizes)
        r2 = proc.post_process_object_detection(ours(pixel_values=x), threshold=0.0, target_sizes=sizes)
    for a, b in zip(r1, r2):
        assert a["labels"].tolist() == b["labels"].tolist()
        assert (a["boxes"] - b["boxes"]).abs().max() <= 1e-2  # pixels at 640 wide: 1e-4 x 640 / 4 margin


# -- the loss's errors ----------------------------------------------------------------------------
def _outputs(L=2, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, B, Q, TINY["num_labels"] + 1, generator=g), torch.rand(L, B, Q, 4, generator=g) * 0.5 + 0.25


def test_non_finite_cost_names_the_layer_and_the_image():
    logits, boxes = _outputs()
    boxes[0, 1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"auxiliary decoder layer 0 .*image 1"):
        set_prediction_loss(logits, boxes, boxes_labels([1, 2]), num_classes=TINY["num_labels"])


@pytest.mark.parametrize("bad, match", [
    (lambda lab: lab[1].update(boxes=lab[1]["boxes"] * torch.tensor([1, 1, -1, 1])), r"labels\[1\]\['boxes'\]\[0\]"),
    (lambda lab: lab[0]["boxes"].__setitem__((0, 0), float("inf")), r"labels\[0\]\['boxes'\]\[0\]"),
    (lambda lab: lab[1]["class_labels"].__setitem__(1, TINY["num_labels"]), r"labels\[1\]\['class_labels'\]\[1\]"),
    (lambda lab: lab[0].pop("boxes"), r"labels\[0\] must be a dict"),
    (lambda lab: lab[1].update(class_labels=lab[1]["class_labels"].float()), r"labels\[1\]\['class_labels'\]"),
    (lambda lab: lab.pop(), r"labels must be a list of 2"),
])
def test_malformed_labels_are_named_errors(bad, match):
    logits, boxes = _outputs()
    labels = boxes_labels([1, 2])
    bad(labels)
    with pytest.raises(ValueError, match=match):
        set_prediction_loss(logits, boxes, labels, num_classes=TINY["num_labels"])


def test_giou_modes_agree_on_loss_and_gradient():
    logits, boxes = _outputs(L=3, B=3)
    labels = boxes_labels([2, 0, Q + 2])
    results = []
    for mode in GIOU_IMPLS:
        b = boxes.clone().requires_grad_()
        loss, terms = set_prediction_loss(logits, b, labels, num_classes=TINY["num_labels"], giou_impl=mode)
        loss.backward()
        results.append((float(loss), b.grad))
    for loss, grad in results[1:]:
        assert abs(loss - results[0][0]) <= 1e-5 and (grad - results[0][1]).abs().max() <= 1e-6


def test_transformers_trainer_runs_a_step_with_the_guides_collate(tmp_path):
    """HF's object-detection guide: a dataset of {pixel_values, labels}, its collate_fn, Trainer."""
    import transformers

    ours = fastzoo.create("detr", **TINY)
    before = {n: p.detach().clone() for n, p in ours.named_parameters() if p.requires_grad}
    items = [{"pixel_values": torch.randn(3, 64, 64), "labels": lab} for lab in boxes_labels([1, 3, 0, 2])]

    def collate_fn(batch):  # the guide's
        data = {"pixel_values": torch.stack([x["pixel_values"] for x in batch])}
        data["labels"] = [x["labels"] for x in batch]
        return data

    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                          learning_rate=1e-3, report_to=[], remove_unused_columns=False,
                                          save_strategy="no", use_cpu=True, logging_steps=1)
    trainer = transformers.Trainer(model=ours, args=args, train_dataset=items, data_collator=collate_fn)
    result = trainer.train()
    assert result.global_step == 2 and result.training_loss > 0
    assert any(not torch.equal(before[n], p) for n, p in ours.named_parameters() if p.requires_grad)


# -- the benchmarks' claims, at tiny size -----------------------------------------------------------
@pytest.mark.parametrize("focal_alpha", [None, 0.25], ids=["detr", "deformable_detr"])
def test_set_loss_suite_equals_transformers_and_reads_the_host_once_per_step(focal_alpha):
    """transformers reads the device 5 times per layer (cost copy, 4 box checks) + once (box count):
    31 at 6 layers; fastzoo's padded modes once per step (the costs of all layers and the checks). DETR's
    softmax loss and Deformable DETR's focal one (against DeformableDetrForObjectDetectionLoss)."""
    from fastzoo.bench import run_suite
    from fastzoo.bench.set_loss import SetLossSetting, set_loss_suite

    suite = set_loss_suite(SetLossSetting("tiny", 3, queries=10, max_boxes=4, layers=6, num_classes=7,
                                          focal_alpha=focal_alpha))
    reads = suite.config["host reads per step"]
    assert reads["transformers"] == 6 * 5 + 1
    assert reads["fastzoo kernel"] == reads["fastzoo padded"] == 1
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    assert [r.status for r in report.rows] == ["ok"] * 5, [(r.label, r.status, r.max_err) for r in report.rows]


def test_detection_step_suite_checks_loss_and_gradients():
    from fastzoo.bench import run_suite
    from fastzoo.bench.detection import detection_step_suite
    from fastzoo.bench.recipes import BASELINE, Recipe

    suite = detection_step_suite("detr", config=TINY, images=2, sizes=((64, 64), (32, 48)),
                                 recipes=(BASELINE, Recipe("bf16 autocast", channels_last=True)))
    assert suite.config["host reads per step"]["fastzoo sdpa"] == 1
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    fp32, bf16 = ([r for r in report.rows if r.group.endswith(name)] for name in ("| fp32", "| bf16 autocast, channels_last"))
    assert [r.status for r in fp32] == ["ok"] * 4, [(r.label, r.status, r.max_err) for r in fp32]
    assert all(r.max_err <= OUT_TOL and r.grad_err <= GRAD_TOL for r in fp32[1:])  # fp32: the original's own rule
    # bf16 autocast: the original under it, on eager and on SDPA (its users' kernel), sets the bound (3x the worse
    # of their errors vs fp32), the fp32 peer is not gated
    assert [r.status for r in bf16] == ["ok"] * 6 and bf16[0].precision == "fp32" and bf16[0].max_err is None
    assert any("(sdpa)" in r.label and r.original for r in bf16)
    assert all(r.max_err <= r.out_bound and r.grad_err <= r.grad_bound for r in bf16[1:])


@pytest.mark.parametrize("part", ["rt_detr", "d_fine", "rf_detr"])
def test_set_loss_benchmarks_detector_step_parts_pass_their_gate_at_tiny_size(part):
    """benchmarks/set_loss.py's step part of each detector (its model, at the family's tiny config, 2 images of
    64x64 / 32x64, fastzoo's SDPA): the fp32 gate compares the loss and every gradient with the original's
    (RF-DETR's under fastzoo's names), and fastzoo's step reads the host fewer times than the original's."""
    import sys
    from pathlib import Path

    from fastzoo.bench import run_suite
    from fastzoo.bench.detection import detection_step_suite
    from fastzoo.registry import get_entry

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import set_loss

    model, config, _, _ = set_loss.STEPS[part]
    tiny = {**config, **get_entry(model).spec.tiny}
    suite = detection_step_suite(model, config=tiny, images=2, sizes=((64, 64), (32, 64)), backends=("sdpa",))
    reads = suite.config["host reads per step"]
    assert reads["fastzoo sdpa"] < reads["original"], reads
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    assert [r.status for r in report.rows] == ["ok", "ok"], [(r.label, r.status, r.max_err, r.grad_err) for r in report.rows]
    assert report.rows[1].grad_err is not None and report.rows[1].grad_err <= report.rows[1].grad_bound


def test_readme_detr_block_runs_as_written(tmp_path, monkeypatch):
    import transformers
    from test_docs import python_block

    monkeypatch.chdir(tmp_path)  # the block writes detr-out/
    x, mask, labels = batch()
    ns = {"fastzoo": fastzoo, "transformers": transformers, "hf_detr": hf_detr(), "pixel_values": x, "pixel_mask": mask,
          "labels": labels, "sizes": torch.tensor([[64, 80]] * 3)}
    exec(python_block("### DETR: transformers' DetrForObjectDetection"), ns)
    assert len(ns["results"]) == 3 and torch.isfinite(ns["out"].loss)
    assert ns["det"].attn_name == "varlen" and ns["det"].packs()
    assert transformers.DetrForObjectDetection.from_pretrained(tmp_path / "detr-out").config.num_labels == TINY["num_labels"]
    assert ns["pets"].config.id2label == {0: "cat", 1: "dog"} and ns["pets"].class_labels_classifier.out_features == 3


def test_peer_suite_swap_builds_fastzoo_detr_from_the_testers_config():
    """benchmarks/peer_suites/swap_hf_detr.py: transformers' test config (its ResNet backbone with
    widths not divisible by 4, gelu) -> fastzoo's DETR, equal to transformers' model on its weights."""
    import sys
    from pathlib import Path

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peer_suites"))
    import swap_hf_detr

    resnet = transformers.ResNetConfig(hidden_sizes=[10, 20, 30, 40], depths=[1, 1, 2, 1], out_features=["stage4"])
    cfg = transformers.DetrConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=8,
                                  decoder_attention_heads=8, encoder_ffn_dim=4, decoder_ffn_dim=4, num_queries=12,
                                  activation_function="gelu", use_timm_backbone=False, backbone_config=resnet,
                                  use_pretrained_backbone=False, dropout=0.0)
    hf = transformers.DetrForObjectDetection(cfg).eval()
    ours = swap_hf_detr.FastzooDetrForObjectDetection(cfg).eval()
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (hf(pixel_values=x).logits - ours(pixel_values=x).logits).abs().max() <= OUT_TOL
