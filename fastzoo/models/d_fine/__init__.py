"""D-FINE (transformers' ``DFineForObjectDetection``): RT-DETR with declared differences -- an HGNetV2 backbone,
GELAN blocks in the hybrid encoder, and a decoder that refines each box edge as a distribution (FDR) with a
location-quality estimate; its loss is the set loss's RT-DETR part with distribution terms (FGL, DDF)."""
from fastzoo.models.d_fine.config import DFineConfig
from fastzoo.models.d_fine.model import DFineForObjectDetection

__all__ = ["DFineConfig", "DFineForObjectDetection"]
