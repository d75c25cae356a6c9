"""The ResNet family as the rest of fastzoo reads it: variants, converters, tiny config, the original."""
from __future__ import annotations

from torch import nn

from fastzoo.models.resnet import hf
from fastzoo.models.resnet.config import ResNetConfig, bottleneck_width
from fastzoo.models.resnet.convert import RESNET, TIMM_RESNET
from fastzoo.models.resnet.model import ResNet
from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload
from fastzoo.tasks import IMAGE_CLASSIFICATION

TORCHVISION_CHANNELS = (64, 128, 256, 512)  # torchvision's stage widths (its ResNet has no argument for them)


def torchvision_resnet(cfg: dict) -> nn.Module:
    """torchvision's ``ResNet`` on fastzoo config fields (torchvision's names: block, layers,
    groups, width_per_group, num_classes; ``output_stride`` as its ``replace_stride_with_dilation``),
    or timm's where torchvision has none: basic blocks dilated (``output_stride`` 16 / 8)."""
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet as TorchvisionResNet

    c = ResNetConfig.from_dict(cfg)
    if c.hf_config is not None:  # a transformers ResNet (microsoft/resnet-*): its own class is the original
        return hf.build(c)
    if c.channels != TORCHVISION_CHANNELS or c.in_chans != 3 or not c.torchvision_shaped:
        raise ValueError(f"channels={c.channels}, in_chans={c.in_chans}: torchvision's ResNet has the stage widths "
                         f"{TORCHVISION_CHANNELS} and 3 input channels")
    dilate = [stride == 1 for stride, _, _ in c.stage_geometry()[1:]]  # torchvision's per stage after the first
    if c.block == "basic" and any(dilate):  # torchvision's BasicBlock has no dilation; timm's has
        import timm.models.resnet

        return timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, list(c.layers), num_classes=c.num_classes,
                                         global_pool=c.global_pool, output_stride=c.output_stride,
                                         zero_init_last=False)
    if c.num_classes == 0:  # torchvision builds Linear(C, 0): empty logits, where fastzoo (as timm) returns the features
        raise ValueError("num_classes=0: torchvision's ResNet has no headless form (it builds a head with 0 outputs); "
                         "fastzoo's returns the pooled features, as timm's")
    block = BasicBlock if c.block == "basic" else Bottleneck
    return TorchvisionResNet(block, list(c.layers), num_classes=c.num_classes, groups=c.groups,
                             width_per_group=c.width_per_group, replace_stride_with_dilation=dilate)


