"""The box detector family as the rest of fastzoo reads it: variants, converters, tiny config."""
from __future__ import annotations

from fastzoo.models.boxdet.convert import BOXDET, BOXDET_BACKBONE
from fastzoo.models.boxdet.model import BoxDetector
from fastzoo.models.spec import ModelSpec, Variant
from fastzoo.tasks import DETECTION

SPEC = ModelSpec(
    family="boxdet",
    task=DETECTION,
    model=BoxDetector,
    variants=(
        Variant("boxdet_r50", dict(num_classes=1, num_queries=100, hidden_dim=256, loss="kernel", matcher="hungarian",
                                   layers=(3, 4, 6, 3), channels=(64, 128, 256, 512)),
                "Box detector: DETR's set prediction head, matcher and loss (CE + L1 + GIoU) on ResNet-50 C5",
                "DETR (facebookresearch/detr) loss and matcher; torchvision resnet50 backbone"),
    ),
    converters=(BOXDET, BOXDET_BACKBONE),
    tiny=dict(layers=(1, 1, 1, 1), channels=(8, 16, 32, 64), hidden_dim=32, num_queries=6),
)
SPECS = (SPEC,)
