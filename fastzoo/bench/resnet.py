"""ResNet-50: fastzoo vs torchvision on the same weights; channels_last and bf16 autocast on/off.

Each setting's reference is torchvision in fp32 with the same memory format (channels_last
convolutions sum in another order); bf16 rows are held to 3x torchvision's own bf16 error.
"""
from __future__ import annotations

import copy
from functools import cache

import torch

import fastzoo
from fastzoo.bench.harness import Case, Group, Suite
from fastzoo.bench.steps import check_mode, classification_loss, model_step


class _Autocast(torch.nn.Module):
    """Runs the wrapped model under bf16 autocast (how CNNs are trained in bf16)."""

    def __init__(self, model, device_type: str):
        super().__init__()
        self.model = model
        self.device_type = device_type

    def forward(self, x):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.model(x)

    def named_parameters(self, *a, **k):
        return self.model.named_parameters(*a, **k)


def resnet_suite(*, modes=("eval", "train"), compile_modes=(False,), channels_last=(False, True), bf16=(False, True),
                 batch_size: int = 8, img_size: int = 224, device="cpu", seed: int = 0) -> Suite:
    device = torch.device(device)
    config = {"model": f"ResNet-50 at {img_size}x{img_size}", "batch size": batch_size,
              "peer": "torchvision.models.resnet50", "bf16": "torch.autocast(bfloat16)"}
    missing = needs()
    if missing:
        return Suite("resnet50", [], config=config, device=device, skipped=missing)
    from torchvision.models import resnet50

    torch.manual_seed(seed)
    tv = resnet50()
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, img_size, img_size, generator=g)
    labels = torch.randint(0, 1000, (batch_size,), generator=g).to(device)
    loss = classification_loss(labels)

    def prepare(model, cl, low):
        model = model.to(device)
        if cl:
            model = model.to(memory_format=torch.channels_last)
        return _Autocast(model, device.type) if low else model

    def step(model, mode, compiled, cl, low):
        x = images.to(device, memory_format=torch.channels_last if cl else torch.contiguous_format)
        return model_step(prepare(model, cl, low), (x,), mode=mode, loss=loss, items=batch_size, compile=compiled)

    @cache
    def reference(mode, cl):  # fp32 torchvision in the same memory format: channels_last changes summation order
        return step(copy.deepcopy(tv), mode, False, cl, False).outputs()

    groups = []
    for mode in map(check_mode, modes):
        for compiled in compile_modes:
            for cl in channels_last:
                for low in bf16:
                    c = compiled
                    cases = [
                        Case("torchvision", lambda m=mode, c=c, cl=cl, low=low: step(copy.deepcopy(tv), m, c, cl, low),
                             peer=True, reference=True, compiled=c),
                        Case("fastzoo", lambda m=mode, c=c, cl=cl, low=low: step(
                            fastzoo.create("resnet50", pretrained=tv), m, c, cl, low), compiled=c),
                    ]
                    name = f"{mode} | {'channels_last' if cl else 'NCHW'} | {'bf16' if low else 'fp32'}"
                    groups.append(Group(name + (" | compiled" if c else ""), cases, reference=lambda m=mode, cl=cl: reference(m, cl),
                                        dtype=torch.bfloat16 if low else torch.float32))
    return Suite("resnet50", groups, config=config, device=device)
