"""Box detector family: DETR's set-prediction head, matcher and loss on a ResNet backbone."""
from fastzoo.models.boxdet.config import BoxDetConfig
from fastzoo.models.boxdet.model import BoxDetector

__all__ = ["BoxDetConfig", "BoxDetector"]
