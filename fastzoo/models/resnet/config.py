"""ResNet config: torchvision ``ResNet``'s sizes under timm's field names."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide

EXPANSION = 4  # a bottleneck's output has 4x the channels of its 3x3 conv

@dataclass
class ResNetConfig(ModelConfig):
    """torchvision / timm ResNet fields; each field's kind, meaning and constraint is declared with it."""

    num_classes: int = weights_decide(1000, "classifier outputs; 0: fc is the identity, forward returns the pooled features",
                                      ge=0)
    global_pool: str = changes_function("avg", "pooling before fc: 'avg', or '' (none: forward_head returns the "
                                        "feature map; needs num_classes=0)", choices=("avg", ""))
    layers: tuple[int, ...] = weights_decide((3, 4, 6, 3), "bottleneck blocks per stage (ResNet-50)", ge=1, le=MAX_BLOCKS)
    channels: tuple[int, ...] = weights_decide((64, 128, 256, 512), "3x3 width per stage (timm's name); out = 4x", ge=1)
    in_chans: int = weights_decide(3, "image channels", ge=1)
    channels_last: bool = free(False, "NHWC parameters and activations (faster convs on GPU)")
    zero_init_residual: bool = free(False, "init each block's last BN to 0 (init only)")
    frozen_bn: bool = free(False, "BN uses running statistics in train mode too, affine not trained (FrozenBatchNorm2d)")

    def validate(self):
        if len(self.layers) != len(self.channels) or not self.layers:
            raise ConfigError(f"layers={self.layers} and channels={self.channels} must have the same, nonzero length",
                              fields=("layers", "channels"))
        if self.global_pool == "" and self.num_classes:
            raise ConfigError(f"global_pool='' (no pooling) needs num_classes=0, got num_classes={self.num_classes}",
                              fields=("global_pool", "num_classes"))

    @property
    def num_features(self) -> int:
        return self.channels[-1] * EXPANSION
