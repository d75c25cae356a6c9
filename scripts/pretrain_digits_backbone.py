#!/usr/bin/env python
"""Write the detector an accuracy run file starts from, its backbone trained on the training digits
(the file's ``pretrain``), as a checkpoint directory that scripts/finetune_detection.py and
transformers' ``from_pretrained`` read: the user's path to configs/accuracy_digits_detr_learns.yaml's
starting point, as an ImageNet checkpoint is to a COCO fine-tune.

    python scripts/pretrain_digits_backbone.py --config configs/accuracy_digits_detr_learns.yaml --out detr-digits
    python scripts/make_digits_coco.py --out digits_coco
    python scripts/finetune_detection.py --pretrained detr-digits --train-images digits_coco/train \\
        --train-ann digits_coco/train.json --val-images digits_coco/val --val-ann digits_coco/val.json --img-size 64
"""
from __future__ import annotations

from pathlib import Path

import torch

from fastzoo.accuracy.config import load_config
from fastzoo.accuracy.runs import initial_original, parity_data
from fastzoo.errors import UsageError
from fastzoo.text import ArgumentParser
from fastzoo.train.cli import run_main


def main(argv=None) -> int:
    import fastzoo

    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--config", type=Path, required=True, help="an accuracy run file with a pretrain section")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write (save_pretrained)")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the run file, dotted: pretrain.steps=100")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.assignments)
    if cfg.pretrain is None:
        raise UsageError(f"--config {args.config}: the run file has no pretrain section: nothing to train")
    original, done = initial_original(cfg, parity_data(cfg, "cpu"))
    fastzoo.create(cfg.model, pretrained=original).save_pretrained(args.out)
    print(f"wrote {args.out}: {cfg.model} with its backbone trained {cfg.pretrain.steps} steps on the training digits "
          f"({100 * done['accuracy']:.0f}% on the last batch, {done['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    run_main(main)