def flops(cfg, *, batch: int, img_size: int, train: bool = True) -> int:
    """Conv and fc FLOPs of one step on ``batch`` square images (2 per multiply-add; grouped
    convs count their own channels only)."""
    side = img_size // 4  # after the stride-2 stem and the max-pool
    stem = cfg.stem
    total = 2 * (img_size // 2) ** 2 * cfg.in_chans * stem * 49
    inplanes = stem
    for stage, (blocks, planes, (first, _, _)) in enumerate(zip(cfg.layers, cfg.channels, cfg.stage_geometry())):
        out = cfg.stage_out(stage)
        for b in range(blocks):
            stride = first if b == 0 else 1
            out_side = side // stride
            if cfg.block == "basic":
                total += 2 * out_side**2 * 9 * (inplanes * planes + planes * planes)  # two 3x3 (stride on the first)
            else:
                width = bottleneck_width(planes, cfg.groups, cfg.width_per_group)
                total += 2 * side**2 * inplanes * width  # conv1 1x1 (before the stride)
                total += 2 * out_side**2 * width * (width // cfg.groups) * 9  # conv2 3x3, grouped
                total += 2 * out_side**2 * width * out  # conv3 1x1
            if b == 0 and (stride != 1 or inplanes != out):
                total += 2 * out_side**2 * inplanes * out  # downsample 1x1
            inplanes, side = out, out_side
    total += 2 * inplanes * cfg.num_classes
    return batch * total * (3 if train else 1)


def _variant(name: str, layers: tuple[int, ...], what: str, block: str = "bottleneck", groups: int = 1,
             width_per_group: int = 64) -> Variant:
    config = dict(block=block, layers=layers, channels=TORCHVISION_CHANNELS, groups=groups,
                  width_per_group=width_per_group)
    return Variant(name, config, f"{what}, as torchvision's and timm's {name}", f"torchvision {name} / timm {name}",
                   timm=name)


def _hf_variant(depth: int, block: str, layers: tuple[int, ...]) -> Variant:
    """transformers' ``microsoft/resnet-N`` (``ResNetForImageClassification``, ImageNet-1k): torchvision's network."""
    expansion = 4 if block == "bottleneck" else 1
    hf = {"architectures": ["ResNetForImageClassification"], "model_type": "resnet", "layer_type": block,
          "depths": list(layers), "hidden_sizes": [c * expansion for c in TORCHVISION_CHANNELS], "embedding_size": 64,
          "num_labels": 1000}
    config = dict(block=block, layers=layers, channels=TORCHVISION_CHANNELS, hf_config=hf)
    name = f"microsoft/resnet-{depth}"
    return Variant(name, config, f"ResNet-{depth} ({block} blocks): transformers' {name}",
                   f"transformers ResNetForImageClassification ({name})", timm=f"resnet{depth}")


SPEC = ModelSpec(
    family="resnet",
    task=IMAGE_CLASSIFICATION,
    model=ResNet,
    variants=(
        _variant("resnet18", (2, 2, 2, 2), "ResNet-18 (basic blocks)", block="basic"),
        _variant("resnet34", (3, 4, 6, 3), "ResNet-34 (basic blocks)", block="basic"),
        _variant("resnet50", (3, 4, 6, 3), "ResNet-50 (bottleneck v1.5)"),
        _variant("resnet101", (3, 4, 23, 3), "ResNet-101 (bottleneck v1.5)"),
        _variant("resnet152", (3, 8, 36, 3), "ResNet-152 (bottleneck v1.5)"),
        _variant("wide_resnet50_2", (3, 4, 6, 3), "Wide ResNet-50-2 (bottleneck 3x3 twice as wide)", width_per_group=128),
        _variant("wide_resnet101_2", (3, 4, 23, 3), "Wide ResNet-101-2 (bottleneck 3x3 twice as wide)",
                 width_per_group=128),
        _variant("resnext50_32x4d", (3, 4, 6, 3), "ResNeXt-50 32x4d (3x3 in 32 groups of 4)", groups=32,
                 width_per_group=4),
        _variant("resnext101_32x8d", (3, 4, 23, 3), "ResNeXt-101 32x8d (3x3 in 32 groups of 8)", groups=32,
                 width_per_group=8),
        _variant("resnext101_64x4d", (3, 4, 23, 3), "ResNeXt-101 64x4d (3x3 in 64 groups of 4)", groups=64,
                 width_per_group=4),
        *(_hf_variant(d, block, layers) for d, block, layers in (
            (18, "basic", (2, 2, 2, 2)), (26, "bottleneck", (2, 2, 2, 2)), (34, "basic", (3, 4, 6, 3)),
            (50, "bottleneck", (3, 4, 6, 3)), (101, "bottleneck", (3, 4, 23, 3)), (152, "bottleneck", (3, 8, 36, 3)))),
    ),
    converters=(RESNET, TIMM_RESNET, hf.HF_RESNET),
    tiny=dict(layers=(1, 1, 1, 1), num_classes=10),
    original=Original(torchvision_resnet, "torchvision ResNet"),
    shallow=lambda cfg: {**cfg, "layers": (1,) * len(cfg.get("layers", (3, 4, 6, 3)))},
    flops=flops,
    bench=BenchSettings(
        variant="resnet50", library="torchvision", channels_last=True,
        sizes={"bench": Workload("", batch=8, img_size=224), "tour": Workload("ResNet-50 at 160 px", batch=8, img_size=160),
               "quick": Workload("ResNet, 1 block a stage, 64 px", dict(layers=(1, 1, 1, 1)), batch=2, img_size=64)}),
)
SPECS = (SPEC,)
