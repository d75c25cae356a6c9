"""Deformable DETR as the rest of fastzoo reads it: variants (transformers' hub names), converter, tiny
config, transformers' ``DeformableDetrForObjectDetection`` as the original."""
from __future__ import annotations

from fastzoo.models.deformable_detr.config import DeformableDetrConfig
from fastzoo.models.deformable_detr.convert import HF
from fastzoo.models.deformable_detr.model import DeformableDetrForObjectDetection
from fastzoo.models.detr.hf_detector import on_users_attention
from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload
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
# the tour's Deformable DETR: timm's ResNet-18 under the full-size transformer (4 levels, 6+6 layers, 300 queries)
R18 = dict(backbone="resnet18")
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
    # bilinear sampling's gradient jumps at its cell edges: transformers' own fp32 gradient is 3e-2 of its scale from
    # its fp64 one at the bench's size (benchmarks/results/cpu-2core/README.md), as far as another fp32 run's: fp32
    # is judged with transformers' own fp32 error from its fp64 run
    original=Original(build_original, f"{PEER} (eager attention, grid_sample)",
                      attn_dropout_field="attention_dropout", fp64_reference=True, users=on_users_attention),
    bench=BenchSettings(  # the tour: a training step against transformers' model on mixed-size padded images
        variant="deformable_detr", library="transformers", compile=False, channels_last=True,
        sizes={"tour": Workload("Deformable DETR, ResNet-18 backbone, 4 levels, 6+6 layers, 300 queries, 2 images of "
                                "160x160 / 80x160", R18, batch=2, img_size=160),
               "quick": Workload("tiny Deformable DETR, 2 images of 128x128 / 64x128", TINY, batch=2, img_size=128)}),
)
SPECS = (SPEC,)
