"""DETR as the rest of fastzoo reads it: variants (transformers' hub names), converter, tiny config,
transformers' ``DetrForObjectDetection`` as the original."""
from __future__ import annotations

from fastzoo.models.detr.config import DetrConfig
from fastzoo.models.detr.convert import HF
from fastzoo.models.detr.model import DetrForObjectDetection
from fastzoo.models.detr.hf_detector import on_users_attention
from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload
from fastzoo.tasks import DETECTION


def build_original(cfg: dict):
    """transformers' ``DetrForObjectDetection`` on fastzoo config fields, random init, eager attention."""
    import transformers

    from fastzoo.models.detr.convert import hf_config

    hf = hf_config(DetrConfig.from_dict(dict(cfg)))
    hf._attn_implementation = "eager"
    return transformers.DetrForObjectDetection(hf)


TINY = dict(use_timm_backbone=False, embedding_size=8, hidden_sizes=(8, 16, 24, 32), depths=(1, 1, 1, 1), d_model=32,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
            encoder_layers=2, decoder_layers=2, num_queries=8, num_labels=5)
# the tour's DETR: timm's ResNet-18 backbone under the full-size transformer (6+6 layers, width 256, 100 queries)
R18 = dict(backbone="resnet18")
R50 = {}  # backbone None: timm's resnet50, as transformers' DetrConfig()
SPEC = ModelSpec(
    family="detr",
    task=DETECTION,
    model=DetrForObjectDetection,
    variants=(
        Variant("detr", dict(R50), "DETR ResNet-50 (COCO's 91 label ids, 100 queries, 6+6 layers)",
                "transformers DetrForObjectDetection (facebook/detr-resnet-50)",
                aliases=("facebook/detr-resnet-50", "detr_resnet50")),
        Variant("detr_resnet101", dict(backbone="resnet101"), "DETR ResNet-101",
                "transformers DetrForObjectDetection (facebook/detr-resnet-101)", aliases=("facebook/detr-resnet-101",)),
        Variant("detr_resnet50_dc5", dict(R50, dilation=True), "DETR-DC5 ResNet-50 (last stage dilated: stride 16)",
                "transformers DetrForObjectDetection (facebook/detr-resnet-50-dc5)",
                aliases=("facebook/detr-resnet-50-dc5",)),
        Variant("detr_resnet101_dc5", dict(backbone="resnet101", dilation=True),
                "DETR-DC5 ResNet-101 (last stage dilated: stride 16)",
                "transformers DetrForObjectDetection (facebook/detr-resnet-101-dc5)",
                aliases=("facebook/detr-resnet-101-dc5",)),
    ),
    converters=(HF,),
    refused={
        "boxdet_r50": "fastzoo's one detector is DETR, transformers' DetrForObjectDetection: create('detr'), or "
                      "create('facebook/detr-resnet-50', pretrained=...) for its checkpoints; a DETR head on a bare "
                      "ResNet (no transformer) has no original library, and its checkpoints do not load into DETR",
    },
    # transformers' own ResNet backbone at its test sizes: any widths, seconds on a CPU
    tiny=TINY,
    original=Original(build_original, "transformers DetrForObjectDetection (eager attention)",
                      attn_dropout_field="attention_dropout", users=on_users_attention),
    bench=BenchSettings(  # the tour: a training step against transformers' model on mixed-size padded images
        variant="detr", library="transformers", compile=False, channels_last=True,
        sizes={"tour": Workload("DETR, ResNet-18 backbone, 6+6 layers, 4 images of 160x160 / 80x160", R18, batch=4,
                                img_size=160),
               "quick": Workload("tiny DETR, 2 images of 96x96 / 48x96", TINY, batch=2, img_size=96)}),
)
SPECS = (SPEC,)
