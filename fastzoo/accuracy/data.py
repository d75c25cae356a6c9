"""Data for the accuracy-parity runs: real data that ships inside installed packages (nothing is
downloaded), and one synthetic task.

- :func:`digits`: scikit-learn's handwritten digits (``sklearn.datasets.load_digits``: 1,797
  8x8 greyscale scans from the UCI "Optical Recognition of Handwritten Digits" set),
  upsampled for a ViT / ResNet and split into train and test with a seed.
- :func:`digits_canvas`: the same digits placed on a larger canvas, each with its tight box
  and class: a small detection set (train canvases from train digits, test from test digits).
- :func:`digits_coco`: those canvases written as a COCO-format set (PNG images and instances JSON,
  train and held-out), for ``scripts/finetune_detection.py`` and any COCO reader.
- :func:`quadrants`: synthetic noisy images with one quadrant brightened; the label is the quadrant.
- :func:`pydoc_documents`: English text shipped inside Python (``pydoc_data.topics``, the
  language reference pages ``help()`` prints), split into paragraphs; :func:`bpe_tokenizer`
  trains a byte-level BPE on it offline with Hugging Face ``tokenizers``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

EOS = "<|endoftext|>"


@dataclass
class Split:
    x: torch.Tensor
    y: torch.Tensor


def _digit_scans(seed: int, test_fraction: float):
    """[N, 8, 8] in [0, 1] and labels, shuffled with ``seed`` and split (train, test)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = int(round(len(y) * test_fraction))
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def digits(img_size: int = 32, *, test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """(train, test): images ``[N, 3, img_size, img_size]`` normalised to mean 0 / std 1 scale
    ((x - 0.5) / 0.5, timm's ViT convention), bilinear upsampling, labels 0-9."""
    out = []
    for x, y in _digit_scans(seed, test_fraction):
        x = F.interpolate(x[:, None], size=(img_size, img_size), mode="bilinear", align_corners=False)
        out.append(Split(((x - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous(), y))
    return out[0], out[1]


def quadrants(n: int, g: torch.Generator, img_size: int = 32) -> Split:
    """Noisy images (unit Gaussian) with one quadrant brightened by 1; the label is the quadrant.
    It needs the position embedding and attention across patches; a small ViT learns it in ~300 steps."""
    labels = torch.randint(0, 4, (n,), generator=g)
    images = torch.randn(n, 3, img_size, img_size, generator=g)
    half = img_size // 2
    for i, q in enumerate(labels.tolist()):
        r0, c0 = (q // 2) * half, (q % 2) * half
        images[i, :, r0:r0 + half, c0:c0 + half] += 1.0
    return Split(images, labels)


@dataclass
class Canvases:
    images: torch.Tensor  # [N, 3, S, S], (x - 0.5) / 0.5
    boxes: list  # per canvas: [n_i, 4] xyxy in [0, 1]
    labels: list  # per canvas: [n_i] digit classes


def _place(scans, labels, n: int, canvas: int, max_digits: int, digit_px: tuple[int, int], g: torch.Generator) -> Canvases:
    images = torch.zeros(n, 1, canvas, canvas)
    boxes, classes = [], []
    for i in range(n):
        k = int(torch.randint(1, max_digits + 1, (1,), generator=g))
        placed, labs = [], []
        for _ in range(k * 20):  # rejection sampling of non-overlapping places
            if len(placed) == k:
                break
            s = int(torch.randint(digit_px[0], digit_px[1] + 1, (1,), generator=g))
            x0, y0 = (int(v) for v in torch.randint(0, canvas - s + 1, (2,), generator=g))
            box = (x0, y0, x0 + s, y0 + s)
            if any(not (box[2] <= b[0] or b[2] <= box[0] or box[3] <= b[1] or b[3] <= box[1]) for b in placed):
                continue
            j = int(torch.randint(0, len(labels), (1,), generator=g))
            digit = F.interpolate(scans[j][None, None], size=(s, s), mode="bilinear", align_corners=False)[0, 0].clamp(0, 1)
            images[i, 0, y0:y0 + s, x0:x0 + s] = torch.maximum(images[i, 0, y0:y0 + s, x0:x0 + s], digit)
            ink_r, ink_c = (digit > 0.25).any(1).nonzero()[:, 0], (digit > 0.25).any(0).nonzero()[:, 0]
            tight = (x0 + int(ink_c.min()), y0 + int(ink_r.min()), x0 + int(ink_c.max()) + 1, y0 + int(ink_r.max()) + 1)
            placed.append(box)
            labs.append((tight, int(labels[j])))
        boxes.append(torch.tensor([t for t, _ in labs], dtype=torch.float32) / canvas)
        classes.append(torch.tensor([c for _, c in labs], dtype=torch.long))
    return Canvases(((images - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous(), boxes, classes)


def digits_canvas(n_train: int, n_test: int, *, canvas: int = 64, max_digits: int = 3, digit_px=(14, 24),
                  test_fraction: float = 0.2, seed: int = 0) -> tuple[Canvases, Canvases]:
    """(train, test) canvases: 1..``max_digits`` non-overlapping digits each, scaled to
    ``digit_px`` pixels; boxes are the ink's tight extent (pixels above 0.25), classes 0-9."""
    (trx, try_), (tex, tey) = _digit_scans(seed, test_fraction)
    g = torch.Generator().manual_seed(seed + 1)
    return (_place(trx, try_, n_train, canvas, max_digits, tuple(digit_px), g),
            _place(tex, tey, n_test, canvas, max_digits, tuple(digit_px), g))


def digits_coco(out_dir, n_train: int, n_test: int, *, canvas: int = 64, max_digits: int = 3, digit_px=(14, 24),
                test_fraction: float = 0.2, seed: int = 0) -> dict:
    """:func:`digits_canvas`'s canvases as a COCO-format set under ``out_dir``: ``train/`` with
    ``train.json`` and ``val/`` with ``val.json`` (held-out canvases of held-out digits), greyscale
    PNGs (the canvases' pixels to 8 bits), the boxes in pixels, categories ``0``..``9`` named by
    their digit. Returns the four paths by name."""
    from pathlib import Path

    from fastzoo.data.boxes import write_coco

    out = Path(out_dir)
    splits = digits_canvas(n_train, n_test, canvas=canvas, max_digits=max_digits, digit_px=digit_px,
                           test_fraction=test_fraction, seed=seed)
    paths = {}
    for name, c in zip(("train", "val"), splits):
        pixels = ((c.images[:, :1] * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8)
        write_coco(out / name, out / f"{name}.json", list(pixels), [b * canvas for b in c.boxes], c.labels,
                   {d: str(d) for d in range(10)})
        paths[f"{name}_images"], paths[f"{name}_ann"] = out / name, out / f"{name}.json"
    return paths


def pydoc_documents(min_chars: int = 40) -> list[str]:
    """The paragraphs of Python's own help pages (``pydoc_data.topics``), in topic order."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        docs += [p.strip() for p in topics[key].split("\n\n") if len(p.strip()) >= min_chars]
    return docs


def bpe_tokenizer(texts: list[str], vocab_size: int = 1024):
    """A byte-level BPE (GPT-2's scheme) trained here on ``texts``, end-of-text ``<|endoftext|>``,
    as a ``transformers.PreTrainedTokenizerFast`` (``save_pretrained`` gives a local tokenizer dir)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
