"""RT-DETR and RT-DETRv2 (transformers' ``RTDetrForObjectDetection`` / ``RTDetrV2ForObjectDetection``): the
detection family's real-time DETR, a ResNet-vd backbone, a hybrid encoder and a deformable decoder with
query selection and denoising queries; v2 a declared difference of the decoder's sampling."""
from fastzoo.models.rt_detr.config import RTDetrConfig
from fastzoo.models.rt_detr.model import RTDetrForObjectDetection

__all__ = ["RTDetrConfig", "RTDetrForObjectDetection"]
