"""DETR's config: transformers' ``DetrConfig`` field names and defaults (``facebook/detr-resnet-50``;
``dilation=True``: ``facebook/detr-resnet-50-dc5``), the backbone's sizes under ``ResNetConfig``'s
names, and the set loss's settings."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.losses.set_prediction import GIOU_IMPLS
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide

# which backbone parameters are frozen: transformers 5.17 freezes nothing of its timm backbone (its
# freezing rule asks for "resnet" in the backbone's model_type, "timm_backbone") and all of its own
# ResNet backbone (its rule keeps names with "stage.1".."stage.3", which "stages.N" never contains)
FREEZE = ("transformers", "stem_and_first_stage", "all", "none")
ACTIVATIONS = ("relu", "gelu", "silu")
# timm's ResNets that DETR's timm path names (``backbone=``), by block and depths
TIMM_RESNETS = {"resnet18": ("basic", (2, 2, 2, 2)), "resnet34": ("basic", (3, 4, 6, 3)),
                "resnet50": ("bottleneck", (3, 4, 6, 3)), "resnet101": ("bottleneck", (3, 4, 23, 3)),
                "resnet152": ("bottleneck", (3, 8, 36, 3))}
TIMM_WIDTHS = {"basic": (64, 128, 256, 512), "bottleneck": (256, 512, 1024, 2048)}
# transformers' ResNetConfig defaults: its own ResNet's sizes where use_timm_backbone=False leaves them out
RESNET_DEFAULTS = {"layer_type": "bottleneck", "depths": (3, 4, 6, 3), "hidden_sizes": (256, 512, 1024, 2048),
                   "embedding_size": 64}


@dataclass
class DetrConfig(ModelConfig):
    """transformers' names; each field's kind, meaning and constraint is declared with it."""

    num_labels: int = weights_decide(91, "object classes (COCO's ids run to 90); logits have one more: no object", ge=1)
    id2label: dict | None = free(None, "class id -> name, as transformers' config (None: transformers' LABEL_<id>); "
                                 "post-processing and save_pretrained carry it")
    num_queries: int = weights_decide(100, "object queries: the most objects an image can hold", ge=1)
    d_model: int = weights_decide(256, "width of the transformer", ge=4)
    encoder_layers: int = weights_decide(6, "encoder layers", ge=1, le=MAX_BLOCKS)
    decoder_layers: int = weights_decide(6, "decoder layers", ge=1, le=MAX_BLOCKS)
    encoder_ffn_dim: int = weights_decide(2048, "encoder MLP width", ge=1)
    decoder_ffn_dim: int = weights_decide(2048, "decoder MLP width", ge=1)
    encoder_attention_heads: int = changes_function(8, "encoder attention heads", ge=1)
    decoder_attention_heads: int = changes_function(8, "decoder attention heads", ge=1)
    activation_function: str = changes_function("relu", "the MLPs' activation", choices=ACTIVATIONS)
    position_embedding_type: str = changes_function("sine", "position embedding of the feature map (sine, as DETR)",
                                                    choices=("sine",))
    dropout: float = free(0.1, "dropout after attention and MLP blocks", ge=0, le=1)
    init_std: float = free(0.02, "std of transformers' normal init of a fresh model's linear and convolution weights "
                           "outside the backbone (no effect on loaded weights)", ge=0)
    attention_dropout: float = free(0.0, "dropout on the attention probabilities", ge=0, le=1)
    activation_dropout: float = free(0.0, "dropout after the MLP activation", ge=0, le=1)
    auxiliary_loss: bool = changes_function(False, "decoder output of every layer through the shared LayerNorm and "
                                            "heads (transformers feeds each layer the normalised output), and a "
                                            "loss on each")
    # -- the backbone: a ResNet (transformers' ResNetConfig names) -----------------------------------
    use_timm_backbone: bool = weights_decide(True, "transformers' choice of ResNet module: timm's (torchvision's names; "
                                             "the hub checkpoints) or, False, transformers' own ResNetBackbone")
    backbone: str | None = weights_decide(None, "timm's model name of the backbone, as transformers' DetrConfig.backbone "
                                          "(use_timm_backbone only; None: 'resnet50'); it sets layer_type, depths, "
                                          "hidden_sizes and embedding_size", choices=tuple(TIMM_RESNETS))
    dilation: bool = changes_function(False, "DC5: the backbone's last stage dilated (by 2) instead of strided, so "
                                      "its feature map has stride 16, as transformers' dilation=True asks of timm "
                                      "(output_stride=16); timm's backbone only (transformers' own has no dilation)")
    layer_type: str | None = weights_decide(None, "'basic' (ResNet-18/34) or 'bottleneck' blocks (None: from backbone, "
                                            "or transformers' ResNetConfig default)", choices=("basic", "bottleneck"))
    depths: tuple[int, ...] | None = weights_decide(None, "blocks per stage (None: from backbone, or ResNet-50's)",
                                                    ge=1, le=MAX_BLOCKS)
    hidden_sizes: tuple[int, ...] | None = weights_decide(None, "each stage's output channels (None: from backbone, "
                                                          "or ResNet-50's)", ge=1)
    embedding_size: int | None = weights_decide(None, "the stem's channels (None: 64)", ge=1)
    num_channels: int = weights_decide(3, "image channels", ge=1)
    freeze_backbone: str = free("transformers", "which backbone parameters are frozen: 'transformers' (as "
                                "transformers 5.17 builds it: none of the timm backbone, all of its own ResNet "
                                "backbone) | 'stem_and_first_stage' (DETR's paper: layer2-4 train) | 'all' | 'none'",
                                choices=FREEZE)
    # -- the set loss (transformers' names and defaults) -------------------------------------------
    class_cost: float = free(1.0, "matching cost weight of the class probability", ge=0)
    bbox_cost: float = free(5.0, "matching cost weight of the L1 box distance", ge=0)
    giou_cost: float = free(2.0, "matching cost weight of the GIoU", ge=0)
    bbox_loss_coefficient: float = free(5.0, "weight of the L1 box loss", ge=0)
    giou_loss_coefficient: float = free(2.0, "weight of the GIoU loss", ge=0)
    eos_coefficient: float = free(0.1, "class weight of 'no object' in the cross-entropy", gt=0)
    giou_impl: str = free("kernel", "how the set loss's GIoU term runs: " + "; ".join(f"{k}: {v}" for k, v in GIOU_IMPLS.items()),
                          choices=tuple(GIOU_IMPLS))
    channels_last: bool = free(False, "NHWC backbone parameters and activations")
    gradient_checkpointing: bool = free(False, "transformers' legacy field: the model is built with gradient "
                                        "checkpointing on (as gradient_checkpointing_enable())")

    def validate(self):
        self._backbone_sizes()
        if self.d_model % 4:  # d_model / 2 features per axis, in (sin, cos) pairs
            raise ConfigError(f"d_model={self.d_model}: the sine position embedding needs a multiple of 4 (d_model / 2 "
                              f"features per axis, in sin / cos pairs)", fields=("d_model",))
        if not self.use_timm_backbone and self.layer_type == "bottleneck" and min(self.hidden_sizes) < 4:
            raise ConfigError(f"hidden_sizes={self.hidden_sizes}: transformers' bottleneck is a quarter of its output "
                              f"wide, so each stage needs at least 4 channels", fields=("hidden_sizes", "layer_type"))
        for heads, name in ((self.encoder_attention_heads, "encoder_attention_heads"),
                            (self.decoder_attention_heads, "decoder_attention_heads")):
            if self.d_model % heads:
                raise ConfigError(f"d_model={self.d_model} is not divisible by {name}={heads}", fields=("d_model", name))
        if len(self.depths) != len(self.hidden_sizes):
            raise ConfigError(f"depths={self.depths} and hidden_sizes={self.hidden_sizes} must have the same length",
                              fields=("depths", "hidden_sizes"))
        if self.id2label is not None:
            if not isinstance(self.id2label, dict) or sorted(map(int, self.id2label)) != list(range(self.num_labels)):
                raise ConfigError(f"id2label must map every class id 0..{self.num_labels - 1} (num_labels={self.num_labels}) "
                                  f"to a name, got {len(self.id2label) if isinstance(self.id2label, dict) else self.id2label!r}"
                                  f"{' ids' if isinstance(self.id2label, dict) else ''}; give num_labels and id2label together",
                                  fields=("id2label", "num_labels"))
            self.id2label = {int(k): str(v) for k, v in self.id2label.items()}
        if self.class_cost == self.bbox_cost == self.giou_cost == 0:
            raise ConfigError("class_cost, bbox_cost and giou_cost are all 0: the matching has no cost",
                              fields=("class_cost", "bbox_cost", "giou_cost"))
        if self.dilation and not self.use_timm_backbone:
            raise ConfigError("dilation=True (DC5) needs use_timm_backbone=True: transformers' ResNetBackbone has no "
                              "dilation (transformers builds it undilated whatever dilation says)",
                              fields=("dilation", "use_timm_backbone"))

    def _backbone_sizes(self):
        """The backbone's sizes: from the timm name ``backbone`` (use_timm_backbone; sizes given beside it
        must agree), else the fields given, transformers' ``ResNetConfig`` defaults for the rest."""
        sizes = ("layer_type", "depths", "hidden_sizes", "embedding_size")
        if not self.use_timm_backbone:
            if self.backbone is not None:
                raise ConfigError(f"backbone={self.backbone!r} names timm's model, which use_timm_backbone=False does not "
                                  f"build (transformers' own ResNet takes layer_type, depths, hidden_sizes, "
                                  f"embedding_size); drop backbone or set use_timm_backbone=True",
                                  fields=("backbone", "use_timm_backbone"))
            for name in sizes:
                if getattr(self, name) is None:
                    setattr(self, name, RESNET_DEFAULTS[name])
            return
        self.backbone = self.backbone or "resnet50"
        block, depths = TIMM_RESNETS[self.backbone]
        implied = {"layer_type": block, "depths": depths, "hidden_sizes": TIMM_WIDTHS[block], "embedding_size": 64}
        for name in sizes:
            given = getattr(self, name)
            if given is not None and given != implied[name]:
                raise ConfigError(f"{name}={given!r} with backbone={self.backbone!r}: timm's {self.backbone} has "
                                  f"{name}={implied[name]!r}; name another timm ResNet ({', '.join(TIMM_RESNETS)}), or "
                                  f"use_timm_backbone=False for transformers' own ResNet at any sizes",
                                  fields=(name, "backbone"))
            setattr(self, name, implied[name])

    is_encoder_decoder = True  # transformers' DetrConfig says so (read by its tools); not a field

    @property
    def num_classes(self) -> int:
        return self.num_labels
