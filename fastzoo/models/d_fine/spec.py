"""D-FINE as the rest of fastzoo reads it: variants (transformers' hub names), converter, tiny config,
transformers' ``DFineForObjectDetection`` as the original."""
from __future__ import annotations

import contextlib

from fastzoo.models.d_fine.config import DFineConfig
from fastzoo.models.d_fine.convert import HF
from fastzoo.models.d_fine.model import DFineForObjectDetection
from fastzoo.models.detr.hf_detector import on_users_attention
from fastzoo.models.spec import ModelSpec, Original, Variant
from fastzoo.tasks import DETECTION


def build_original(cfg: dict):
    """transformers' model on fastzoo config fields, random init, eager attention."""
    import transformers

    from fastzoo.models.d_fine.convert import hf_config

    hf = hf_config(DFineConfig.from_dict(dict(cfg)))
    hf._attn_implementation = "eager"
    return transformers.DFineForObjectDetection(hf)


@contextlib.contextmanager
def fgl_targets_in_fp32():
    """transformers' D-FINE loss in an fp64 run: its FGL targets' bins (``translate_gt``, no gradient) are made
    fp32 whatever the inputs' dtype and then given fp64 weights, which torch refuses; here they are computed in
    fp32, as the fp32 run computes them, and widened."""
    from transformers.loss import loss_d_fine

    translate_gt = loss_d_fine.translate_gt

    def widened(gt, max_num_bins, reg_scale, up):
        return tuple(t.to(gt.dtype) for t in translate_gt(gt.float(), max_num_bins, reg_scale, up.float()))

    loss_d_fine.translate_gt = widened
    try:
        yield
    finally:
        loss_d_fine.translate_gt = translate_gt


def _hgnet(stem, ins, mids, outs, blocks, layers, lab) -> dict:
    """An HGNetV2 of the D-FINE repository (B0 ... B5): the stages' light blocks and kernels are its fixed pattern."""
    return dict(stem_channels=stem, stage_in_channels=ins, stage_mid_channels=mids, stage_out_channels=outs,
                stage_num_blocks=blocks, stage_numb_of_layers=(layers,) * 4, use_learnable_affine_block=lab)


B0 = _hgnet((3, 16, 16), (16, 64, 256, 512), (16, 32, 64, 128), (64, 256, 512, 1024), (1, 1, 2, 1), 3, True)
B2 = _hgnet((3, 24, 32), (32, 96, 384, 768), (32, 64, 128, 256), (96, 384, 768, 1536), (1, 1, 3, 1), 4, True)
B4 = _hgnet((3, 32, 48), (48, 128, 512, 1024), (48, 96, 192, 384), (128, 512, 1024, 2048), (1, 1, 3, 1), 6, False)
B5 = _hgnet((3, 32, 64), (64, 128, 512, 1024), (64, 128, 256, 512), (128, 512, 1024, 2048), (1, 2, 5, 2), 6, False)
POINTS = dict(decoder_n_points=(3, 6, 3))
# the D-FINE repository's configs (dfine_hgnetv2_{s,m,l,x}): backbone, encoder widths and depth, decoder layers
S = dict(B0, backbone_out_indices=(2, 3, 4), encoder_in_channels=(256, 512, 1024), hidden_expansion=0.5,
         depth_mult=0.34, decoder_layers=3, **POINTS)
M = dict(B2, encoder_in_channels=(384, 768, 1536), depth_mult=0.67, decoder_layers=4, **POINTS)
L = dict(B4, encoder_in_channels=(512, 1024, 2048), decoder_layers=6, **POINTS)
X = dict(B5, encoder_in_channels=(512, 1024, 2048), encoder_hidden_dim=384, encoder_ffn_dim=2048,
         decoder_in_channels=(384, 384, 384), reg_scale=8.0, decoder_layers=6, **POINTS)
# HGNetV2 and the decoder at test sizes: three backbone levels, one RepVGG block per CSP layer, 8 bins
TINY = dict(stem_channels=(3, 8, 8), stage_in_channels=(8, 16, 24, 32), stage_mid_channels=(8, 8, 8, 8),
            stage_out_channels=(16, 24, 32, 40), stage_num_blocks=(1, 1, 2, 1), stage_numb_of_layers=(2, 2, 2, 2),
            stage_light_block=(False, False, True, True), stage_kernel_size=(3, 3, 5, 5), use_learnable_affine_block=True,
            encoder_in_channels=(24, 32, 40), encoder_hidden_dim=32, d_model=32, decoder_in_channels=(32, 32, 32),
            encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
            hidden_expansion=0.5, depth_mult=0.34, decoder_layers=3, num_queries=8, num_labels=5,
            decoder_n_points=(2, 3, 2), num_denoising=10, max_num_bins=8, top_prob_values=2, lqe_hidden_dim=8)
PEER = "transformers DFineForObjectDetection"


def _variants(size: str, sizes: dict, what: str) -> tuple[Variant, ...]:
    return tuple(Variant(f"dfine_{size}_{data}", dict(sizes), f"D-FINE {what}, {text}",
                         f"{PEER} (ustc-community/dfine-{size}-{data})", aliases=(f"ustc-community/dfine-{size}-{data}",))
                 for data, text in (("coco", "COCO"), ("obj2coco", "Objects365 then COCO")))


SPEC = ModelSpec(
    family="d_fine",
    task=DETECTION,
    model=DFineForObjectDetection,
    variants=(
        *_variants("small", S, "HGNetV2-B0 (3 decoder layers)"),
        *_variants("medium", M, "HGNetV2-B2 (4 decoder layers)"),
        *_variants("large", L, "HGNetV2-B4 (6 decoder layers)"),
        *_variants("xlarge", X, "HGNetV2-B5 (encoder width 384)"),
    ),
    converters=(HF,),
    tiny=TINY,
    # a rounding-size change of transformers' weights moves its own fp32 gradients by 0.15-0.3 of their scale at the
    # bench's size (benchmarks/results/cpu-2core/README.md): sampling points at bilinear cells' edges, behind a
    # backbone and encoder that amplify a weight's change a thousandfold; fp32 is judged against its fp64 run
    original=Original(build_original, f"{PEER} (eager attention, grid_sample deformable attention)",
                      attn_dropout_field="attention_dropout", fp64_reference=True, fp64_patch=fgl_targets_in_fp32,
                      users=on_users_attention),
)
SPECS = (SPEC,)
