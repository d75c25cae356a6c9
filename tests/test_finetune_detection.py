"""The detection fine-tune script and the COCO loader, as a user runs them: a tiny COCO-format set
(digits on a canvas, written here as PNGs and an instances JSON with non-contiguous category ids),
a tiny transformers DETR as the checkpoint, a few steps on CPU.

Checked: the categories become the labels (``id2label`` in the checkpoint, the class head sized
from the data), COCO mAP is reported on the validation set, the checkpoint is read by transformers'
``DetrForObjectDetection.from_pretrained`` and computes fastzoo's logits, each documented recipe
(the script's --help examples, the README's run file) runs at tiny size, bad input is one line and
exit status 2."""
import json
from pathlib import Path

import pytest
import torch
from test_train_scripts import COMMON, DETR_SIZES, _main, ok, run, train_losses, user_error

import fastzoo
from fastzoo.data.boxes import CocoDetection, collate_detection, read_coco

ROOT = Path(__file__).resolve().parents[1]
CATEGORY = {d: 10 + 3 * d for d in range(10)}  # digit -> COCO category id: sparse, not starting at 0
SIDE = 48


def write_coco(root: Path, canvases, name: str) -> tuple[Path, Path]:
    """``canvases`` (``fastzoo.accuracy.data.Canvases``) as COCO: ``root/name/<i>.png`` and
    ``root/name.json``; categories in reverse id order (the loader sorts them)."""
    from PIL import Image

    images, anns = [], []
    (root / name).mkdir(parents=True)
    for i, (img, boxes, labels) in enumerate(zip(canvases.images, canvases.boxes, canvases.labels)):
        pixels = ((img * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(root / name / f"{i}.png")
        images.append({"id": 100 + i, "file_name": f"{i}.png", "width": SIDE, "height": SIDE})
        for (x0, y0, x1, y1), c in zip((boxes * SIDE).tolist(), labels.tolist()):
            anns.append({"id": len(anns) + 1, "image_id": 100 + i, "category_id": CATEGORY[c], "iscrowd": 0,
                         "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0)})
    cats = [{"id": CATEGORY[d], "name": f"digit {d}"} for d in reversed(range(10))]
    ann = root / f"{name}.json"
    ann.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root / name, ann


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    from fastzoo.accuracy.data import digits_canvas

    root = tmp_path_factory.mktemp("coco")
    train, val = digits_canvas(8, 4, canvas=SIDE, digit_px=(12, 20), seed=0)
    return (*write_coco(root, train, "train"), *write_coco(root, val, "val"))


@pytest.fixture(scope="module")
def hf_detr(tmp_path_factory):
    """A tiny transformers DETR (5 labels) as a save_pretrained directory."""
    from fastzoo.models.detr.spec import TINY, build_original

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "detr"
    build_original(dict(TINY)).save_pretrained(path)
    return path


def test_coco_loader_keeps_the_categories(coco):
    train_images, train_ann, _, _ = coco
    raw = json.loads(train_ann.read_text())
    images, targets, id2label = read_coco(train_ann)
    assert id2label == {d: f"digit {d}" for d in range(10)}  # ids 10, 13 ... 37 in order -> 0..9
    for im in images:  # every annotation kept with its class: label = the digit, box = COCO's bbox as cxcywh
        anns = [a for a in raw["annotations"] if a["image_id"] == im["id"]]
        t = targets[im["id"]]
        assert t["class_labels"].tolist() == [(a["category_id"] - 10) // 3 for a in anns]
        x, y, w, h = anns[0]["bbox"]
        assert t["boxes"][0].tolist() == pytest.approx([(x + w / 2) / SIDE, (y + h / 2) / SIDE, w / SIDE, h / SIDE])
    # transformers' DetrImageProcessor convention: the id is the label; ids without a category are "N/A"
    _, targets_id, by_id = read_coco(train_ann, label_ids="category_id")
    assert len(by_id) == 38 and by_id[10] == "digit 0" and by_id[37] == "digit 9" and by_id[0] == "N/A"
    first = images[0]["id"]
    assert targets_id[first]["class_labels"].tolist() == [10 + 3 * c for c in targets[first]["class_labels"].tolist()]
    # images of different sizes pad to the largest, the mask marks each image's pixels
    ds = CocoDetection(train_images, train_ann, shortest_edge=32, longest_edge=40)
    batch = collate_detection([ds[0], ds[1]])
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and batch["pixel_mask"].all()
    assert batch["labels"][0]["orig_size"].tolist() == [SIDE, SIDE]
    assert torch.equal(batch["labels"][1]["class_labels"], targets[images[1]["id"]]["class_labels"])


def test_crowd_and_empty_boxes_are_skipped_and_boxes_clipped(tmp_path):
    ann = tmp_path / "a.json"
    ann.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "x.png", "width": 100, "height": 50}],
        "categories": [{"id": 7, "name": "cat"}],
        "annotations": [{"image_id": 1, "category_id": 7, "bbox": [90, 0, 20, 10]},  # clipped at x = 100
                        {"image_id": 1, "category_id": 7, "bbox": [0, 0, 10, 10], "iscrowd": 1},
                        {"image_id": 1, "category_id": 7, "bbox": [5, 5, 0, 10]}]}))
    _, targets, id2label = read_coco(ann)
    assert id2label == {0: "cat"} and targets[1]["class_labels"].tolist() == [0]
    assert targets[1]["boxes"].tolist() == [pytest.approx([0.95, 0.1, 0.1, 0.2])]


