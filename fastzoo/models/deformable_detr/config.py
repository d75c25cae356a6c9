"""Deformable DETR's config: transformers' ``DeformableDetrConfig`` field names and defaults
(``SenseTime/deformable-detr``), declared as differences from DETR's config, whose backbone, transformer
and set-loss fields it shares (``fastzoo.models.detr.config``)."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.models.config import changes_function, free, weights_decide
from fastzoo.models.detr.config import DetrConfig


@dataclass
class DeformableDetrConfig(DetrConfig):
    """DETR's fields with Deformable DETR's defaults, and what Deformable DETR adds."""

    num_queries: int = weights_decide(300, "object queries (two_stage: the proposals kept, two_stage_num_proposals)", ge=1)
    encoder_ffn_dim: int = weights_decide(1024, "encoder MLP width", ge=1)
    decoder_ffn_dim: int = weights_decide(1024, "decoder MLP width", ge=1)
    num_feature_levels: int = weights_decide(4, "feature levels the deformable attention reads: the backbone's stages "
                                             "(backbone_out_indices), then 3x3 stride-2 convolutions on the last", ge=1, le=6)
    backbone_out_indices: tuple[int, ...] = weights_decide((2, 3, 4), "the backbone stages whose feature maps feed the encoder "
                                                  "(timm's out_indices: 2, 3, 4 = C3, C4, C5; (4,): C5 alone)", ge=1)
    encoder_n_points: int = weights_decide(4, "sampling points per head and level in the encoder", ge=1)
    decoder_n_points: int = weights_decide(4, "sampling points per head and level in the decoder's cross-attention", ge=1)
    two_stage: bool = weights_decide(False, "proposals from the encoder's output (a class and box head on every "
                                     "token, the top two_stage_num_proposals) give the decoder its queries and "
                                     "reference boxes; needs with_box_refine")
    two_stage_num_proposals: int = changes_function(300, "two_stage: the proposals kept (the decoder's queries)", ge=1)
    with_box_refine: bool = weights_decide(False, "iterative box refinement: each decoder layer's box head refines the "
                                           "reference boxes the next layer samples around")
    tie_word_embeddings: bool = changes_function(True, "transformers' tying of the heads: one class head for every "
                                                 "decoder layer (unless two_stage) and one box head (unless "
                                                 "with_box_refine); False: a head per layer")
    focal_alpha: float = free(0.25, "the focal classification loss's positive weight", ge=0, le=1)

    def validate(self):
        super().validate()
        if self.two_stage and not self.with_box_refine:
            raise ConfigError("two_stage=True needs with_box_refine=True (as transformers' DeformableDetrConfig)",
                              fields=("two_stage", "with_box_refine"))
        if self.two_stage and self.two_stage_num_proposals != self.num_queries:
            raise ConfigError(f"two_stage: the decoder's queries are the proposals, so two_stage_num_proposals="
                              f"{self.two_stage_num_proposals} must equal num_queries={self.num_queries}",
                              fields=("two_stage_num_proposals", "num_queries"))
        n = len(self.depths)
        if list(self.backbone_out_indices) != sorted(set(self.backbone_out_indices)) or self.backbone_out_indices[-1] > n:
            raise ConfigError(f"backbone_out_indices={self.backbone_out_indices}: increasing stage numbers in 1..{n} (the backbone has "
                              f"{n} stages)", fields=("backbone_out_indices", "depths"))
        if len(self.backbone_out_indices) > self.num_feature_levels:
            raise ConfigError(f"backbone_out_indices={self.backbone_out_indices} gives {len(self.backbone_out_indices)} feature maps, more than "
                              f"num_feature_levels={self.num_feature_levels}", fields=("backbone_out_indices", "num_feature_levels"))
        if self.d_model % 32:
            raise ConfigError(f"d_model={self.d_model}: the input projections' GroupNorm has 32 groups, so d_model must "
                              f"be a multiple of 32", fields=("d_model",))
        if self.use_timm_backbone and tuple(self.backbone_out_indices) != ((2, 3, 4) if self.num_feature_levels > 1 else (4,)):
            raise ConfigError(f"use_timm_backbone: transformers reads timm's stages (2, 3, 4) with num_feature_levels > 1, "
                              f"(4,) with 1; got backbone_out_indices={self.backbone_out_indices} (transformers' own "
                              f"ResNet, use_timm_backbone=False, takes any)",
                              fields=("backbone_out_indices", "use_timm_backbone", "num_feature_levels"))

    def shares_class_head(self) -> bool:
        return self.tie_word_embeddings and not self.two_stage

    def shares_box_head(self) -> bool:
        return self.tie_word_embeddings and not self.with_box_refine
