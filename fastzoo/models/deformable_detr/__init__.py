"""Deformable DETR (Zhu et al. 2021), transformers' ``DeformableDetrForObjectDetection``: the detection
family's DETR with multi-scale deformable attention, DETR's backbone, position embedding and set loss."""
from fastzoo.models.deformable_detr.config import DeformableDetrConfig
from fastzoo.models.deformable_detr.model import DeformableDetrForObjectDetection

__all__ = ["DeformableDetrConfig", "DeformableDetrForObjectDetection"]
