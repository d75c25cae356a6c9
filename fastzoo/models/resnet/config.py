"""ResNet config: torchvision ``ResNet``'s sizes under torchvision's and timm's field names."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide
from fastzoo.models.resnet.hf_config import check as check_hf_config

EXPANSION = {"basic": 1, "bottleneck": 4}  # a block's output channels per unit of its stage's ``channels``


def bottleneck_width(planes: int, groups: int, width_per_group: int) -> int:
    """Channels of a bottleneck's 3x3 conv: torchvision's ``int(planes * width_per_group / 64) * groups``."""
    return int(planes * (width_per_group / 64.0)) * groups


def stage_geometry(stages: int, output_stride: int = 32) -> list[tuple[int, int, int]]:
    """Per stage: its first block's stride, the stage's dilation, and the dilation of the first
    block's strided 3x3 (the previous stage's): timm's ``make_blocks`` rule, torchvision's too (its
    ``previous_dilation``). The net strides 4 after the stem; each later stage halves the map until
    the net reaches ``output_stride``, after which a stage dilates by 2 instead (32: never)."""
    out, net, dilation = [], 4, 1
    for i in range(stages):
        stride, previous = (1 if i == 0 else 2), dilation
        if output_stride != 32 and net >= output_stride:
            stride, dilation = 1, dilation * stride
        net *= stride
        out.append((stride, dilation, previous))
    return out


@dataclass
class ResNetConfig(ModelConfig):
    """torchvision / timm ResNet fields; each field's kind, meaning and constraint is declared with it."""

    num_classes: int = weights_decide(1000, "classifier outputs; 0: fc is the identity, forward returns the pooled features",
                                      ge=0)
    global_pool: str = changes_function("avg", "pooling before fc: 'avg', or '' (none: forward_head returns the "
                                        "feature map; needs num_classes=0)", choices=("avg", ""))
    block: str = weights_decide("bottleneck", "residual block: 'basic' (two 3x3, ResNet-18/34) or 'bottleneck' "
                                "(1x1, 3x3, 1x1; v1.5: the stride on the 3x3)", choices=tuple(EXPANSION))
    layers: tuple[int, ...] = weights_decide((3, 4, 6, 3), "blocks per stage (ResNet-50)", ge=1, le=MAX_BLOCKS)
    channels: tuple[int, ...] = weights_decide((64, 128, 256, 512), "stage width (timm's name, torchvision's "
                                               "planes): a stage outputs channels x 1 (basic) or x 4 (bottleneck)", ge=1)
    groups: int = weights_decide(1, "groups of each bottleneck's 3x3 conv (ResNeXt's cardinality; timm: "
                                 "cardinality); basic blocks: 1", ge=1)
    width_per_group: int = weights_decide(64, "a bottleneck's 3x3 conv has int(channels * width_per_group / 64) "
                                          "* groups channels (timm: base_width; 128: Wide ResNet); basic blocks: 64",
                                          ge=1)
    in_chans: int = weights_decide(3, "image channels", ge=1)
    output_stride: int = changes_function(32, "the feature map's stride (timm's): 32, each later stage's first block "
                                          "strided; 16 / 8, the stages past that stride dilated instead (torchvision's "
                                          "replace_stride_with_dilation=[False, False, True] / [False, True, True])",
                                          choices=(8, 16, 32))
    stem_width: int | None = weights_decide(None, "the stem conv's output channels; None: channels[0] (torchvision's; "
                                            "transformers' embedding_size may differ)", ge=1)
    out_channels: tuple[int, ...] | None = weights_decide(None, "each stage's output channels; None: channels x 1 (basic) "
                                                          "or x 4 (bottleneck), torchvision's; transformers' hidden_sizes "
                                                          "need not be", ge=1)
    channels_last: bool = free(False, "NHWC parameters and activations (faster convs on GPU)")
    zero_init_residual: bool = free(False, "init each block's last BN to 0 (init only)")
    frozen_bn: bool = free(False, "BN uses running statistics in train mode too, affine not trained (FrozenBatchNorm2d)")
    hf_config: dict | None = free(None, "the transformers config this model came from or stands in for (its class, "
                                  "labels, problem_type): the labels= loss rule and the save_pretrained format follow it; "
                                  "refused where its class is another network than the other fields'")

    def validate(self):
        if len(self.layers) != len(self.channels) or not self.layers:
            raise ConfigError(f"layers={self.layers} and channels={self.channels} must have the same, nonzero length",
                              fields=("layers", "channels"))
        if self.global_pool == "" and self.num_classes:
            raise ConfigError(f"global_pool='' (no pooling) needs num_classes=0, got num_classes={self.num_classes}",
                              fields=("global_pool", "num_classes"))
        if self.out_channels is not None and (len(self.out_channels) != len(self.channels) or (
                self.block == "basic" and tuple(self.out_channels) != tuple(self.channels))):
            raise ConfigError(f"out_channels={self.out_channels}: one per stage ({len(self.channels)}), and a basic "
                              f"block's output is its channels ({self.channels})", fields=("out_channels", "channels"))
        if self.block == "basic" and (self.groups, self.width_per_group) != (1, 64):
            raise ConfigError(f"block='basic' has groups=1 and width_per_group=64 (torchvision's and timm's "
                              f"BasicBlock), got groups={self.groups}, width_per_group={self.width_per_group}",
                              fields=("block", "groups", "width_per_group"))
        if self.block == "bottleneck" and min(bottleneck_width(c, self.groups, self.width_per_group)
                                              for c in self.channels) < 1:
            raise ConfigError(f"channels={self.channels} with width_per_group={self.width_per_group} leaves a "
                              f"bottleneck without 3x3 channels (int(channels * width_per_group / 64) is 0)",
                              fields=("channels", "width_per_group"))
        if self.hf_config is not None:
            check_hf_config(self)

    def stage_geometry(self) -> list[tuple[int, int, int]]:
        return stage_geometry(len(self.layers), self.output_stride)

    @property
    def expansion(self) -> int:
        return EXPANSION[self.block]

    @property
    def stem(self) -> int:
        return self.channels[0] if self.stem_width is None else self.stem_width

    def stage_out(self, i: int) -> int:
        """Stage ``i``'s output channels."""
        return self.channels[i] * self.expansion if self.out_channels is None else self.out_channels[i]

    @property
    def torchvision_shaped(self) -> bool:
        return self.stem_width in (None, self.channels[0]) and self.out_channels in (
            None, tuple(c * self.expansion for c in self.channels))

    @property
    def num_features(self) -> int:
        return self.stage_out(-1)
