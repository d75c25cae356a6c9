"""RT-DETR and RT-DETRv2 as the rest of fastzoo reads them: variants (transformers' hub names), converter,
tiny config, transformers' ``RTDetrForObjectDetection`` / ``RTDetrV2ForObjectDetection`` as the original."""
from __future__ import annotations

from fastzoo.models.rt_detr.config import RTDetrConfig
from fastzoo.models.rt_detr.convert import HF
from fastzoo.models.rt_detr.model import RTDetrForObjectDetection
from fastzoo.models.detr.hf_detector import on_users_attention
from fastzoo.models.spec import ModelSpec, Original, Variant
from fastzoo.tasks import DETECTION


def build_original(cfg: dict):
    """transformers' model on fastzoo config fields, random init, eager attention, its pure-PyTorch
    deformable attention (no hub kernel)."""
    import transformers

    from fastzoo.models.rt_detr.convert import hf_config

    fz = RTDetrConfig.from_dict(dict(cfg))
    hf = hf_config(fz)
    hf._attn_implementation = "eager"
    if not fz.v2:
        hf.disable_custom_kernels = True
    return (transformers.RTDetrV2ForObjectDetection if fz.v2 else transformers.RTDetrForObjectDetection)(hf)


# the ResNet-vd sizes of the RT-DETR repository's configs (transformers' hub configs carry the same)
R18 = dict(layer_type="basic", depths=(2, 2, 2, 2), hidden_sizes=(64, 128, 256, 512), encoder_in_channels=(128, 256, 512),
           hidden_expansion=0.5, decoder_layers=3)
R34 = dict(R18, depths=(3, 4, 6, 3), decoder_layers=4)
R50 = {}  # transformers' RTDetrConfig() defaults
R101 = dict(depths=(3, 4, 23, 3), encoder_hidden_dim=384, encoder_ffn_dim=2048, decoder_in_channels=(384, 384, 384))
V2 = dict(model_type="rt_detr_v2")
# transformers' ResNet-vd at test sizes, three backbone levels
TINY = dict(layer_type="basic", embedding_size=8, hidden_sizes=(8, 16, 24, 32), depths=(1, 1, 1, 1),
            encoder_in_channels=(16, 24, 32), encoder_hidden_dim=32, d_model=32, decoder_in_channels=(32, 32, 32),
            encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=2, decoder_attention_heads=2,
            decoder_layers=2, num_queries=8, num_labels=5, decoder_n_points=2, num_denoising=10)
PEER = "transformers RTDetrForObjectDetection"
PEER2 = "transformers RTDetrV2ForObjectDetection"


def _v1(name: str, sizes: dict, what: str, o365: bool = True) -> tuple[Variant, ...]:
    out = [Variant(f"rtdetr_{name}", dict(sizes), f"RT-DETR {what}", f"{PEER} (PekingU/rtdetr_{name})",
                   aliases=(f"PekingU/rtdetr_{name}",))]
    if o365:
        out.append(Variant(f"rtdetr_{name}_coco_o365", dict(sizes), f"RT-DETR {what}, Objects365 then COCO",
                           f"{PEER} (PekingU/rtdetr_{name}_coco_o365)", aliases=(f"PekingU/rtdetr_{name}_coco_o365",)))
    return tuple(out)


def _v2(name: str, sizes: dict, what: str) -> Variant:
    return Variant(f"rtdetr_v2_{name}", dict(sizes, **V2), f"RT-DETRv2 {what}", f"{PEER2} (PekingU/rtdetr_v2_{name})",
                   aliases=(f"PekingU/rtdetr_v2_{name}",))


SPEC = ModelSpec(
    family="rt_detr",
    task=DETECTION,
    model=RTDetrForObjectDetection,
    variants=(
        *_v1("r18vd", R18, "ResNet-18-vd (3 decoder layers)"),
        *_v1("r34vd", R34, "ResNet-34-vd (4 decoder layers)", o365=False),
        *_v1("r50vd", R50, "ResNet-50-vd (6 decoder layers)"),
        *_v1("r101vd", R101, "ResNet-101-vd (encoder width 384)"),
        _v2("r18vd", R18, "ResNet-18-vd (3 decoder layers)"),
        _v2("r34vd", R34, "ResNet-34-vd (4 decoder layers)"),
        _v2("r50vd", R50, "ResNet-50-vd (6 decoder layers)"),
        _v2("r101vd", R101, "ResNet-101-vd (encoder width 384)"),
    ),
    converters=(HF,),
    tiny=TINY,
    # bilinear sampling's gradient jumps at its cell edges: at the bench's size transformers' own fp32 gradients are
    # 1.9e-2 of their scale from its fp64 ones (its denoising noise drawn in fp32: fastzoo.equivalence.exact)
    original=Original(build_original, f"{PEER} / {PEER2} (eager attention, grid_sample deformable attention)",
                      attn_dropout_field="attention_dropout", fp64_reference=True, users=on_users_attention),
)
SPECS = (SPEC,)
