"""Vision Transformer family: timm's ``VisionTransformer`` and its named variants."""
from fastzoo.models.vit.config import ViTConfig
from fastzoo.models.vit.model import VisionTransformer, resample_pos_embed

__all__ = ["ViTConfig", "VisionTransformer", "resample_pos_embed"]
