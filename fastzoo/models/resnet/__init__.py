"""ResNet family: torchvision's ``ResNet`` (and timm's, same keys) and its named variants."""
from fastzoo.models.resnet.config import ResNetConfig
from fastzoo.models.resnet.model import ResNet

__all__ = ["ResNet", "ResNetConfig"]
