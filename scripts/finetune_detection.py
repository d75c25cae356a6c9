#!/usr/bin/env python
"""Fine-tune a detector (DETR, Deformable DETR) on COCO-format data, with its categories.

    # a transformers checkpoint (save_pretrained directory or state dict file) on a COCO-format set
    python scripts/finetune_detection.py --model facebook/detr-resnet-50 --pretrained detr-resnet-50/ \\
        --train-images data/train --train-ann data/train.json --val-images data/val --val-ann data/val.json \\
        --img-size 800 --max-size 1333 -b 8 --lr 1e-4 --epochs 50 --amp bf16
    torchrun --nproc_per_node 8 scripts/finetune_detection.py ...        # same global batch, DDP

    # no data at hand: digits on a 64x64 canvas (10 classes), DETR from random weights
    python scripts/finetune_detection.py --synthetic 64 --model-kwargs use_timm_backbone=false depths=[1,1,1,1] \\
        hidden_sizes=[16,32,64,64] embedding_size=16 d_model=64 encoder_layers=2 decoder_layers=2 num_queries=8

The classes come from the data: COCO's ``categories`` numbered 0..K-1 in id order (``--label-ids
contiguous``, the default; the model gets ``num_labels = K`` and ``id2label`` with their names) or
COCO's own ids as the labels (``--label-ids category_id``, as transformers' DetrImageProcessor passes
them: fine-tuning facebook/detr-resnet-50 on COCO keeps its 91-label head). A checkpoint with another
label count gets a fresh class head (transformers' ``ignore_mismatched_sizes=True``), the rest loads.
``--model`` without ``--pretrained`` starts from random weights.

Images are resized (shorter side ``--img-size``, longer at most ``--max-size``), normalised with
ImageNet's statistics and padded per batch with a ``pixel_mask``; boxes are DETR's normalised
(cx, cy, w, h). The loss is DETR's set loss (``--giou-impl`` picks how its GIoU term runs). After every
epoch the validation loss, its terms and COCO mAP (torchmetrics' MeanAveragePrecision: map, map_50,
map_75) are printed and logged (``--help`` ends with a small recipe and how to read its first epochs). Checkpoints are directories transformers' ``DetrForObjectDetection.from_pretrained``
reads (``config.json`` with ``id2label``, ``model.safetensors``), written atomically. Everything else
(--amp bf16, --resume, NaN capture and --replay, torchrun) is fastzoo.train's; see --help. Under
torchrun each process computes transformers' loss on its share of the global batch (its own box count
and class weights, as transformers' loss without accelerate) and DDP averages the gradients.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from fastzoo.data.boxes import LABEL_IDS, CocoDetection, collate_detection, read_coco
from fastzoo.losses import kernel_build_needed, kernel_path
from fastzoo.losses.set_matching import center_to_corners
from fastzoo.losses.set_prediction import GIOU_IMPLS
from fastzoo.tasks import DETECTION
from fastzoo.train import Task, UsageError, parse_args, run_main, setup, train, train_parser
from fastzoo.train.cli import create_model, positive_int

SYNTHETIC_LABELS = {i: str(i) for i in range(10)}


class CanvasDetection(Dataset):
    """Digits on a canvas (``fastzoo.accuracy.data.digits_canvas``), items as :class:`CocoDetection`'s."""

    def __init__(self, canvases, side: int):
        self.canvases, self.side = canvases, side

    def __len__(self):
        return len(self.canvases.boxes)

    def __getitem__(self, i):
        xyxy = self.canvases.boxes[i]
        boxes = torch.cat([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1)
        return self.canvases.images[i], {"class_labels": self.canvases.labels[i], "boxes": boxes,
                                         "image_id": torch.tensor(i), "orig_size": torch.tensor([self.side, self.side])}


def synthetic(n: int, side: int, seed: int):
    from fastzoo.accuracy.data import digits_canvas

    train, val = digits_canvas(n, max(1, n // 4), canvas=side, digit_px=(side // 4, side // 2), seed=seed)
    return CanvasDetection(train, side), CanvasDetection(val, side)


# shown by --help: a DETR small enough to train on a CPU, and how to read its first epochs
SMALL_RECIPE = (
    "A small DETR from random weights, about 5 minutes on a 2-core CPU: --synthetic 256 --epochs 30 -b 8 --lr 1e-3 "
    "--model-kwargs use_timm_backbone=false depths=[1,1,1,1] hidden_sizes=[16,32,64,64] embedding_size=16 d_model=64 "
    "encoder_layers=2 decoder_layers=2 num_queries=8 dropout=0.0. Reading it: DETR places boxes long before it names "
    "them, so mAP can stay at 0.000 for all of such a run; loss_bbox falling on the eval line says the run learns "
    "(loss_ce and cardinality_error move later, over hundreds of epochs at DETR's paper sizes).")


def build_parser():
    p = train_parser(__doc__.splitlines()[1], model_default="detr")
    p.epilog = SMALL_RECIPE
    g = p.add_argument_group("data")
    g.add_argument("--train-images", type=Path, help="directory of the training images")
    g.add_argument("--train-ann", type=Path, help="COCO instances JSON of --train-images (its categories are the classes)")
    g.add_argument("--val-images", type=Path, default=None, help="directory of the validation images")
    g.add_argument("--val-ann", type=Path, default=None, help="COCO instances JSON of --val-images (mAP is reported on it)")
    g.add_argument("--synthetic", type=positive_int, metavar="N",
                   help="N canvases of digits (10 classes) instead of files (N/4 for validation)")
    g.add_argument("--label-ids", choices=LABEL_IDS, default="contiguous",
                   help="class labels: the categories numbered 0..K-1 in id order, or COCO's category_id itself")
    g.add_argument("--img-size", type=positive_int, default=None,
                   help="shorter image side after resizing (default: 800, DETR's; --synthetic: the canvas side, 64)")
    g.add_argument("--max-size", type=positive_int, default=1333, help="longest image side after resizing")
    g.add_argument("--giou-impl", choices=tuple(GIOU_IMPLS), default=None,
                   help="how the GIoU loss term runs (default: the model's, kernel: the fused op on padded boxes)")
    return p


def check_data(parser, args) -> None:
    if args.synthetic is None and not (args.train_images and args.train_ann):
        parser.error("give the data: --train-images DIR --train-ann FILE (COCO instances JSON), or --synthetic N")
    if args.synthetic is not None and (args.train_images or args.train_ann or args.val_images or args.val_ann):
        parser.error("--synthetic replaces the data files: give --synthetic N or --train-images/--train-ann, not both")
    if bool(args.val_images) != bool(args.val_ann):
        parser.error("--val-images and --val-ann go together")
    for flag, f in (("--train-ann", args.train_ann), ("--val-ann", args.val_ann)):
        if f is not None and not f.is_file():
            raise UsageError(f"{flag} {f}: no such file")
    for flag, d in (("--train-images", args.train_images), ("--val-images", args.val_images)):
        if d is not None and not d.is_dir():
            raise UsageError(f"{flag} {d}: no such directory")


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    check_data(parser, args)
    train_set = eval_set = None
    if args.synthetic is not None:
        id2label = SYNTHETIC_LABELS
        if args.replay is None:
            train_set, eval_set = synthetic(args.synthetic, args.img_size or 64, args.seed)
    elif args.replay is not None:  # the captured batch is replayed: the classes are all that is read
        id2label = read_coco(args.train_ann, args.label_ids)[2]
    else:
        sizes = {"label_ids": args.label_ids, "shortest_edge": args.img_size or 800, "longest_edge": args.max_size}
        train_set = CocoDetection(args.train_images, args.train_ann, **sizes)
        eval_set = CocoDetection(args.val_images, args.val_ann, **sizes) if args.val_images else None
        id2label = train_set.id2label
        if eval_set is not None and eval_set.id2label != id2label:
            raise UsageError(f"--val-ann {args.val_ann}: its categories differ from --train-ann {args.train_ann}'s")
    world = setup(args)
    overrides = {"num_labels": len(id2label), "id2label": id2label, **({"giou_impl": args.giou_impl} if args.giou_impl else {})}
    model = create_model(args, device=world.device, task=DETECTION, **overrides)
    if model.config.giou_impl == "kernel":  # loaded here, before the data-loading workers start (they check boxes with it)
        if kernel_build_needed(world.device) and world.is_main:
            print("building the fused GIoU kernel once, ~40 s (cached for this torch, compiler and Python)", flush=True)
        kernel_path(world.device)

    def loss(net, batch):
        out = net(pixel_values=batch["pixel_values"], pixel_mask=batch["pixel_mask"], labels=batch["labels"])
        n = len(batch["labels"])
        return out.loss * n, n

    mean_ap = coco_map()

    def eval_step(net, batch):
        out = net(pixel_values=batch["pixel_values"], pixel_mask=batch["pixel_mask"], labels=batch["labels"])
        mean_ap.update(*detections(out.logits, out.pred_boxes, batch["labels"], model.sigmoid_classes))
        n = len(batch["labels"])  # the loss and its terms: whether the run learns before mAP moves
        terms = ("loss_ce", "loss_bbox", "loss_giou", "cardinality_error")
        return {"loss": (out.loss * n, n), **{k: (out.loss_dict[k] * n, n) for k in terms}}

    def eval_finish(means: dict) -> dict:
        result = mean_ap.compute()
        mean_ap.reset()
        return {**means, **{k: float(result[k]) for k in ("map", "map_50", "map_75")}}

    task = Task(model=model, train_items=train_set, collate=collate_detection, loss=loss, eval_items=eval_set,
                eval_step=eval_step, eval_finish=eval_finish, unit="img")
    return train(args, task, world)


def coco_map():
    """COCO's mAP (IoU 0.5:0.95, and at 0.5 and 0.75), through torchmetrics (its pycocotools backend)."""
    from torchmetrics.detection import MeanAveragePrecision

    return MeanAveragePrecision(box_format="xyxy", iou_type="bbox")


def detections(logits, pred_boxes, labels, sigmoid_classes: bool = False):
    """(predictions, targets) for MeanAveragePrecision, in pixels of each original image: every
    query's best class and its probability, as transformers' ``post_process_object_detection`` reads
    them: a softmax without "no object" (DETR), or each class's sigmoid (``sigmoid_classes``: Deformable DETR)."""
    probs = logits.float().sigmoid() if sigmoid_classes else logits.float().softmax(-1)[..., :-1]
    scores, classes = probs.max(-1)
    preds, targets = [], []
    for b, s, c, t in zip(pred_boxes.float(), scores, classes, labels):
        h, w = (int(v) for v in t["orig_size"])
        scale = torch.tensor([w, h, w, h], dtype=torch.float32)
        preds.append({"boxes": center_to_corners(b).cpu() * scale, "scores": s.cpu(), "labels": c.cpu()})
        targets.append({"boxes": center_to_corners(t["boxes"].float()).cpu() * scale, "labels": t["class_labels"].cpu()})
    return preds, targets


if __name__ == "__main__":
    run_main(main)
