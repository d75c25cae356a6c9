"""RF-DETR (transformers' ``RfDetrForObjectDetection``): the detection family's real-time DETR on a windowed
DINOv2 (fastzoo's ViT blocks), a C2f projector and LW-DETR's decoder (two-stage queries per Group-DETR group,
deformable cross-attention on one level)."""
from fastzoo.models.rf_detr.config import RfDetrConfig
from fastzoo.models.rf_detr.model import RfDetrForObjectDetection

__all__ = ["RfDetrConfig", "RfDetrForObjectDetection"]
