"""Detection data for a DataLoader: a COCO-format set with its categories (:class:`CocoDetection`)
and batches in transformers' DETR convention (:func:`collate_detection`: ``pixel_values``,
``pixel_mask``, ``labels``). :class:`~fastzoo.losses.boxes.BoxTargets` and :func:`collate_boxes`
(every layout the GIoU loss takes) are re-exported here.

COCO's ``category_id`` becomes the class label in one of two ways (``label_ids=``):

- ``"contiguous"`` (default): the categories sorted by id are numbered 0..K-1, ``id2label`` gives
  their names; a model of ``num_labels = K``, as transformers' object-detection guide builds from a
  dataset's categories;
- ``"category_id"``: the id itself is the label, as transformers' ``DetrImageProcessor`` passes it
  (``facebook/detr-resnet-50`` has 91 labels: COCO's ids run to 90; ids without a category are
  named ``"N/A"`` as in its config). Fine-tuning a COCO checkpoint on COCO keeps its head this way.

Boxes: COCO's ``[x, y, w, h]`` in pixels become ``(cx, cy, w, h)`` normalised by the image's own
size, padding excluded (the DETR code's targets, which facebook/detr-resnet-50 was trained on;
``DetrImageProcessor.pad`` with ``update_bboxes=True`` normalises by the padded size instead); crowd
regions and empty boxes are skipped and a box is clipped to the image (transformers' rule). Images are resized so the shorter side is ``shortest_edge`` and the longer
at most ``longest_edge`` (DETR's 800 / 1333), normalised with ImageNet's mean and std, and padded
per batch to the largest, ``pixel_mask`` marking the real pixels.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from fastzoo.errors import FastzooError
from fastzoo.losses.boxes import BoxTargets, collate_boxes

__all__ = ["BoxTargets", "CocoDetection", "LABEL_IDS", "collate_boxes", "collate_detection", "read_coco", "write_coco"]

LABEL_IDS = ("contiguous", "category_id")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class CocoError(FastzooError, ValueError):
    """A COCO annotation file that cannot be read, named with what is wrong in it."""


def read_coco(ann_file, label_ids: str = "contiguous") -> tuple[list[dict], dict[int, dict], dict[int, str]]:
    """``(images, targets, id2label)`` of a COCO instances JSON: the ``images`` entries, per image
    id ``{"class_labels" [n], "boxes" [n, 4] cxcywh in [0, 1]}``, and class label -> name."""
    if label_ids not in LABEL_IDS:
        raise ValueError(f"label_ids={label_ids!r}: choose one of {', '.join(LABEL_IDS)}")
    try:
        data = json.loads(Path(ann_file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CocoError(f"cannot read COCO annotations {ann_file}: {e}") from e
    try:
        images = list(data["images"])
        sizes = {im["id"]: (float(im["width"]), float(im["height"])) for im in images}
        names = {int(c["id"]): str(c["name"]) for c in data["categories"]}
        if not names:
            raise CocoError(f"{ann_file}: 'categories' is empty: a detector needs at least one class")
        if label_ids == "contiguous":
            label_of = {cid: i for i, cid in enumerate(sorted(names))}
            id2label = {i: names[cid] for cid, i in label_of.items()}
        else:
            if min(names) < 0:
                raise CocoError(f"{ann_file}: category id {min(names)} is negative: not a class label")
            label_of = {cid: cid for cid in names}
            id2label = {i: names.get(i, "N/A") for i in range(max(names) + 1)}
        boxes: dict = {i: [] for i in sizes}
        labels: dict = {i: [] for i in sizes}
        for n, a in enumerate(data.get("annotations", [])):
            if a.get("iscrowd", 0):
                continue
            if a["image_id"] not in sizes:
                raise CocoError(f"{ann_file}: annotations[{n}] has image_id {a['image_id']!r}, which no image has")
            if a["category_id"] not in label_of:
                raise CocoError(f"{ann_file}: annotations[{n}] has category_id {a['category_id']!r}, which is not "
                                f"in 'categories' ({', '.join(map(str, sorted(names)))})")
            W, H = sizes[a["image_id"]]
            x, y, w, h = (float(v) for v in a["bbox"])
            x0, y0, x1, y1 = max(x, 0.0), max(y, 0.0), min(x + w, W), min(y + h, H)
            if x1 <= x0 or y1 <= y0:
                continue
            boxes[a["image_id"]].append([(x0 + x1) / 2 / W, (y0 + y1) / 2 / H, (x1 - x0) / W, (y1 - y0) / H])
            labels[a["image_id"]].append(label_of[a["category_id"]])
    except CocoError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise CocoError(f"{ann_file}: not COCO detection format (images with id/width/height, categories with "
                        f"id/name, annotations with image_id/category_id/bbox): missing or bad {e}") from e
    targets = {i: {"class_labels": torch.tensor(labels[i], dtype=torch.long),
                   "boxes": torch.tensor(boxes[i], dtype=torch.float32).reshape(-1, 4)} for i in sizes}
    return images, targets, id2label


def write_coco(image_dir, ann_file, images: Sequence[Tensor], boxes: Sequence[Tensor], labels: Sequence[Tensor],
               categories: dict[int, str]) -> Path:
    """A COCO instances set that :func:`read_coco` and :class:`CocoDetection` read: image ``i`` (a
    ``[C, h, w]`` uint8 tensor, C 1 or 3) as ``image_dir/{i:06d}.png`` with id ``i``, its ``boxes``
    (``[n, 4]`` xyxy in pixels) and ``labels`` (``[n]`` category ids, keys of ``categories``) as
    annotations (COCO's ``[x, y, w, h]``, ``area``, ``iscrowd`` 0). Every file is written atomically;
    returns ``ann_file``."""
    import io

    from PIL import Image

    from fastzoo.files import write_bytes, write_json

    if not (len(images) == len(boxes) == len(labels)):
        raise ValueError(f"write_coco: images, boxes and labels must have one entry per image, got "
                         f"{len(images)}, {len(boxes)} and {len(labels)}")
    Path(image_dir).mkdir(parents=True, exist_ok=True)
    entries, annotations = [], []
    for i, (img, b, c) in enumerate(zip(images, boxes, labels)):
        if img.dtype != torch.uint8 or img.ndim != 3 or img.shape[0] not in (1, 3):
            raise ValueError(f"write_coco: images[{i}] must be a [C, h, w] uint8 tensor with C 1 or 3, got "
                             f"{img.dtype} {tuple(img.shape)}")
        if b.ndim != 2 or b.shape[1] != 4 or len(c) != len(b):
            raise ValueError(f"write_coco: boxes[{i}] must be [n, 4] xyxy with one label each, got {tuple(b.shape)} "
                             f"boxes and {len(c)} labels")
        unknown = sorted({int(k) for k in c} - set(categories))
        if unknown:
            raise ValueError(f"write_coco: labels[{i}] has category ids {unknown}, which categories lacks")
        h, w = img.shape[1:]
        buf = io.BytesIO()
        Image.fromarray(img[0].numpy() if img.shape[0] == 1 else img.permute(1, 2, 0).numpy()).save(buf, format="PNG")
        name = f"{i:06d}.png"
        write_bytes(Path(image_dir) / name, buf.getvalue())
        entries.append({"id": i, "file_name": name, "width": int(w), "height": int(h)})
        for (x0, y0, x1, y1), k in zip(b.tolist(), c.tolist()):
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": int(k), "iscrowd": 0,
                                "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0)})
    cats = [{"id": int(k), "name": str(v)} for k, v in sorted(categories.items())]
    return write_json(ann_file, {"images": entries, "annotations": annotations, "categories": cats})


class CocoDetection(torch.utils.data.Dataset):
    """Item ``i``: ``(image [3, h, w] normalised, target)``, the target transformers' label dict
    (``class_labels``, ``boxes`` cxcywh), ``image_id`` and ``orig_size`` ``(height, width)``."""

    def __init__(self, image_dir, ann_file, *, label_ids: str = "contiguous", shortest_edge: int = 800,
                 longest_edge: int = 1333):
        if not Path(image_dir).is_dir():
            raise CocoError(f"image directory {image_dir} does not exist")
        self.image_dir, self.shortest_edge, self.longest_edge = Path(image_dir), shortest_edge, longest_edge
        self.images, self.targets, self.id2label = read_coco(ann_file, label_ids)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        from PIL import Image
        from torchvision.transforms import functional as TF

        info = self.images[i]
        path = self.image_dir / info["file_name"]
        try:
            img = Image.open(path).convert("RGB")
        except OSError as e:
            raise CocoError(f"cannot read image {path}: {e}") from e
        w, h = img.size
        scale = min(self.shortest_edge / min(w, h), self.longest_edge / max(w, h))
        # normalised boxes stay valid under a resize
        x = TF.to_tensor(TF.resize(img, [max(1, round(h * scale)), max(1, round(w * scale))], antialias=True))
        target = {**self.targets[info["id"]], "image_id": torch.tensor(info["id"]), "orig_size": torch.tensor([h, w])}
        return TF.normalize(x, IMAGENET_MEAN, IMAGENET_STD), target


def collate_detection(batch: Sequence[tuple]) -> dict:
    """``DataLoader(collate_fn=collate_detection)``: ``(image [3, h, w], target dict)`` items ->
    ``{"pixel_values" [B, 3, H, W], "pixel_mask" [B, H, W], "labels"}``, each image at the top left of
    the largest size, ``pixel_mask`` 1 on its pixels (``DetrImageProcessor.pad``'s layout); what a
    DETR model's forward takes as keywords."""
    if not batch:
        raise ValueError("collate_detection: an empty batch")
    images = [item[0] for item in batch]
    if any(not isinstance(x, Tensor) or x.ndim != 3 or x.shape[0] != images[0].shape[0] for x in images):
        raise ValueError(f"collate_detection: images must be [C, h, w] tensors with one C, got "
                         f"{[tuple(getattr(x, 'shape', ())) for x in images]}")
    H, W = max(x.shape[1] for x in images), max(x.shape[2] for x in images)
    pixel_values = images[0].new_zeros(len(images), images[0].shape[0], H, W)
    pixel_mask = torch.zeros(len(images), H, W, dtype=torch.long)
    for i, x in enumerate(images):
        pixel_values[i, :, : x.shape[1], : x.shape[2]] = x
        pixel_mask[i, : x.shape[1], : x.shape[2]] = 1
    return {"pixel_values": pixel_values, "pixel_mask": pixel_mask, "labels": [dict(item[1]) for item in batch]}