def test_finetune_from_a_transformers_checkpoint_on_coco(coco, hf_detr, tmp_path):
    """The --help example at tiny size: a transformers save_pretrained directory (5 labels) on the
    COCO set (10 categories): a fresh 10-label head, the frozen backbone as the checkpoint's, COCO
    mAP on the validation set, and a checkpoint transformers reads and computes fastzoo's logits with."""
    from transformers import DetrForObjectDetection

    train_images, train_ann, val_images, val_ann = coco
    out = tmp_path / "run"
    ok(run("finetune_detection.py", "--model", "facebook/detr-resnet-50", "--pretrained", hf_detr,
           "--train-images", train_images, "--train-ann", train_ann, "--val-images", val_images, "--val-ann", val_ann,
           "--img-size", 40, "--max-size", 48, "-b", 4, "--lr", "1e-4", "--epochs", 1, "--amp", "bf16",
           "--workers", 0, "--log-interval", 1, "--output-dir", out))
    losses = train_losses(out)
    assert sorted(losses) == [1, 2] and all(0 < v < 100 for v in losses.values()), losses
    evals = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "eval_map" in r]
    assert evals and all(0.0 <= evals[-1][k] <= 1.0 for k in ("eval_map", "eval_map_50", "eval_map_75")), evals
    assert evals[-1]["eval_loss"] > 0
    ckpt = out / "checkpoint-2"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["id2label"] == {str(d): f"digit {d}" for d in range(10)}  # num_labels = len(id2label), as transformers writes it
    theirs = DetrForObjectDetection.from_pretrained(ckpt).eval()
    assert theirs.config.id2label[3] == "digit 3"
    ours = fastzoo.create(pretrained=ckpt, attn="eager").eval()
    start = DetrForObjectDetection.from_pretrained(hf_detr)
    # transformers' own ResNet backbone is frozen (as transformers builds it): the checkpoint's, unchanged
    assert all(torch.equal(p, start.state_dict()[k]) for k, p in theirs.state_dict().items() if ".backbone." in k)
    x = torch.randn(2, 3, 40, 40)
    mask = torch.ones(2, 40, 40, dtype=torch.long)
    mask[1, :, 24:] = 0
    with torch.no_grad():
        a, b = ours(pixel_values=x, pixel_mask=mask), theirs(pixel_values=x, pixel_mask=mask)
    assert a.logits.shape == (2, 8, 11)
    assert (a.logits - b.logits).abs().max().item() <= 1e-4  # fp32 equivalence rule
    assert (a.pred_boxes - b.pred_boxes).abs().max().item() <= 1e-4


