#!/usr/bin/env python
"""Fine-tune any fastzoo image classifier (ViT, ResNet, ...) on an image folder (or a synthetic task).

    # ImageFolder layout: DATA/train/<class>/*.jpg and optionally DATA/val/<class>/*.jpg
    python scripts/finetune_image_classification.py --model vit_b16 --pretrained vit_b16.safetensors \\
        --data-dir DATA --num-classes 37 --attn flex --amp bf16 --epochs 5 -b 128 --lr 3e-4
    torchrun --nproc_per_node 8 scripts/finetune_image_classification.py ...   # same global batch, DDP

    # no data at hand: a learnable synthetic task (class = a noisy colour pattern)
    python scripts/finetune_image_classification.py --synthetic 512 --model-kwargs img_size=32 patch_size=8 depth=2
    python scripts/finetune_image_classification.py --model resnet18 --synthetic 512 --img-size 32

The recipe comes from the model: its image size (a ViT's ``img_size``; else ``--img-size`` or the
size and normalisation of its timm ``pretrained_cfg``), attention backend (``--attn``, for models
with attention). A new head is created when ``--num-classes`` differs from the checkpoint's. Top-1 accuracy
on the validation split is printed after every epoch. Checkpoints are directories timm reads
(``pretrained_cfg_overlay=dict(file=...)``) as well as ``pretrained=`` sources. Everything else
(--resume, NaN capture and --replay, torchrun) is fastzoo.train's; see --help.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from fastzoo.tasks import IMAGE_CLASSIFICATION
from fastzoo.train import Task, UsageError, parse_args, run_main, setup, train, train_parser
from fastzoo.train.cli import create_model, positive_int


class SyntheticImages(Dataset):
    """Image ``i`` shows class ``(first + i) % num_classes``: a random 4x4 colour pattern of that
    class (drawn from ``seed``: the task), upsampled, plus noise drawn from (seed, first + i). A held-out
    split is the same task from another ``first``: the same patterns, other noise. The same (seed,
    first + i) gives the same image in any process."""

    def __init__(self, n: int, num_classes: int, img_size: tuple[int, int], seed: int, first: int = 0,
                 noise: float = 0.5):
        g = torch.Generator().manual_seed(seed)
        self.patterns = F.interpolate(torch.randn(num_classes, 3, 4, 4, generator=g), size=img_size, mode="nearest")
        self.n, self.num_classes, self.seed, self.first, self.noise = n, num_classes, seed, first, noise

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        i = self.first + i
        label = i % self.num_classes
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return self.patterns[label] + self.noise * torch.randn(self.patterns.shape[1:], generator=g), label


def synthetic_splits(n: int, num_classes: int, img_size, seed: int) -> tuple[SyntheticImages, SyntheticImages]:
    """``--synthetic N``: N training images and N / 4 held out, of one task (the same class patterns)."""
    return (SyntheticImages(n, num_classes, img_size, seed),
            SyntheticImages(max(1, n // 4), num_classes, img_size, seed, first=n))


def image_folder(root: Path, split: str, img_size, mean, std, train: bool):
    from torchvision import datasets, transforms

    h, w = img_size
    if train:
        tf = [transforms.RandomResizedCrop((h, w)), transforms.RandomHorizontalFlip()]
    else:
        tf = [transforms.Resize(int(h / 0.875)), transforms.CenterCrop((h, w))]
    tf += [transforms.ToTensor(), transforms.Normalize(mean, std)]
    try:
        return datasets.ImageFolder(str(root / split), transform=transforms.Compose(tf))
    except (FileNotFoundError, OSError) as e:
        raise UsageError(f"--data-dir {root}: cannot read {root / split} as an image folder: {e}") from e


def recipe(model, args) -> tuple[tuple[int, int], tuple, tuple]:
    """Image size (h, w) and normalisation of ``model``: a fixed size in its config wins (a ViT's
    position table), then ``--img-size``, then its timm ``pretrained_cfg``; mean and std from the
    flags, else from the ``pretrained_cfg`` (every image classifier carries one)."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    fixed = getattr(model.config, "img_size", None)
    if fixed is not None and args.img_size is not None and _pair(fixed) != _pair(args.img_size):
        raise UsageError(f"--img-size {args.img_size}: {args.model} takes {_pair(fixed)} images (its img_size); "
                         f"set it with --model-kwargs img_size=...")
    side = fixed or args.img_size or tuple(cfg.get("input_size", (3, 224, 224))[1:])
    mean = tuple(args.mean or cfg.get("mean", (0.5, 0.5, 0.5)))
    std = tuple(args.std or cfg.get("std", (0.5, 0.5, 0.5)))
    return _pair(side), mean, std


