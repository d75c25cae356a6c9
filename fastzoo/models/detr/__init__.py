"""DETR: transformers' ``DetrForObjectDetection`` with fastzoo's attention backends and set loss."""
from fastzoo.models.detr.config import DetrConfig
from fastzoo.models.detr.model import DetrForObjectDetection

__all__ = ["DetrConfig", "DetrForObjectDetection"]