def test_synthetic_example_from_random_weights(tmp_path):
    """The --help example without data: digits on a canvas, DETR from random weights."""
    out = tmp_path / "run"
    ok(run("finetune_detection.py", "--synthetic", 16, "--model-kwargs", *DETR_SIZES, "--steps", 2, "-b", 8,
           "--output-dir", out, *COMMON))
    assert sorted(train_losses(out)) == [1, 2]
    cfg = json.loads((out / "checkpoint-2" / "config.json").read_text())
    assert cfg["id2label"] == {str(d): str(d) for d in range(10)}


def test_synthetic_example_trains_deformable_detr_and_scores_its_sigmoid_classes(tmp_path):
    """Any detector of the family: Deformable DETR (sigmoid classes, focal loss) trains and is evaluated."""
    out = tmp_path / "run"
    sizes = [*DETR_SIZES, "encoder_n_points=2", "decoder_n_points=2", "two_stage_num_proposals=8", "with_box_refine=True"]
    ok(run("finetune_detection.py", "--synthetic", 16, "--model", "deformable_detr", "--model-kwargs", *sizes,
           "--steps", 2, "-b", 8, "--output-dir", out, *COMMON))
    assert sorted(train_losses(out)) == [1, 2]
    cfg = json.loads((out / "checkpoint-2" / "config.json").read_text())
    assert cfg["model_type"] == "deformable_detr" and cfg["with_box_refine"] is True


def test_detections_read_sigmoid_classes_without_a_no_object_column():
    detections = _main("finetune_detection.py").detections
    logits = torch.tensor([[[2.0, -1.0], [-3.0, -2.5]]])
    boxes = torch.full((1, 2, 4), 0.5)
    labels = [{"orig_size": torch.tensor([10, 20]), "boxes": boxes[0, :1], "class_labels": torch.tensor([0])}]
    preds, _ = detections(logits, boxes, labels, sigmoid_classes=True)
    assert preds[0]["labels"].tolist() == [0, 1]  # the second query's best sigmoid; a softmax would drop class 1
    assert torch.allclose(preds[0]["scores"], torch.sigmoid(torch.tensor([2.0, -2.5])))


def test_readme_run_file(coco, hf_detr, tmp_path):
    """README's recipe: configs/finetune_detection.yaml, its paths and sizes overridden by flags."""
    train_images, train_ann, val_images, val_ann = coco
    out = tmp_path / "run"
    ok(run("finetune_detection.py", "--config", ROOT / "configs" / "finetune_detection.yaml", "--pretrained", hf_detr,
           "--train-images", train_images, "--train-ann", train_ann, "--val-images", val_images, "--val-ann", val_ann,
           "--label-ids", "category_id", "--img-size", 32, "--max-size", 48, "-b", 4, "--steps", 1, "--output-dir", out,
           *COMMON))
    cfg = json.loads((out / "checkpoint-1" / "config.json").read_text())
    assert len(cfg["id2label"]) == 38 and cfg["id2label"]["37"] == "digit 9" and cfg["id2label"]["5"] == "N/A"


