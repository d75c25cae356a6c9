"""RT-DETR's config: transformers' ``RTDetrConfig`` / ``RTDetrV2Config`` field names and defaults
(``PekingU/rtdetr_r50vd``), the ResNet-vd backbone's sizes under ``RTDetrResNetConfig``'s names, and the
set loss's settings. RT-DETRv2 is a declared difference (``model_type="rt_detr_v2"``): its decoder's
deformable attention reads ``decoder_n_levels`` levels with ``decoder_offset_scale`` and
``decoder_method`` ("default": bilinear, "discrete": the nearest pixel)."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.losses.set_prediction import GIOU_IMPLS
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide

ACTIVATIONS = ("relu", "gelu", "silu")
MODEL_TYPES = ("rt_detr", "rt_detr_v2")


@dataclass
class RTDetrConfig(ModelConfig):
    """transformers' names; each field's kind, meaning and constraint is declared with it."""

    model_type: str = changes_function("rt_detr", "which transformers model: 'rt_detr' (RTDetrForObjectDetection) or "
                                       "'rt_detr_v2' (RTDetrV2ForObjectDetection: decoder_n_levels, "
                                       "decoder_offset_scale, decoder_method)", choices=MODEL_TYPES)
    num_labels: int = weights_decide(80, "object classes (sigmoid per class, no 'no object' logit)", ge=1)
    id2label: dict | None = free(None, "class id -> name, as transformers' config; save_pretrained carries it")
    # -- the backbone: ResNet-vd (transformers' RTDetrResNetConfig names) ---------------------------
    layer_type: str = weights_decide("bottleneck", "'basic' (ResNet-18/34) or 'bottleneck' blocks",
                                     choices=("basic", "bottleneck"))
    depths: tuple[int, ...] = weights_decide((3, 4, 6, 3), "blocks per stage", ge=1, le=MAX_BLOCKS)
    hidden_sizes: tuple[int, ...] = weights_decide((256, 512, 1024, 2048), "each stage's output channels", ge=1)
    embedding_size: int = weights_decide(64, "the deep stem's channels (three 3x3 convolutions)", ge=2)
    num_channels: int = weights_decide(3, "image channels", ge=1)
    hidden_act: str = changes_function("relu", "the backbone's activation", choices=ACTIVATIONS)
    downsample_in_first_stage: bool = changes_function(False, "the first stage strides by 2")
    downsample_in_bottleneck: bool = changes_function(False, "a bottleneck strides in its first 1x1 convolution "
                                                      "(False: in its 3x3, ResNet-vd's)")
    backbone_out_indices: tuple[int, ...] = weights_decide((2, 3, 4), "the backbone stages whose feature maps feed "
                                                           "the encoder (transformers' out_indices; 2, 3, 4 = C3..C5)", ge=1)
    freeze_backbone_batch_norms: bool = changes_function(True, "the backbone's BatchNorms frozen (statistics and "
                                                         "affine as buffers), as transformers' default")
    # -- the hybrid encoder (AIFI on the coarsest map, then CCFM: FPN top-down, PAN bottom-up) -------
    encoder_hidden_dim: int = weights_decide(256, "the hybrid encoder's width", ge=1)
    encoder_in_channels: tuple[int, ...] = weights_decide((512, 1024, 2048), "the backbone feature maps' channels "
                                                          "(one per backbone_out_indices)", ge=1)
    feat_strides: tuple[int, ...] = changes_function((8, 16, 32), "the feature maps' strides (anchor_image_size's "
                                                     "anchors)", ge=1)
    encoder_layers: int = weights_decide(1, "AIFI transformer layers (0: none)", ge=0, le=MAX_BLOCKS)
    encoder_ffn_dim: int = weights_decide(1024, "AIFI MLP width", ge=1)
    encoder_attention_heads: int = changes_function(8, "AIFI attention heads", ge=1)
    encode_proj_layers: tuple[int, ...] = weights_decide((2,), "the feature maps AIFI runs on (index into the "
                                                         "backbone's maps)", ge=0)
    positional_encoding_temperature: int = changes_function(10000, "AIFI's 2-D sine embedding temperature", ge=1)
    encoder_activation_function: str = changes_function("gelu", "AIFI MLP activation", choices=ACTIVATIONS)
    activation_function: str = changes_function("silu", "the CCFM convolutions' activation", choices=ACTIVATIONS)
    eval_size: int | None = changes_function(None, "transformers' eval_size: when set, AIFI runs without its position "
                                             "embedding in eval mode (as transformers 5.17 does)")
    normalize_before: bool = changes_function(False, "AIFI layers pre-norm (False: post-norm)")
    hidden_expansion: float = weights_decide(1.0, "RepVGG / CSP width ratio", gt=0)
    # -- the decoder -----------------------------------------------------------------------------
    d_model: int = weights_decide(256, "the decoder's width", ge=1)
    num_queries: int = changes_function(300, "queries: the top-scoring encoder tokens", ge=1)
    decoder_in_channels: tuple[int, ...] = weights_decide((256, 256, 256), "the encoder's output channels per level "
                                                          "(a 1x1 projection each; entries beyond the encoder's outputs "
                                                          "project its coarsest map again, as transformers)", ge=1)
    decoder_ffn_dim: int = weights_decide(1024, "decoder MLP width", ge=1)
    num_feature_levels: int = weights_decide(3, "levels the decoder reads (more than decoder_in_channels: 3x3 "
                                             "stride-2 convolutions of the coarsest map)", ge=1)
    decoder_n_points: int = weights_decide(4, "sampling points per head and level in the cross-attention", ge=1)
    decoder_layers: int = weights_decide(6, "decoder layers", ge=1, le=MAX_BLOCKS)
    decoder_attention_heads: int = changes_function(8, "decoder attention heads", ge=1)
    decoder_activation_function: str = changes_function("relu", "decoder MLP activation", choices=ACTIVATIONS)
    layer_norm_eps: float = changes_function(1e-5, "LayerNorm epsilon", gt=0)
    batch_norm_eps: float = changes_function(1e-5, "the encoder's and projections' BatchNorm epsilon", gt=0)
    anchor_image_size: tuple[int, ...] | None = changes_function(None, "(height, width) whose anchors eval mode "
                                                                 "uses (None: from each input's feature maps)", ge=1)
    dropout: float = free(0.0, "dropout after attention and MLP blocks", ge=0, le=1)
    attention_dropout: float = free(0.0, "dropout on the decoder's attention probabilities", ge=0, le=1)
    activation_dropout: float = free(0.0, "dropout after the MLP activation", ge=0, le=1)
    # -- RT-DETRv2's decoder -------------------------------------------------------------------------
    decoder_n_levels: int = weights_decide(3, "rt_detr_v2: levels the cross-attention samples", ge=1)
    decoder_offset_scale: float = changes_function(0.5, "rt_detr_v2: scale of the sampling offsets around a box", gt=0)
    decoder_method: str = changes_function("default", "rt_detr_v2: 'default' (bilinear sampling) or 'discrete' "
                                           "(the nearest pixel)", choices=("default", "discrete"))
    # -- training: denoising queries and the set loss (transformers' names and defaults) -------------
    num_denoising: int = weights_decide(100, "denoising queries in training (0: none, and no denoising_class_embed)",
                                        ge=0)
    label_noise_ratio: float = free(0.5, "share of denoising labels redrawn", ge=0, le=1)
    box_noise_scale: float = free(1.0, "scale of the denoising boxes' noise", ge=0)
    learn_initial_query: bool = weights_decide(False, "learned initial queries (transformers 5.17 fails on True: "
                                               "refused)")
    auxiliary_loss: bool = free(True, "loss on every decoder layer, the encoder's top-k and the denoising queries")
    matcher_alpha: float = free(0.25, "the matcher's focal alpha", ge=0, le=1)
    matcher_gamma: float = free(2.0, "the matcher's focal gamma", ge=0)
    matcher_class_cost: float = free(2.0, "matching cost weight of the class", ge=0)
    matcher_bbox_cost: float = free(5.0, "matching cost weight of the L1 box distance", ge=0)
    matcher_giou_cost: float = free(2.0, "matching cost weight of the GIoU", ge=0)
    use_focal_loss: bool = free(True, "the matcher's class cost is focal (False: softmax probability)")
    focal_loss_alpha: float = free(0.75, "the varifocal loss's alpha", ge=0, le=1)
    focal_loss_gamma: float = free(2.0, "the varifocal loss's gamma", ge=0)
    weight_loss_vfl: float = free(1.0, "weight of the varifocal loss", ge=0)
    weight_loss_bbox: float = free(5.0, "weight of the L1 box loss", ge=0)
    weight_loss_giou: float = free(2.0, "weight of the GIoU loss", ge=0)
    eos_coefficient: float = free(1e-4, "transformers' eos_coefficient (unused by its RT-DETR loss)", gt=0)
    giou_impl: str = free("kernel", "how the set loss's GIoU term runs: " + "; ".join(f"{k}: {v}" for k, v in GIOU_IMPLS.items()),
                          choices=tuple(GIOU_IMPLS))
    gradient_checkpointing: bool = free(False, "transformers' legacy field: the model is built with gradient "
                                        "checkpointing on (as gradient_checkpointing_enable())")

    def validate(self):
        n = len(self.depths)
        if len(self.hidden_sizes) != n:
            raise ConfigError(f"hidden_sizes={self.hidden_sizes} needs one width per stage of depths={self.depths}",
                              fields=("hidden_sizes", "depths"))
        if self.layer_type == "basic" and self.embedding_size != self.hidden_sizes[0] and not self.downsample_in_first_stage:
            raise ConfigError(f"basic blocks: embedding_size={self.embedding_size} -> hidden_sizes[0]={self.hidden_sizes[0]} "
                              f"pools the first stage's shortcut (2x2) while its convolutions keep the size (transformers "
                              f"fails on it): make them equal or set downsample_in_first_stage=True",
                              fields=("embedding_size", "hidden_sizes", "downsample_in_first_stage"))
        if self.layer_type == "bottleneck" and min(self.hidden_sizes) < 4:
            raise ConfigError(f"bottleneck blocks: hidden_sizes={self.hidden_sizes} must be at least 4 (a block's inner "
                              f"width is a quarter)", fields=("hidden_sizes", "layer_type"))
        if int(self.encoder_hidden_dim * self.hidden_expansion) < 1:
            raise ConfigError(f"hidden_expansion={self.hidden_expansion}: the CSP / RepVGG width int(encoder_hidden_dim * "
                              f"hidden_expansion) must be at least 1", fields=("hidden_expansion", "encoder_hidden_dim"))
        outs = tuple(self.backbone_out_indices)
        if list(outs) != list(range(outs[0], outs[0] + len(outs))) or outs[0] < 1 or outs[-1] > n:
            raise ConfigError(f"backbone_out_indices={outs}: consecutive stage numbers in 1..{n} (the encoder's FPN "
                              f"upsamples each map 2x onto the next finer one)", fields=("backbone_out_indices", "depths"))
        if len(self.encoder_in_channels) != len(outs):
            raise ConfigError(f"encoder_in_channels={self.encoder_in_channels}: one per backbone feature map "
                              f"(backbone_out_indices={outs})", fields=("encoder_in_channels", "backbone_out_indices"))
        if any(i >= len(outs) for i in self.encode_proj_layers):
            raise ConfigError(f"encode_proj_layers={self.encode_proj_layers}: indices of the {len(outs)} backbone maps",
                              fields=("encode_proj_layers", "backbone_out_indices"))
        if len(self.decoder_in_channels) < len(outs) or any(c != self.encoder_hidden_dim for c in self.decoder_in_channels):
            raise ConfigError(f"decoder_in_channels={self.decoder_in_channels}: one per encoder output ({len(outs)}; more "
                              f"project the coarsest again, as transformers), each encoder_hidden_dim="
                              f"{self.encoder_hidden_dim} wide", fields=("decoder_in_channels", "encoder_hidden_dim"))
        if self.num_feature_levels < len(outs):
            raise ConfigError(f"num_feature_levels={self.num_feature_levels}: at least the encoder's {len(outs)} maps",
                              fields=("num_feature_levels", "backbone_out_indices"))
        for dim, heads, what in ((self.encoder_hidden_dim, self.encoder_attention_heads, "encoder"),
                                 (self.d_model, self.decoder_attention_heads, "decoder")):
            if dim % heads:
                raise ConfigError(f"{what}: width {dim} is not divisible by {what}_attention_heads={heads}",
                                  fields=(f"{what}_attention_heads",))
        if self.encoder_hidden_dim % 4:
            raise ConfigError(f"encoder_hidden_dim={self.encoder_hidden_dim}: AIFI's 2-D sine embedding needs a "
                              f"multiple of 4", fields=("encoder_hidden_dim",))
        if self.learn_initial_query:
            raise ConfigError("learn_initial_query=True: transformers 5.17's RTDetrModel calls .tile on its "
                              "nn.Embedding and fails; fastzoo reproduces transformers, so it is refused",
                              fields=("learn_initial_query",))
        if self.model_type == "rt_detr_v2" and self.decoder_n_levels != self.num_feature_levels:
            raise ConfigError(f"rt_detr_v2: decoder_n_levels={self.decoder_n_levels} must equal num_feature_levels="
                              f"{self.num_feature_levels} (the levels the decoder is given)",
                              fields=("decoder_n_levels", "num_feature_levels"))
        if self.anchor_image_size is not None and len(self.anchor_image_size) != 2:
            raise ConfigError(f"anchor_image_size={self.anchor_image_size}: (height, width)", fields=("anchor_image_size",))
        if self.anchor_image_size is not None and min(self.anchor_image_size) < max(self.feat_strides):
            raise ConfigError(f"anchor_image_size={self.anchor_image_size}: smaller than the coarsest of feat_strides="
                              f"{self.feat_strides} (a map of no position)", fields=("anchor_image_size", "feat_strides"))
        if self.anchor_image_size is not None and len(self.feat_strides) != self.num_feature_levels:
            raise ConfigError(f"anchor_image_size: feat_strides={self.feat_strides} needs one stride per decoder level "
                              f"(num_feature_levels={self.num_feature_levels})", fields=("feat_strides", "anchor_image_size"))

    @property
    def v2(self) -> bool:
        return self.model_type == "rt_detr_v2"
