"""The detection set of real handwritten digits and what the learning recipe
(configs/accuracy_digits_detr_learns.yaml) builds on: the canvases written as a COCO-format set read
back as the same canvases, the script that writes it, and the backbone pretrained on the training
digits before the detector trains."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastzoo.accuracy.data import digits_canvas, digits_coco
from fastzoo.accuracy.pretrain import _with_trainable_batch_norm, pretrain_backbone
from fastzoo.data.boxes import CocoDetection, read_coco, write_coco

ROOT = Path(__file__).resolve().parents[1]
SIDE = 48


def test_digits_coco_reads_back_as_the_canvases(tmp_path):
    from PIL import Image

    paths = digits_coco(tmp_path, 6, 3, canvas=SIDE, digit_px=(12, 20))
    train, val = digits_canvas(6, 3, canvas=SIDE, digit_px=(12, 20))
    for split, name in ((train, "train"), (val, "val")):
        images, targets, id2label = read_coco(paths[f"{name}_ann"])
        assert id2label == {d: str(d) for d in range(10)} and len(images) == len(split.boxes)
        ds = CocoDetection(paths[f"{name}_images"], paths[f"{name}_ann"], shortest_edge=SIDE)
        for i, (boxes, labels) in enumerate(zip(split.boxes, split.labels)):
            _, t = ds[i]
            cxcywh = torch.cat([(boxes[:, :2] + boxes[:, 2:]) / 2, boxes[:, 2:] - boxes[:, :2]], 1)
            # boxes are whole pixels on both sides: equal up to fp32 rounding of the division by the side
            torch.testing.assert_close(t["boxes"], cxcywh, rtol=0, atol=1e-6)
            assert torch.equal(t["class_labels"], labels)
            png = torch.tensor(np.array(Image.open(paths[f"{name}_images"] / images[i]["file_name"])))
            # 8-bit pixels: within half a level of the canvas's own
            assert (png.float() - (split.images[i, 0] * 0.5 + 0.5) * 255).abs().max() <= 0.5 + 1e-4


@pytest.mark.parametrize("bad, needle", [
    (dict(images=[torch.zeros(1, 4, 4)]), "images[0] must be a [C, h, w] uint8 tensor"),
    (dict(labels=[torch.tensor([10])]), "labels[0] has category ids [10], which categories lacks"),
    (dict(boxes=[torch.zeros(1, 4)] * 2), "one entry per image"),
])
def test_write_coco_refuses_bad_input_by_name(tmp_path, bad, needle):
    args = {"images": [torch.zeros(1, 4, 4, dtype=torch.uint8)], "boxes": [torch.tensor([[0.0, 0.0, 2.0, 2.0]])],
            "labels": [torch.tensor([3])], **bad}
    with pytest.raises(ValueError) as e:
        write_coco(tmp_path / "img", tmp_path / "ann.json", args["images"], args["boxes"], args["labels"],
                   {d: str(d) for d in range(10)})
    assert needle in str(e.value)


def test_make_digits_coco_script_writes_a_set_and_refuses_bad_sizes_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "scripts" / "make_digits_coco.py"), "--out", str(tmp_path / "set")]
    good = subprocess.run([*cmd, "--n-train", "3", "--n-val", "2", "--canvas", "40", "--digit-px", "10", "16"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert good.returncode == 0, good.stderr[-2000:]
    assert [len(read_coco(tmp_path / "set" / f"{s}.json")[0]) for s in ("train", "val")] == [3, 2]
    bad = subprocess.run([*cmd, "--canvas", "16", "--digit-px", "10", "20"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--digit-px 10 20" in bad.stderr


def _detr_backbone():
    from fastzoo.models.detr.spec import TINY, build_original

    torch.manual_seed(0)
    return build_original(dict(TINY, layer_type="basic", hidden_sizes=(16, 32), depths=(1, 1))).model.backbone.model


def test_trainable_batch_norm_copy_computes_the_frozen_backbone():
    backbone = _detr_backbone()
    with torch.no_grad():
        for m in backbone.modules():  # statistics away from (0, 1), so the copy has something to carry
            if type(m).__name__.endswith("FrozenBatchNorm2d"):
                m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 2.0), m.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 32, 32)
    trainable = _with_trainable_batch_norm(backbone).eval()
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in trainable.modules())
    with torch.no_grad():
        # the same affine map written two ways (BatchNorm's formula, DETR's scale-and-shift): fp32 rounding apart
        torch.testing.assert_close(trainable(x).feature_maps[-1], backbone(x).feature_maps[-1], rtol=1e-5, atol=1e-5)


def test_pretrain_backbone_learns_the_training_digits_into_the_frozen_backbone():
    backbone = _detr_backbone()
    flags = {n: p.requires_grad for n, p in backbone.named_parameters()}
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    single, _ = digits_canvas(256, 1, canvas=24, max_digits=1, digit_px=(14, 20))
    acc = pretrain_backbone(backbone, single.images, torch.cat(single.labels), num_classes=10, steps=60, lr=3e-3,
                            batch_size=64, seed=0)
    assert acc >= 0.5  # ten classes: chance is 0.1; a measured 60-step run gets ~0.8 on its last batch
    assert {n: p.requires_grad for n, p in backbone.named_parameters()} == flags  # frozen stays frozen
    after = backbone.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(k.endswith("running_mean") for k in moved) and any(k.endswith("convolution.weight") for k in moved)


def test_the_users_path_pretrained_checkpoint_then_finetune_on_the_coco_set(tmp_path):
    """scripts/pretrain_digits_backbone.py writes the run file's starting point (its backbone trained on
    the training digits) as a checkpoint transformers reads, equal to what the accuracy run starts
    from; finetune_detection.py trains from it on make_digits_coco.py's set."""
    import transformers

    from fastzoo.accuracy.config import load_config
    from fastzoo.accuracy.runs import initial_original, parity_data

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    config = ROOT / "configs" / "accuracy_digits_detr_learns.yaml"
    tiny = ["pretrain.steps=3", "pretrain.n_images=32", "pretrain.batch_size=8", "data.n_train=8", "data.n_test=4"]
    script = [sys.executable, str(ROOT / "scripts" / "pretrain_digits_backbone.py"), "--config", str(config)]
    done = subprocess.run([*script, "--out", str(tmp_path / "ck"), *(x for t in tiny for x in ("--set", t))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = transformers.DetrForObjectDetection.from_pretrained(tmp_path / "ck").model.backbone.model.state_dict()
    cfg = load_config(config, tiny)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the script's threads: the same reductions, the same bits
    try:
        expected = initial_original(cfg, parity_data(cfg, "cpu"))[0].model.backbone.model.state_dict()
    finally:
        torch.set_num_threads(before)
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_digits_coco.py"), "--out", str(tmp_path / "set"),
                    "--n-train", "8", "--n-val", "4"], check=True, capture_output=True, env=env, timeout=300)
    s = tmp_path / "set"
    ft = subprocess.run([sys.executable, str(ROOT / "scripts" / "finetune_detection.py"), "--pretrained", str(tmp_path / "ck"),
                         "--train-images", str(s / "train"), "--train-ann", str(s / "train.json"), "--val-images",
                         str(s / "val"), "--val-ann", str(s / "val.json"), "--img-size", "64", "--steps", "2", "-b", "4",
                         "-j", "0", "--output", str(tmp_path / "ft")], capture_output=True, text=True, env=env, timeout=600)
    assert ft.returncode == 0 and "map_50" in ft.stdout, ft.stderr[-2000:]
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_digits_backbone.py"), "--config",
                          str(ROOT / "configs" / "accuracy_digits_vit.yaml"), "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no pretrain section" in bad.stderr
