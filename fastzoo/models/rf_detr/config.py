"""RF-DETR's config: transformers' ``RfDetrConfig`` field names and defaults, its DINOv2 backbone's sizes
(``RfDetrDinov2Config``) under their own names (``backbone_out_indices`` for its ``out_indices``,
``backbone_layer_norm_eps`` for its ``layer_norm_eps``), and the set loss's settings."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.losses.set_prediction import GIOU_IMPLS
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide

ACTIVATIONS = ("relu", "gelu", "silu")


@dataclass
class RfDetrConfig(ModelConfig):
    """transformers' names; each field's kind, meaning and constraint is declared with it."""

    num_labels: int = weights_decide(91, "object classes (sigmoid per class, no 'no object' logit)", ge=1)
    id2label: dict | None = free(None, "class id -> name, as transformers' config; save_pretrained carries it")
    # -- the backbone: DINOv2 with windowed attention (transformers' RfDetrDinov2Config names) -------
    hidden_size: int = weights_decide(384, "the backbone's token width", ge=1, multiple_of="num_attention_heads")
    num_hidden_layers: int = weights_decide(12, "the backbone's blocks", ge=1, le=MAX_BLOCKS)
    num_attention_heads: int = changes_function(6, "the backbone's attention heads", ge=1)
    mlp_ratio: int = weights_decide(4, "the backbone's MLP width / hidden_size", ge=1)
    hidden_act: str = changes_function("gelu", "the backbone's MLP activation", choices=("gelu",))
    image_size: int = weights_decide(518, "the side the position embedding is learned for (other sides resample it: "
                                     "bicubic, antialiased)", ge=1, multiple_of="patch_size")
    patch_size: int = weights_decide(14, "side of a square patch", ge=1)
    num_channels: int = weights_decide(3, "image channels", ge=1)
    qkv_bias: bool = weights_decide(True, "bias in the backbone's q, k, v projections")
    layerscale_value: float = free(1.0, "LayerScale's initial value (a fresh model)")
    use_mask_token: bool = weights_decide(True, "the backbone holds DINOv2's mask token (unused by detection)")
    backbone_out_indices: tuple[int, ...] = weights_decide((2, 5, 8, 11), "the blocks whose outputs (1 = the first) "
                                                           "the projector concatenates; blocks up to the last of "
                                                           "them that are not listed attend within windows", ge=1)
    num_windows: int = changes_function(4, "windows per side of the windowed blocks (1: every block global)", ge=1)
    backbone_layer_norm_eps: float = changes_function(1e-6, "the backbone's LayerNorm epsilon", gt=0)
    apply_layernorm: bool = changes_function(True, "the backbone's final LayerNorm on each output block")
    # -- the projector (C2f of RepVGG-style blocks, channels-first LayerNorm) --------------------------
    hidden_expansion: float = weights_decide(0.5, "the C2f blocks' width / d_model", gt=0)
    c2f_num_blocks: int = weights_decide(3, "blocks in the C2f layer", ge=1, le=MAX_BLOCKS)
    activation_function: str = changes_function("silu", "the projector's activation", choices=ACTIVATIONS)
    layer_norm_eps: float = changes_function(1e-5, "the projector's convolution LayerNorms' epsilon", gt=0)
    # -- the decoder (LW-DETR's: two-stage queries, deformable cross-attention on one level) ----------
    d_model: int = weights_decide(256, "the decoder's width", ge=1)
    num_queries: int = weights_decide(300, "queries per group (the encoder's top-k)", ge=1)
    group_detr: int = weights_decide(13, "query groups in training (Group DETR; eval runs the first)", ge=1)
    decoder_layers: int = weights_decide(3, "decoder layers", ge=1, le=MAX_BLOCKS)
    decoder_ffn_dim: int = weights_decide(2048, "decoder MLP width", ge=1)
    decoder_self_attention_heads: int = changes_function(8, "decoder self-attention heads", ge=1)
    decoder_cross_attention_heads: int = changes_function(16, "decoder cross-attention heads", ge=1)
    decoder_n_points: int = weights_decide(4, "sampling points per head in the cross-attention", ge=1)
    num_feature_levels: int = weights_decide(1, "levels the cross-attention reads (transformers' RF-DETR: the "
                                             "projector's one map)", ge=1, le=1)
    decoder_activation_function: str = changes_function("relu", "decoder MLP activation", choices=ACTIVATIONS)
    attention_bias: bool = weights_decide(True, "bias in the decoder self-attention's projections (True only: every "
                                          "RF-DETR checkpoint)")
    dropout: float = free(0.1, "dropout after the decoder's attentions and in its MLP", ge=0, le=1)
    attention_dropout: float = free(0.0, "dropout on the decoder's self-attention probabilities", ge=0, le=1)
    # -- training: the set loss (transformers' names and defaults) -----------------------------------
    auxiliary_loss: bool = free(True, "loss on every decoder layer (the encoder's proposals always)")
    class_cost: float = free(2.0, "matching cost weight of the focal class cost", ge=0)
    bbox_cost: float = free(5.0, "matching cost weight of the L1 box distance", ge=0)
    giou_cost: float = free(2.0, "matching cost weight of the GIoU", ge=0)
    class_loss_coefficient: float = free(1.0, "weight of the IoU-aware class loss", ge=0)
    bbox_loss_coefficient: float = free(5.0, "weight of the L1 box loss", ge=0)
    giou_loss_coefficient: float = free(2.0, "weight of the GIoU loss", ge=0)
    focal_alpha: float = free(0.25, "the IoU-aware class target's exponent: prob^alpha x IoU^(1 - alpha)", ge=0, le=1)
    init_std: float = free(0.02, "std of a fresh model's linear weights", gt=0)
    giou_impl: str = free("kernel", "how the set loss's GIoU term runs: " + "; ".join(f"{k}: {v}" for k, v in GIOU_IMPLS.items()),
                          choices=tuple(GIOU_IMPLS))
    gradient_checkpointing: bool = free(False, "transformers' legacy field: the model is built with gradient "
                                        "checkpointing on (as gradient_checkpointing_enable())")

    def validate(self):
        outs = tuple(self.backbone_out_indices)
        if not outs or list(outs) != sorted(set(outs)) or outs[-1] > self.num_hidden_layers:
            raise ConfigError(f"backbone_out_indices={outs}: increasing block numbers in 1..{self.num_hidden_layers}",
                              fields=("backbone_out_indices", "num_hidden_layers"))
        if int(self.d_model * self.hidden_expansion) < 1:
            raise ConfigError(f"hidden_expansion={self.hidden_expansion}: the C2f width int(d_model * hidden_expansion) "
                              f"must be at least 1", fields=("hidden_expansion", "d_model"))
        for heads, name in ((self.decoder_self_attention_heads, "decoder_self_attention_heads"),
                            (self.decoder_cross_attention_heads, "decoder_cross_attention_heads")):
            if self.d_model % heads:
                raise ConfigError(f"{name}={heads}: d_model={self.d_model} is not divisible by it", fields=(name,))
        if self.d_model % 4:
            raise ConfigError(f"d_model={self.d_model}: the boxes' sine embedding interleaves sin and cos over d_model / 2 "
                              f"features per coordinate, so it needs a multiple of 4", fields=("d_model",))
        if not self.attention_bias:
            raise ConfigError("attention_bias=False: fastzoo's RF-DETR builds the decoder self-attention with biases "
                              "(as every RF-DETR checkpoint)", fields=("attention_bias",))

    @property
    def window_blocks(self) -> frozenset[int]:
        """The blocks (0 = the first) that attend within windows: transformers' ``window_block_indexes``,
        those up to the last output block that are not output blocks."""
        outs = set(self.backbone_out_indices)
        return frozenset(i for i in range(max(outs) + 1) if i not in outs)
