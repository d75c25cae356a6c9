"""The ResNet family as the rest of fastzoo reads it: variants, converters, tiny config, the original."""
from __future__ import annotations

from torch import nn

from fastzoo.models.resnet.convert import RESNET, TIMM_RESNET
from fastzoo.models.resnet.model import ResNet
from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload


def torchvision_resnet(cfg: dict) -> nn.Module:
    """torchvision's ResNet (bottleneck v1.5) on fastzoo config fields."""
    from torchvision.models.resnet import Bottleneck, ResNet as TorchvisionResNet

    if tuple(cfg.get("channels", (64, 128, 256, 512))) != (64, 128, 256, 512):
        raise ValueError(f"channels={cfg['channels']}: torchvision's ResNet has the stage widths 64, 128, 256, 512")
    return TorchvisionResNet(Bottleneck, list(cfg.get("layers", (3, 4, 6, 3))), num_classes=cfg.get("num_classes", 1000))


def flops(cfg, *, batch: int, img_size: int, train: bool = True) -> int:
    """Conv and fc FLOPs of one step on ``batch`` square images (2 per multiply-add)."""
    side = img_size // 4  # after the stride-2 stem and the max-pool
    total = 2 * (img_size // 2) ** 2 * cfg.in_chans * 64 * 49
    inplanes = 64
    for stage, (blocks, width) in enumerate(zip(cfg.layers, cfg.channels)):
        for b in range(blocks):
            stride = 2 if b == 0 and stage > 0 else 1
            out_side = side // stride
            total += 2 * side**2 * inplanes * width  # conv1 1x1 (before the stride)
            total += 2 * out_side**2 * width * width * 9  # conv2 3x3
            total += 2 * out_side**2 * width * width * 4  # conv3 1x1
            if b == 0:
                total += 2 * out_side**2 * inplanes * width * 4  # downsample
            inplanes, side = width * 4, out_side
    total += 2 * inplanes * cfg.num_classes
    return batch * total * (3 if train else 1)


SPEC = ModelSpec(
    family="resnet",
    task="image-classification",
    model=ResNet,
    variants=(
        Variant("resnet50", dict(layers=(3, 4, 6, 3), channels=(64, 128, 256, 512)),
                "ResNet-50 (bottleneck v1.5), as torchvision's and timm's resnet50", "torchvision resnet50 / timm resnet50",
                timm="resnet50"),
    ),
    converters=(RESNET, TIMM_RESNET),
    tiny=dict(layers=(1, 1, 1, 1), num_classes=10),
    original=Original(torchvision_resnet, "torchvision ResNet"),
    shallow=lambda cfg: {**cfg, "layers": (1,) * len(cfg.get("layers", (3, 4, 6, 3)))},
    flops=flops,
    bench=BenchSettings(
        variant="resnet50", library="torchvision", channels_last=True,
        sizes={"bench": Workload("", batch=8, img_size=224), "tour": Workload("ResNet-50 at 160 px", batch=4, img_size=160),
               "quick": Workload("ResNet, 1 block a stage, 64 px", dict(layers=(1, 1, 1, 1)), batch=2, img_size=64)}),
)
SPECS = (SPEC,)
