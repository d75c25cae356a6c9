"""D-FINE's config: transformers' ``DFineConfig`` field names and defaults, the HGNetV2 backbone's sizes under
``HGNetV2Config``'s names, the fields it shares with RT-DETR (:class:`~fastzoo.models.rt_detr.config.HybridDetrConfig`),
and its differences: the encoder's depth (``depth_mult``), the decoder's distribution of box edges
(``max_num_bins``, ``reg_scale``, ``up``), its quality estimate (``top_prob_values``, ``lqe_*``) and the set loss's
distribution terms (``weight_loss_fgl``, ``weight_loss_ddf``)."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.models.config import MAX_BLOCKS, changes_function, free, weights_decide
from fastzoo.models.rt_detr.config import HybridDetrConfig


@dataclass
class DFineConfig(HybridDetrConfig):
    """transformers' names; each field's kind, meaning and constraint is declared with it."""

    model_type: str = changes_function("d_fine", "which transformers model: 'd_fine' (DFineForObjectDetection)",
                                       choices=("d_fine",))
    # -- the backbone: HGNetV2 (transformers' HGNetV2Config names) ----------------------------------
    stem_channels: tuple[int, ...] = weights_decide((3, 32, 48), "the stem's (input, inner, output) channels", ge=1)
    stage_in_channels: tuple[int, ...] = weights_decide((48, 128, 512, 1024), "each stage's input channels", ge=1)
    stage_mid_channels: tuple[int, ...] = weights_decide((48, 96, 192, 384), "each stage's inner convolutions' "
                                                         "channels", ge=1)
    stage_out_channels: tuple[int, ...] = weights_decide((128, 512, 1024, 2048), "each stage's output channels", ge=2)
    stage_num_blocks: tuple[int, ...] = weights_decide((1, 1, 3, 1), "blocks per stage", ge=1, le=MAX_BLOCKS)
    stage_downsample: tuple[bool, ...] = weights_decide((False, True, True, True), "the stage starts with a "
                                                        "depthwise 3x3 stride-2 convolution")
    stage_light_block: tuple[bool, ...] = weights_decide((False, False, True, True), "the stage's convolutions are "
                                                         "light (1x1 then depthwise)")
    stage_kernel_size: tuple[int, ...] = weights_decide((3, 3, 5, 5), "each stage's convolution kernel", ge=1)
    stage_numb_of_layers: tuple[int, ...] = weights_decide((6, 6, 6, 6), "convolutions per block", ge=1,
                                                           le=MAX_BLOCKS)
    use_learnable_affine_block: bool = weights_decide(False, "a learned scale and bias after each activation")
    # -- D-FINE's encoder and decoder ----------------------------------------------------------------
    depth_mult: float = weights_decide(1.0, "RepNCSPELAN4 blocks: round(3 x depth_mult) RepVGG blocks per CSP layer",
                                       ge=0, compare=lambda c: round(3 * c.depth_mult))
    hidden_expansion: float = weights_decide(1.0, "RepNCSPELAN4's branch width ratio (elan_width)", gt=0,
                                             compare=lambda c: c.elan_width)
    decoder_n_points: tuple[int, ...] = weights_decide((4, 4, 4), "sampling points per head on each decoder level",
                                                       ge=1)
    eval_idx: int = changes_function(-1, "the decoder layer whose output eval mode gives (transformers 5.17 runs only "
                                     "the last: -1 or decoder_layers - 1)")
    max_num_bins: int = weights_decide(32, "bins of each box edge's distribution (even, at least 4)", ge=4)
    reg_scale: float = changes_function(4.0, "the weighting function's curvature (the decoder's reg_scale and the "
                                        "loss's)", gt=0)
    up: float = changes_function(0.5, "the weighting function's upper bound (the decoder's up and the loss's)", gt=0)
    top_prob_values: int = weights_decide(4, "the largest probabilities of each edge the quality estimate reads", ge=1)
    lqe_hidden_dim: int = weights_decide(64, "the quality estimate's MLP width", ge=1)
    lqe_layers: int = weights_decide(2, "the quality estimate's MLP layers", ge=1, le=MAX_BLOCKS)
    weight_loss_fgl: float = free(0.15, "weight of the fine-grained localisation loss", ge=0)
    weight_loss_ddf: float = free(1.5, "weight of the decoupled distillation focal loss", ge=0)

    @property
    def backbone_stages(self) -> int:
        return len(self.stage_out_channels)

    @property
    def map_strides(self) -> list[int]:
        """The stem strides by 4, each downsampling stage by 2 more."""
        return [4 * 2 ** sum(self.stage_downsample[:i]) for i in self.backbone_out_indices]

    @property
    def elan_width(self) -> int:
        """RepNCSPELAN4's branch width, transformers' ``round(hidden_expansion * encoder_hidden_dim // 2)``."""
        return round(self.hidden_expansion * self.encoder_hidden_dim // 2)

    def validate(self):
        stages = ("stage_in_channels", "stage_mid_channels", "stage_out_channels", "stage_num_blocks", "stage_downsample",
                  "stage_light_block", "stage_kernel_size", "stage_numb_of_layers")
        n = len(self.stage_out_channels)
        if any(len(getattr(self, f)) != n for f in stages):
            raise ConfigError(f"{', '.join(stages)}: one value per stage each ({n} in stage_out_channels)", fields=stages)
        if len(self.stem_channels) != 3 or self.stem_channels[0] != self.num_channels:
            raise ConfigError(f"stem_channels={self.stem_channels}: (num_channels={self.num_channels}, inner, output)",
                              fields=("stem_channels", "num_channels"))
        ins = (self.stem_channels[2], *self.stage_out_channels[:-1])
        if tuple(self.stage_in_channels) != ins:
            raise ConfigError(f"stage_in_channels={self.stage_in_channels}: each stage reads the previous one's output "
                              f"(the stem's first): {ins}", fields=("stage_in_channels", "stage_out_channels"))
        if any(k % 2 == 0 for k in self.stage_kernel_size):
            raise ConfigError(f"stage_kernel_size={self.stage_kernel_size}: odd sizes (an even kernel's padding shrinks the "
                              f"map, and a block's concatenation fails in transformers)", fields=("stage_kernel_size",))
        super().validate()
        unhalved = [i for i in self.backbone_out_indices[1:] if not self.stage_downsample[i - 1]]
        if unhalved:
            raise ConfigError(f"stage_downsample={self.stage_downsample}: the stages {unhalved} of backbone_out_indices="
                              f"{self.backbone_out_indices} keep their input's size, while the encoder's FPN needs each map "
                              f"half the previous one", fields=("stage_downsample", "backbone_out_indices"))
        widths = tuple(self.stage_out_channels[i - 1] for i in self.backbone_out_indices)
        if tuple(self.encoder_in_channels) != widths:
            raise ConfigError(f"encoder_in_channels={self.encoder_in_channels}: the backbone maps' channels {widths}",
                              fields=("encoder_in_channels", "stage_out_channels", "backbone_out_indices"))
        if self.elan_width < 1:
            raise ConfigError(f"hidden_expansion={self.hidden_expansion}: RepNCSPELAN4's width round(hidden_expansion * "
                              f"encoder_hidden_dim // 2) must be at least 1", fields=("hidden_expansion",))
        if len(self.decoder_n_points) != self.num_feature_levels:
            raise ConfigError(f"decoder_n_points={self.decoder_n_points}: one per decoder level (num_feature_levels="
                              f"{self.num_feature_levels})", fields=("decoder_n_points", "num_feature_levels"))
        if self.eval_idx not in (-1, self.decoder_layers - 1):
            raise ConfigError(f"eval_idx={self.eval_idx}: transformers 5.17 indexes its per-layer heads past their end "
                              f"for an earlier layer; use -1 (the last)", fields=("eval_idx",))
        if self.max_num_bins % 2:
            raise ConfigError(f"max_num_bins={self.max_num_bins}: even (the weighting function has max_num_bins + 1 "
                              f"values only then)", fields=("max_num_bins",))
        if self.top_prob_values > self.max_num_bins + 1:
            raise ConfigError(f"top_prob_values={self.top_prob_values}: at most max_num_bins + 1 = {self.max_num_bins + 1}",
                              fields=("top_prob_values", "max_num_bins"))