def _pair(size) -> tuple[int, int]:
    return tuple(size) if isinstance(size, (tuple, list)) else (size, size)


def build_parser():
    p = train_parser(__doc__.splitlines()[1], model_default="vit_s16")
    g = p.add_argument_group("data")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--data-dir", type=Path, help="ImageFolder root with train/ and optionally val/")
    src.add_argument("--synthetic", type=positive_int, metavar="N", help="N synthetic training images (N/4 for eval)")
    g.add_argument("--num-classes", type=positive_int, default=None,
                   help="classifier size (default: the image folder's class count, 10 for --synthetic)")
    g.add_argument("--smoothing", type=float, default=0.1, help="label smoothing")
    g.add_argument("--img-size", type=positive_int, default=None,
                   help="image side for a model without a fixed size (a convnet; default: its pretrained_cfg's)")
    g.add_argument("--mean", type=float, nargs=3, default=None, help="normalisation mean (default: the model's pretrained_cfg)")
    g.add_argument("--std", type=float, nargs=3, default=None, help="normalisation std (default: the model's pretrained_cfg)")
    g.add_argument("--channels-last", action="store_true", help="NHWC images and conv weights (faster patch embed on GPU)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.data_dir is None and args.synthetic is None:
        parser.error("give the data: --data-dir DIR (ImageFolder layout) or --synthetic N")
    if args.data_dir is not None and not (args.data_dir / "train").is_dir():
        raise UsageError(f"--data-dir {args.data_dir}: no train/ folder there (expected DATA/train/<class>/<image>)")
    world = setup(args)

    train_set = eval_set = None
    if args.data_dir is not None and args.replay is None:
        # Classes come from train/ before the model is built, so the head can be sized from them.
        from torchvision import datasets

        classes = datasets.folder.find_classes(str(args.data_dir / "train"))[0]
        if args.num_classes is not None and args.num_classes != len(classes):
            raise UsageError(f"--num-classes {args.num_classes}, but {args.data_dir / 'train'} has {len(classes)} classes")
        args.num_classes = len(classes)
    num_classes = args.num_classes or 10
    model = create_model(args, device=world.device, task=IMAGE_CLASSIFICATION, num_classes=num_classes)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    img_size, mean, std = recipe(model, args)

    if args.replay is None:
        if args.synthetic:
            train_set, eval_set = synthetic_splits(args.synthetic, num_classes, img_size, args.seed)
        else:
            train_set = image_folder(args.data_dir, "train", img_size, mean, std, train=True)
            val = next((s for s in ("val", "validation") if (args.data_dir / s).is_dir()), None)
            eval_set = image_folder(args.data_dir, val, img_size, mean, std, train=False) if val else None

    def images(batch):
        x = batch[0]
        return x.contiguous(memory_format=torch.channels_last) if args.channels_last else x

    def loss(model, batch):
        logits = model(images(batch))
        return F.cross_entropy(logits.float(), batch[1], reduction="sum", label_smoothing=args.smoothing), batch[1].numel()

    def eval_step(model, batch):
        logits = model(images(batch)).float()
        n = batch[1].numel()
        return {"loss": (F.cross_entropy(logits, batch[1], reduction="sum"), n),
                "top1": ((logits.argmax(-1) == batch[1]).sum() * 100.0, n)}

    task = Task(model=model, train_items=train_set, collate=torch.utils.data.default_collate, loss=loss,
                eval_items=eval_set, eval_step=eval_step, unit="img")
    return train(args, task, world)


if __name__ == "__main__":
    run_main(main)
