"""Box detector checkpoints: fastzoo's own keys (DETR's head names, the ResNet as
``backbone.``), and a bare ResNet checkpoint recognised and refused with the fix."""
from __future__ import annotations

from fastzoo.errors import CheckpointError
from fastzoo.models.boxdet.config import BACKBONE_FIELDS
from fastzoo.models.resnet.convert import ResNetConverter


class BoxDetConverter:
    """Box detector state dicts in fastzoo's own keys (DETR's head names on this ResNet as
    ``backbone.``), e.g. ``torch.save(det.state_dict(), "det.pth")``; a ``save_pretrained`` or
    training-checkpoint directory carries its config.json and needs no converter."""

    format = "fastzoo"

    @staticmethod
    def matches(state: dict) -> bool:
        return "query_embed.weight" in state and "class_embed.weight" in state and "backbone.conv1.weight" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return ResNetConverter.to_fastzoo(state)

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return dict(state)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        backbone = ResNetConverter.infer_config({k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")})
        return {
            "num_classes": state["class_embed.weight"].shape[0] - 1,  # the last logit is "no object"
            "num_queries": state["query_embed.weight"].shape[0],
            "hidden_dim": state["query_embed.weight"].shape[1],
            **{name: backbone[name] for name in BACKBONE_FIELDS},
        }


class BackboneOnly:
    """A ResNet checkpoint offered as a whole box detector: recognised, and refused with the fix
    (the detector's head would be left untrained; loading only the backbone is a separate call)."""

    format = "ResNet backbone (refused: use load_backbone)"
    matches = staticmethod(ResNetConverter.matches)

    @staticmethod
    def _refuse(*_):
        raise CheckpointError(
            "this is a ResNet checkpoint, not a box detector's (no query_embed / class_embed / bbox_embed): "
            "build the detector and load it into its backbone: det = fastzoo.create('boxdet_r50', ...); "
            "det.load_backbone(source). scripts/train_boxdet.py --pretrained takes either kind."
        )

    to_fastzoo = from_fastzoo = infer_config = _refuse


BOXDET = BoxDetConverter()
BOXDET_BACKBONE = BackboneOnly()
