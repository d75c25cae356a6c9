"""torchvision checkpoints. fastzoo's ResNet uses torchvision's module names, so
conversion is a check that the keys are a bottleneck ResNet's, plus reading from the
weights what they fix of the architecture.

BatchNorm buffers: fastzoo's BatchNorm2d layers keep ``num_batches_tracked`` as
torchvision and timm do, and it goes out on export. Old checkpoints saved without it
(torchvision's first ImageNet files) get it as 0, which is what ``nn.BatchNorm2d`` itself
does when loading them; it only matters with ``momentum=None``, which no ResNet uses.
"""
from __future__ import annotations

import re

import torch

_BLOCK = re.compile(r"^layer(\d+)\.(\d+)\.conv1\.weight$")


class ResNetConverter:
    """Bottleneck ResNet (v1.5) state dicts: torchvision's and timm's are the same keys."""

    def __init__(self, format: str):
        self.format = format

    @staticmethod
    def matches(state: dict) -> bool:
        w = state.get("conv1.weight")  # a 7x7 stem: not timm's deep-stem variants (conv1.0 ...)
        return w is not None and w.ndim == 4 and w.shape[-1] == 7 and "layer1.0.conv3.weight" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        out = dict(state)
        for k in state:
            if k.endswith(".running_var"):
                out.setdefault(k[: -len("running_var")] + "num_batches_tracked", torch.tensor(0, dtype=torch.long))
        return out

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return dict(state)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        """Blocks per stage and stage widths (so ResNet-101/152 and slim variants load), input
        channels, and the classifier size (0 when the checkpoint has no ``fc``)."""
        depth: dict[int, int] = {}
        for k in state:
            m = _BLOCK.match(k)
            if m:
                stage, block = int(m[1]), int(m[2])
                depth[stage] = max(depth.get(stage, 0), block + 1)
        stages = sorted(depth)
        return {
            "num_classes": state["fc.weight"].shape[0] if "fc.weight" in state else 0,
            "layers": tuple(depth[s] for s in stages),
            "channels": tuple(state[f"layer{s}.0.conv2.weight"].shape[0] for s in stages),
            "in_chans": state["conv1.weight"].shape[1],
        }


RESNET = ResNetConverter("torchvision")
