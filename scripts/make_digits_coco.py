#!/usr/bin/env python
"""Write a small COCO-format detection set of real handwritten digits (scikit-learn's ``load_digits``
scans pasted on canvases, each with its tight box and class; the held-out canvases use held-out
digits only), for scripts/finetune_detection.py or any COCO reader:

    python scripts/make_digits_coco.py --out digits_coco --n-train 2000 --n-val 256 --canvas 64
    python scripts/finetune_detection.py --train-images digits_coco/train --train-ann digits_coco/train.json \\
        --val-images digits_coco/val --val-ann digits_coco/val.json --img-size 64 ...
"""
from __future__ import annotations

from pathlib import Path

from fastzoo.accuracy.data import digits_coco
from fastzoo.text import ArgumentParser, positive_int
from fastzoo.train.cli import run_main


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--out", type=Path, required=True, help="directory to write train/, train.json, val/, val.json in")
    p.add_argument("--n-train", type=positive_int, default=2000, help="training canvases")
    p.add_argument("--n-val", type=positive_int, default=256, help="held-out canvases")
    p.add_argument("--canvas", type=positive_int, default=64, help="canvas side in pixels")
    p.add_argument("--max-digits", type=positive_int, default=3, help="digits per canvas: 1 to this")
    p.add_argument("--digit-px", type=positive_int, nargs=2, default=(14, 24), metavar=("MIN", "MAX"),
                   help="a digit's side in pixels, drawn in [MIN, MAX]")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.digit_px[0] <= args.digit_px[1] <= args.canvas:
        p.error(f"--digit-px {args.digit_px[0]} {args.digit_px[1]}: need MIN <= MAX <= --canvas ({args.canvas})")
    paths = digits_coco(args.out, args.n_train, args.n_val, canvas=args.canvas, max_digits=args.max_digits,
                        digit_px=tuple(args.digit_px), seed=args.seed)
    print(f"wrote {args.n_train} training canvases to {paths['train_images']} ({paths['train_ann']}) and "
          f"{args.n_val} held-out canvases to {paths['val_images']} ({paths['val_ann']})")
    return 0


if __name__ == "__main__":
    run_main(main)
