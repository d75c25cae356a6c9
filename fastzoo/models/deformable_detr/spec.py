"""Deformable DETR as the rest of fastzoo reads it: variants (transformers' hub names), converter, tiny
config, transformers' ``DeformableDetrForObjectDetection`` as the original."""
from __future__ import annotations

from fastzoo.models.deformable_detr.config import DeformableDetrConfig
from fastzoo.models.deformable_detr.convert import HF
from fastzoo.models.deformable_detr.model import DeformableDetrForObjectDetection
from fastzoo.models.spec import ModelSpec, Original, Variant
from fastzoo.tasks import DETECTION


def build_original(cfg: dict):
    """transformers' ``DeformableDetrForObjectDetection`` on fastzoo config fields, random init, eager attention,
    its pure-PyTorch deformable attention (no hub kernel)."""
    import transformers

    from fastzoo.models.deformable_detr.convert import hf_config

    hf = hf_config(DeformableDetrConfig.from_dict(dict(cfg)))
    hf._attn_implementation = "eager"
    hf.disable_custom_kernels = True
    return transformers.DeformableDetrForObjectDetection(hf)


# transformers' own ResNet backbone at test sizes, three backbone levels and one strided level
TINY = dict(use_timm_backbone=False, embedding_size=8, hidden_sizes=(8, 16, 24, 32), depths=(1, 1, 1, 1), d_model=32,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
            encoder_layers=2, decoder_layers=2, num_queries=8, two_stage_num_proposals=8, num_labels=5,
            encoder_n_points=2, decoder_n_points=2)
R50 = {}  # backbone None: timm's resnet50, as transformers' DeformableDetrConfig()
PEER = "transformers DeformableDetrForObjectDetection"
SPEC = ModelSpec(
    family="deformable_detr",
    task=DETECTION,
    model=DeformableDetrForObjectDetection,
    variants=(
        Variant("deformable_detr", dict(R50), "Deformable DETR ResNet-50 (4 levels, 300 queries, 6+6 layers)",
                f"{PEER} (SenseTime/deformable-detr)", aliases=("SenseTime/deformable-detr",)),
        Variant("deformable_detr_single_scale", dict(R50, num_feature_levels=1, backbone_out_indices=(4,)),
                "Deformable DETR ResNet-50, C5 only", f"{PEER} (SenseTime/deformable-detr-single-scale)",
                aliases=("SenseTime/deformable-detr-single-scale",)),
        Variant("deformable_detr_box_refine", dict(R50, with_box_refine=True),
                "Deformable DETR ResNet-50 with iterative box refinement",
                f"{PEER} (SenseTime/deformable-detr-with-box-refine)", aliases=("SenseTime/deformable-detr-with-box-refine",)),
        Variant("deformable_detr_two_stage", dict(R50, with_box_refine=True, two_stage=True),
                "Deformable DETR ResNet-50, two-stage with box refinement",
                f"{PEER} (SenseTime/deformable-detr-with-box-refine-two-stage)",
                aliases=("SenseTime/deformable-detr-with-box-refine-two-stage",)),
    ),
    converters=(HF,),
    tiny=TINY,
    original=Original(build_original, f"{PEER} (eager attention, grid_sample deformable attention)",
                      attn_dropout_field="attention_dropout"),
)
SPECS = (SPEC,)
