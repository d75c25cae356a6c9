#!/usr/bin/env python
"""Train a fastzoo box detector on COCO-format annotations (or synthetic boxes).

    python scripts/train_boxdet.py --model boxdet_r50 --pretrained resnet50.pth \\
        --train-images coco/train2017 --train-ann coco/annotations/instances_train2017.json \\
        --val-images coco/val2017 --val-ann coco/annotations/instances_val2017.json \\
        --giou kernel --num-queries 100 --img-size 512 -b 64 --amp bf16 --channels-last
    python scripts/train_boxdet.py --synthetic 256 --giou padded      # no data needed
    torchrun --nproc_per_node 8 scripts/train_boxdet.py ...           # same global batch, DDP

``--pretrained`` takes a box detector (a ``save_pretrained`` or ``checkpoint-<step>``
directory, or its state dict file) or a ResNet-50 backbone (torchvision / timm file, whose
``fc`` is dropped; the detector's head starts fresh).

COCO boxes (``[x, y, w, h]`` in pixels) become ``xyxy`` in [0, 1]; an image may have any
number of boxes, zero included; crowd regions are skipped. ``--giou`` picks how the GIoU
loss handles the different box counts: ``per_sample`` (a loop), ``concat`` (one
concatenated call), ``padded`` (the padded batch, masked, in plain ops) or ``kernel`` (the
default: the fused op on the padded batch, masked reduction inside, no host sync).
The validation loss is printed after every epoch.

Batches are collated on the CPU by ``fastzoo.data.boxes.collate_detection`` (validated
there, once), so a step moves a handful of tensors to the device and the loss checks
nothing again. The training loss is the whole global batch's DETR loss: each process
normalises by the all-reduced image and box counts, so N processes compute what one
process computes on the same global batch (with the backbone's BatchNorm frozen, the
default, as DETR's; ``--model-kwargs frozen_bn=False --sync-bn`` trains BN synced on CUDA).
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from torch.utils.data import Dataset

from fastzoo import weights
from fastzoo.data.boxes import collate_detection
from fastzoo.losses.boxes import GIOU_LAYOUTS
from fastzoo.train import Task, UsageError, parse_args, run_main, setup, train, train_parser
from fastzoo.train import distributed as D
from fastzoo.train.cli import create_model, positive_int
from fastzoo.models.resnet.convert import ResNetConverter

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def coco_boxes(ann_file: Path) -> tuple[list[dict], dict[int, torch.Tensor]]:
    """Images of a COCO JSON and, per image id, its boxes as normalised xyxy ``[n, 4]``."""
    try:
        data = json.loads(Path(ann_file).read_text())
        images = data["images"]
        sizes = {im["id"]: (im["width"], im["height"]) for im in images}
        boxes: dict[int, list] = {im["id"]: [] for im in images}
        for a in data.get("annotations", []):
            if a.get("iscrowd", 0):
                continue
            x, y, w, h = a["bbox"]
            W, H = sizes[a["image_id"]]
            if w > 0 and h > 0:
                boxes[a["image_id"]].append([x / W, y / H, (x + w) / W, (y + h) / H])
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read COCO annotations {ann_file}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{ann_file}: not COCO detection format (images with id/width/height, "
                         f"annotations with image_id/bbox): missing or bad {e}") from e
    return images, {i: torch.tensor(b, dtype=torch.float32).reshape(-1, 4).clamp(0, 1) for i, b in boxes.items()}


class CocoDetection(Dataset):
    def __init__(self, image_dir: Path, ann_file: Path, img_size: int):
        if not Path(image_dir).is_dir():
            raise UsageError(f"image directory {image_dir} does not exist")
        self.images, self.boxes = coco_boxes(ann_file)
        self.image_dir, self.img_size = Path(image_dir), img_size

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        from PIL import Image
        from torchvision.transforms import functional as TF

        info = self.images[i]
        path = self.image_dir / info["file_name"]
        try:
            img = Image.open(path).convert("RGB")
        except OSError as e:
            raise UsageError(f"cannot read image {path}: {e}") from e
        # Boxes are normalised, so a plain resize leaves them valid.
        x = TF.to_tensor(TF.resize(img, [self.img_size, self.img_size], antialias=True))
        return TF.normalize(x, IMAGENET_MEAN, IMAGENET_STD), self.boxes[info["id"]]


class SyntheticBoxes(Dataset):
    """Noise images with 0..``max_boxes`` bright rectangles; the targets are the rectangles."""

    def __init__(self, n: int, img_size: int, seed: int, max_boxes: int = 4):
        self.n, self.img_size, self.seed, self.max_boxes = n, img_size, seed, max_boxes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        S = self.img_size
        img = 0.3 * torch.randn(3, S, S, generator=g)
        k = int(torch.randint(0, self.max_boxes + 1, (), generator=g))
        lo = torch.rand(k, 2, generator=g) * 0.7
        hi = lo + 0.1 + torch.rand(k, 2, generator=g) * (1 - lo - 0.1)
        boxes = torch.cat([lo, hi], 1)  # x0 y0 x1 y1
        for x0, y0, x1, y1 in (boxes * S).round().long().tolist():
            img[:, y0:y1, x0:x1] = 2.0
        return img, boxes


def create_detector(args, device, **overrides):
    """``--pretrained`` as a detector checkpoint (through ``fastzoo.create``) or as a ResNet
    backbone checkpoint (``load_backbone``: strict on the backbone, the head starts fresh)."""
    src = weights.read_source(args.pretrained) if args.pretrained is not None else None
    family = (src.config or {}).get("family") if src is not None else None  # fastzoo directories say it
    if src is None or not (family == "resnet" or family is None and ResNetConverter.matches(src.state_dict)):
        return create_model(args, device=device, **overrides)
    model = create_model(argparse.Namespace(**{**vars(args), "pretrained": None}), device=device, **overrides)
    model.load_backbone(src)
    return model


def build_parser():
    p = train_parser(__doc__.splitlines()[1], model_default="boxdet_r50")
    g = p.add_argument_group("data")
    g.add_argument("--train-images", type=Path, help="directory of the training images")
    g.add_argument("--train-ann", type=Path, help="COCO-format JSON for --train-images")
    g.add_argument("--val-images", type=Path, default=None)
    g.add_argument("--val-ann", type=Path, default=None)
    g.add_argument("--synthetic", type=positive_int, metavar="N", help="N synthetic training images (N/4 for eval)")
    g.add_argument("--img-size", type=positive_int, default=512, help="images are resized to this square")
    g.add_argument("--num-queries", type=positive_int, default=None, help="box queries (default: the model's)")
    g.add_argument("--giou", choices=GIOU_LAYOUTS, default="kernel",
                   help="how the GIoU loss handles images with different box counts (default: kernel, the fused "
                        "op on the padded boxes)")
    g.add_argument("--channels-last", action="store_true", help="NHWC images and weights (faster convolutions on GPU)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.replay is None:
        if args.synthetic is None and not (args.train_images and args.train_ann):
            parser.error("give the data: --train-images DIR --train-ann FILE (COCO JSON), or --synthetic N")
        if bool(args.val_images) != bool(args.val_ann):
            parser.error("--val-images and --val-ann go together")
        for f in (args.train_ann, args.val_ann):
            if f is not None and not f.is_file():
                raise UsageError(f"no such annotation file: {f}")
    world = setup(args)
    overrides = {"loss": args.giou, **({"num_queries": args.num_queries} if args.num_queries else {})}
    model = create_detector(args, world.device, **overrides)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)

    train_set = eval_set = None
    if args.replay is None:
        if args.synthetic:
            train_set = SyntheticBoxes(args.synthetic, args.img_size, args.seed)
            eval_set = SyntheticBoxes(max(1, args.synthetic // 4), args.img_size, args.seed + 1)
        else:
            train_set = CocoDetection(args.train_images, args.train_ann, args.img_size)
            eval_set = CocoDetection(args.val_images, args.val_ann, args.img_size) if args.val_images else None

    def detection_loss(net, batch, whole_batch: bool = True):
        """(sum, count) for the loop, which divides by the all-reduced count. The loss is this
        process's share of the global batch's loss (normalised by the all-reduced image and
        box counts, no host sync), times the global image count, with this process's images
        as the count: the shares add up to the global loss, and the logged mean is that loss.
        Evaluation normalises per process (no collective inside a loop of unequal length)."""
        images, targets = batch
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        sizes = torch.tensor([len(targets), targets.num_boxes], dtype=torch.float32, device=images.device)
        if whole_batch:
            D.all_reduce_(sizes)
        loss = model.loss(net(images), targets, num_images=sizes[0], num_boxes=sizes[1])
        return loss * sizes[0], len(targets)

    collate = functools.partial(collate_detection, num_classes=model.config.num_classes)
    task = Task(model=model, train_items=train_set, collate=collate, loss=detection_loss, eval_items=eval_set,
                eval_step=lambda m, b: {"loss": detection_loss(m, b, whole_batch=False)}, unit="img")
    return train(args, task, world)


if __name__ == "__main__":
    run_main(main)