def test_a_bad_argument_is_one_line_and_exit_2(coco, tmp_path):
    train_images, train_ann, _, _ = coco
    proc = run("finetune_detection.py", "--train-images", train_images, "--train-ann", train_ann, "--val-images",
               train_images, "--output-dir", tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines == ["finetune_detection.py: error: --val-images and --val-ann go together "
                                              "(see finetune_detection.py --help)"], proc.stderr


@pytest.mark.parametrize("case", ["missing annotations", "not json", "unknown category", "no categories", "no images dir",
                                  "synthetic and files", "bad label ids"])
def test_user_errors_name_the_problem(case, coco, capsys, tmp_path):
    train_images, train_ann, _, _ = coco
    bad = tmp_path / "bad.json"
    raw = json.loads(train_ann.read_text())
    args, needles = ["--train-images", train_images, "--train-ann", bad], [str(bad)]
    if case == "missing annotations":
        needles = ["--train-ann", "no such file"]
    elif case == "not json":
        bad.write_text("{not json")
        needles.append("cannot read COCO annotations")
    elif case == "unknown category":
        raw["annotations"][0]["category_id"] = 99
        bad.write_text(json.dumps(raw))
        needles += ["annotations[0]", "category_id 99"]
    elif case == "no categories":
        bad.write_text(json.dumps({**raw, "categories": []}))
        needles.append("'categories' is empty")
    elif case == "no images dir":
        args, needles = ["--train-images", tmp_path / "nowhere", "--train-ann", train_ann], ["--train-images", "no such directory"]
    elif case == "synthetic and files":
        args, needles = ["--synthetic", 8, "--train-ann", train_ann], ["--synthetic replaces the data files"]
    else:
        args, needles = ["--synthetic", 8, "--label-ids", "names"], ["--label-ids", "invalid choice"]
    user_error(capsys, "finetune_detection.py", [*args, "--output-dir", tmp_path / "o", "--workers", 0], *needles)


def test_boxdet_r50_is_refused_naming_detr():
    """One detector family: the name of a DETR head on a bare ResNet is refused, pointing to DETR."""
    with pytest.raises(fastzoo.errors.UnknownModelError, match=r"'boxdet_r50' is not reproduced by fastzoo.*create\('detr'\)"):
        fastzoo.create("boxdet_r50")
    assert not fastzoo.list_models("boxdet*") and "facebook/detr-resnet-50" in fastzoo.list_models("*detr*")


def test_a_state_dict_file_and_a_live_model_are_checkpoints_too(coco, hf_detr, tmp_path):
    """--pretrained takes transformers' weights file alone (its sizes read from the keys; the head
    counts, which keys cannot tell, given as --model-kwargs), as create(pretrained=) takes a live model."""
    from safetensors.torch import save_file
    from test_train_scripts import _main
    from transformers import DetrForObjectDetection

    hf = DetrForObjectDetection.from_pretrained(hf_detr)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "detr.safetensors")
    train_images, train_ann, _, _ = coco
    out = tmp_path / "run"
    assert _main("finetune_detection.py").main([
        "--model", "facebook/detr-resnet-50", "--pretrained", str(tmp_path / "detr.safetensors"), "--model-kwargs",
        "encoder_attention_heads=2", "decoder_attention_heads=2", "--train-images", str(train_images), "--train-ann",
        str(train_ann), "--img-size", "32", "-b", "8", "--steps", "1", "--workers", "0", "--output-dir", str(out)]) == 0
    trained = DetrForObjectDetection.from_pretrained(out / "checkpoint-1")
    frozen = [k for k in hf.state_dict() if ".backbone." in k and "num_batches_tracked" not in k]
    assert frozen and all(torch.equal(trained.state_dict()[k], hf.state_dict()[k]) for k in frozen)
    live = fastzoo.create(pretrained=hf, num_labels=10, id2label={i: str(i) for i in range(10)})
    assert live.class_labels_classifier.out_features == 11 and torch.equal(
        live.model.query_position_embeddings.weight, hf.model.query_position_embeddings.weight)


def test_two_gloo_processes_train_and_gather_the_map(tmp_path):
    """torchrun with 2 processes: each trains on its share of the global batch and evaluates its share of
    the validation images; the mAP is reported (torchmetrics syncs its states over the process group
    when it computes, which runs on every process: a collective that one process skipped would hang)."""
    out = tmp_path / "run"
    ok(run("finetune_detection.py", "--synthetic", 16, "--model-kwargs", *DETR_SIZES, "dropout=0", "--steps", 2, "-b", 8,
           "--device", "cpu", "--output-dir", out, *COMMON, nproc=2))
    assert sorted(train_losses(out)) == [1, 2]
    evals = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "eval_map" in r]
    assert len(evals) == 1 and 0.0 <= evals[0]["eval_map_50"] <= 1.0 and evals[0]["eval_loss"] > 0
