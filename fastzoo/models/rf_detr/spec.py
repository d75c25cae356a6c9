"""RF-DETR as the rest of fastzoo reads it: variants (transformers' hub names), converter, tiny config,
transformers' ``RfDetrForObjectDetection`` as the original."""
from __future__ import annotations

from fastzoo.models.rf_detr.config import RfDetrConfig
from fastzoo.models.rf_detr.convert import HF
from fastzoo.models.rf_detr.model import RfDetrForObjectDetection
from fastzoo.models.detr.hf_detector import on_users_attention
from fastzoo.models.spec import ModelSpec, Original, Variant
from fastzoo.tasks import DETECTION


def build_original(cfg: dict):
    """transformers' model on fastzoo config fields, random init, eager attention, its pure-PyTorch
    deformable attention (no hub kernel)."""
    import transformers

    from fastzoo.models.rf_detr.convert import hf_config

    hf = hf_config(RfDetrConfig.from_dict(dict(cfg)))
    hf._attn_implementation = "eager"
    hf.backbone_config._attn_implementation = "eager"
    return transformers.RfDetrForObjectDetection(hf)


def like_trained(hf) -> None:
    """transformers' drawn model with its box deltas' parameters (the reference point deltas, the last layer of
    each box head) scaled by 0.3: drawn at full scale, three exp() in a row make boxes ~70 times the image, around
    which the bilinear sampling amplifies fp32 rounding a thousandfold (transformers' own fp32 logits then lie 1e-2
    from its fp64 ones, its SDPA run's loss 9.5 from its eager run's at the bench's size); at 0.3 boxes stay within
    the image, as a trained model's."""
    import torch

    with torch.no_grad():
        hf.model.reference_point_embed.weight.mul_(0.3)
        for head in [hf.bbox_embed, *hf.model.enc_out_bbox_embed]:
            head.layers[-1].weight.mul_(0.3)
            head.layers[-1].bias.mul_(0.3)


# the sizes of transformers' conversion script (convert_rf_detr_to_hf.py): a DINOv2-small backbone (384 wide,
# 12 blocks, 6 heads), decoder width 256, 2 sampling points, 300 queries x 13 groups, COCO's 91 ids; base:
# patch 14, 4 windows per side, outputs after blocks 2, 5, 8, 11 and transformers' RfDetrConfig's 518 px
# position grid; nano to large: patch 16, 2 windows, outputs after blocks 3, 6, 9, 12, the position grid of
# their training resolution
COMMON = dict(decoder_n_points=2, num_labels=91)
BASE = dict(COMMON, decoder_layers=3)
SMALL_BACKBONE = dict(COMMON, patch_size=16, num_windows=2, backbone_out_indices=(3, 6, 9, 12))
SIZES = {"nano": dict(SMALL_BACKBONE, decoder_layers=2, image_size=384),
         "small": dict(SMALL_BACKBONE, decoder_layers=3, image_size=512),
         "medium": dict(SMALL_BACKBONE, decoder_layers=4, image_size=576),
         "large": dict(SMALL_BACKBONE, decoder_layers=4, image_size=704)}
# a DINOv2 of 2 x 2 windows at test sizes: 6 blocks, outputs after blocks 2, 4 and 6 (blocks 1 and 4 windowed)
TINY = dict(hidden_size=16, num_hidden_layers=6, num_attention_heads=2, image_size=32, patch_size=4,
            backbone_out_indices=(2, 4, 6), num_windows=2, d_model=32, c2f_num_blocks=1, decoder_layers=2,
            decoder_ffn_dim=64, decoder_self_attention_heads=2, decoder_cross_attention_heads=4, decoder_n_points=2,
            num_queries=6, group_detr=3, num_labels=5, dropout=0.0)
PEER = "transformers RfDetrForObjectDetection"
SPEC = ModelSpec(
    family="rf_detr",
    task=DETECTION,
    model=RfDetrForObjectDetection,
    variants=(
        Variant("rf_detr_base", dict(BASE), "RF-DETR base (DINOv2-small, patch 14, 4x4 windows, 3 decoder layers)",
                f"{PEER} (Roboflow/rf-detr-base)", aliases=("Roboflow/rf-detr-base",)),
        *(Variant(f"rf_detr_{size}", dict(sizes), f"RF-DETR {size} (DINOv2-small, patch 16, 2x2 windows, "
                  f"{sizes['decoder_layers']} decoder layers, {sizes['image_size']} px)",
                  f"{PEER} (Roboflow/rf-detr-{size})", aliases=(f"Roboflow/rf-detr-{size}",))
          for size, sizes in SIZES.items()),
    ),
    converters=(HF,),
    tiny=TINY,
    original=Original(build_original, f"{PEER} (eager attention, grid_sample deformable attention)",
                      attn_dropout_field="attention_dropout", like_trained=like_trained, users=on_users_attention),
)
SPECS = (SPEC,)
