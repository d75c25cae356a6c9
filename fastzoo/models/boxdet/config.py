"""Box detector config: DETR's head sizes and loss settings on a ResNet backbone of any of the family's sizes."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.losses.boxes import GIOU_LAYOUTS
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, free, weights_decide
from fastzoo.models.resnet.config import EXPANSION, ResNetConfig

MATCHERS = ("order", "hungarian")
BACKBONE_FIELDS = ("block", "layers", "channels", "groups", "width_per_group")  # ResNetConfig's, same names

@dataclass
class BoxDetConfig(ModelConfig):
    """DETR's names and defaults; each field's kind, meaning and constraint is declared with it.
    The loss and matcher settings are free: they change training, not what the weights compute."""

    num_classes: int = weights_decide(1, "object classes; logits have one more (the last: no object)", ge=1)
    num_queries: int = weights_decide(100, "predicted boxes per image", ge=1)
    hidden_dim: int = weights_decide(256, "width D of the queries and the projected features (>= 4: the sine "
                                     "position embedding has a sin and cos of y and x per frequency)", ge=4)
    loss: str = free("kernel", "how the GIoU term runs: per_sample (a loop) | concat (gathered pairs) | padded "
                     "(padded pairs, plain ops) | kernel (padded pairs through the fused op: no gather, no host sync)",
                     choices=GIOU_LAYOUTS)
    matcher: str = free("hungarian", "order (prediction i <-> target i) | hungarian", choices=MATCHERS)
    eos_coef: float = free(0.1, "weight of the no-object class in the cross-entropy (> 0: a batch without boxes "
                           "still has a class-loss normaliser)", gt=0)
    loss_ce: float = free(1.0, "weight of the class loss (DETR's default)", ge=0)
    loss_bbox: float = free(5.0, "weight of the L1 box loss", ge=0)
    loss_giou: float = free(2.0, "weight of the GIoU loss", ge=0)
    cost_class: float = free(1.0, "matching cost weight of the class (DETR's default)", ge=0)
    cost_bbox: float = free(5.0, "matching cost weight of the L1 distance", ge=0)
    cost_giou: float = free(2.0, "matching cost weight of the GIoU", ge=0)
    # the backbone: any of the ResNet family's sizes, under ResNetConfig's names (resnet18 ... resnext101_64x4d)
    block: str = weights_decide("bottleneck", "backbone residual block: 'basic' or 'bottleneck' (ResNetConfig)",
                                choices=tuple(EXPANSION))
    layers: tuple[int, ...] = weights_decide((3, 4, 6, 3), "backbone blocks per stage (ResNetConfig)", ge=1,
                                             le=MAX_BLOCKS)
    channels: tuple[int, ...] = weights_decide((64, 128, 256, 512), "backbone stage widths (ResNetConfig)", ge=1)
    groups: int = weights_decide(1, "groups of the backbone bottlenecks' 3x3 (ResNetConfig)", ge=1)
    width_per_group: int = weights_decide(64, "the backbone bottlenecks' 3x3 width per group (ResNetConfig)", ge=1)
    channels_last: bool = free(False, "NHWC parameters and activations (faster convs on GPU)")
    frozen_bn: bool = free(True, "backbone BatchNorm as DETR's FrozenBatchNorm2d (see the module docstring)")

    def validate(self):
        self.backbone_config()  # the backbone's fields are checked by its own config, under the same names

    def backbone_config(self) -> ResNetConfig:
        return ResNetConfig(num_classes=0, **{name: getattr(self, name) for name in BACKBONE_FIELDS},
                            channels_last=self.channels_last, frozen_bn=self.frozen_bn)
