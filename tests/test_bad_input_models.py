"""Bad input to the models' forwards and DETR's labels: a ValueError naming the
argument, and nothing changed (weights, and buffers such as BatchNorm running statistics:
models are in train mode, where a forward that got half-way would have updated them).

GPT-2's packed-input contract (cu_seqlens, n_positions of packed sequences) is covered by
its own tests; here are the inputs every GPT-2 call shares.
"""
import re

import pytest
import torch
from conftest import TINY

import fastzoo

VIT, GPT2 = TINY["vit"], TINY["gpt2"]
DET = {**TINY["detr"], "num_labels": 4}  # the class range [0, 4) that the labels 9 and -1 below fall outside
S, V, P = VIT["img_size"], GPT2["vocab_size"], GPT2["n_positions"]


def state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_refused(model, call, needle):
    before = state(model)
    with pytest.raises(ValueError, match=re.escape(needle)):
        call()
    after = model.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(after[k], v)]
    assert not changed, f"a refused call changed {changed[:4]}"


IMAGES = {
    "uint8": (lambda: torch.randint(0, 255, (2, 3, S, S), dtype=torch.uint8), "images are torch.uint8"),
    "int64": (lambda: torch.randint(0, 255, (2, 3, S, S)), "images are torch.int64"),
    "bool": (lambda: torch.ones(2, 3, S, S, dtype=torch.bool), "images are torch.bool"),
    "complex": (lambda: torch.randn(2, 3, S, S, dtype=torch.complex64), "images are torch.complex64"),
    "grey": (lambda: torch.randn(2, 1, S, S), "images have 1 channels"),
    "channels last (NHWC)": (lambda: torch.randn(2, S, S, 3), f"images have {S} channels"),
    "a video": (lambda: torch.randn(1, 2, 3, S, S), "images must be [B, C, H, W]"),
    "one image without a batch": (lambda: torch.randn(3, S, S), "images must be [B, C, H, W]"),
    "another size": (lambda: torch.randn(2, 3, S + 16, S + 16), f"images are {S + 16}x{S + 16}"),
}


IMAGE_MODELS = {
    "vit": lambda: fastzoo.create("vit_s16", **VIT),
    "resnet": lambda: fastzoo.create("resnet50", **TINY["resnet"]),
}


# a ResNet takes any image size (global average pooling)
@pytest.mark.parametrize("family,case", [(f, c) for f in IMAGE_MODELS for c in IMAGES
                                         if not (f == "resnet" and c == "another size")])
def test_bad_images_are_named_before_anything_runs(family, case):
    model = IMAGE_MODELS[family]().train()  # train mode: BatchNorm statistics would move if a layer ran
    make, needle = IMAGES[case]
    assert_refused(model, lambda: model(make()), needle)


def test_vit_empty_batch_gives_empty_logits():
    out = fastzoo.create("vit_s16", **VIT)(torch.randn(0, 3, S, S))
    assert out.shape == (0, VIT["num_classes"])


IDS = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
GPT2_BAD = {
    "ids past the vocabulary": (dict(input_ids=IDS + V), f"input_ids must lie in [0, {V})"),
    "negative ids": (dict(input_ids=IDS - V), f"input_ids must lie in [0, {V})"),
    "float ids": (dict(input_ids=IDS.float()), "input_ids must be an integer tensor"),
    "bool ids": (dict(input_ids=IDS > 3), "input_ids must be an integer tensor"),
    "1-d ids": (dict(input_ids=IDS[0]), "input_ids must be [B, S]"),
    "3-d ids": (dict(input_ids=IDS[None]), "input_ids must be [B, S]"),
    "longer than n_positions": (dict(input_ids=torch.zeros(1, P + 1, dtype=torch.long)), f"n_positions={P}"),
    "mask of another shape": (dict(input_ids=IDS, attention_mask=torch.ones(2, 7)), "attention_mask must be [2, 8]"),
    "mask of 2s": (dict(input_ids=IDS, attention_mask=torch.full((2, 8), 2)), "attention_mask must hold 0/1"),
    "positions past n_positions": (dict(input_ids=IDS, position_ids=torch.arange(8)[None] + P - 6),
                                   f"position_ids must lie in [0, {P})"),
    "positions of another shape": (dict(input_ids=IDS, position_ids=torch.arange(7)[None]), "position_ids must be"),
    "max_seqlen without cu_seqlens": (dict(input_ids=IDS, max_seqlen=8), "max_seqlen goes with cu_seqlens"),
}


@pytest.mark.parametrize("case", list(GPT2_BAD))
def test_gpt2_bad_inputs_are_named(case):
    model = fastzoo.create("gpt2", attn="eager", **GPT2).train()
    kwargs, needle = GPT2_BAD[case]
    assert_refused(model, lambda: model(**kwargs), needle)


BOX = torch.tensor([[0.3, 0.3, 0.4, 0.4]])  # cx, cy, w, h


def _labels(boxes, classes):
    return [{"class_labels": c, "boxes": b} for b, c in zip(boxes, classes)]


DET_BAD = {
    "a NaN box": (lambda: _labels([BOX * float("nan"), BOX], [torch.tensor([1]), torch.tensor([2])]),
                  "labels[0]['boxes'][0] = [nan, nan, nan, nan]: boxes must be finite"),
    "a negative width": (lambda: _labels([BOX * torch.tensor([1, 1, -1, 1]), BOX], [torch.tensor([1]), torch.tensor([2])]),
                         "(so w >= 0 and h >= 0)"),
    "3 coordinates": (lambda: _labels([BOX[:, :3], BOX], [torch.tensor([1]), torch.tensor([2])]),
                      "labels[0]['boxes'] must be a float [n, 4] tensor"),
    "a class past num_labels": (lambda: _labels([BOX, BOX], [torch.tensor([9]), torch.tensor([2])]),
                                "labels[0]['class_labels'][0] = 9: class ids must lie in [0, 4)"),
    "a negative class": (lambda: _labels([BOX, BOX], [torch.tensor([1]), torch.tensor([-1])]),
                         "labels[1]['class_labels'][0] = -1"),
    "more labels than boxes": (lambda: _labels([BOX, BOX], [torch.tensor([1, 2]), torch.tensor([2])]),
                               "labels[0]['class_labels'] must be an integer tensor of shape (1,)"),
    "float labels": (lambda: _labels([BOX, BOX], [torch.tensor([1.0]), torch.tensor([2.0])]),
                     "labels[0]['class_labels'] must be an integer tensor"),
    "labels for one image of two": (lambda: _labels([BOX], [torch.tensor([1])]), "labels must be a list of 2 dicts"),
    "a dict without boxes": (lambda: [{"class_labels": torch.tensor([1])}, {"class_labels": torch.tensor([1])}],
                             "labels[0] must be a dict with 'class_labels' [n] and 'boxes' [n, 4]"),
}


@pytest.mark.parametrize("case", list(DET_BAD))
def test_detr_bad_labels_are_named(case):
    model = fastzoo.create("detr", **DET).train()
    images = torch.randn(2, 3, 32, 32)
    assert_refused(model, lambda: model(pixel_values=images, labels=DET_BAD[case][0]()), DET_BAD[case][1])
