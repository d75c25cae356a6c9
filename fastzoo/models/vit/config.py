"""ViT config: timm ``VisionTransformer``'s field names and defaults."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide

POOLS = ("token", "avg", "")

@dataclass
class ViTConfig(ModelConfig):
    """timm ``VisionTransformer`` field names and defaults; each field's kind (see
    :mod:`fastzoo.models.config`), meaning and constraint is declared with it."""

    img_size: int | tuple[int, int] = weights_decide(224, "input height and width (an int: square)", ge=1,
                                                      multiple_of="patch_size")
    patch_size: int = weights_decide(16, "side of a square patch", ge=1)
    in_chans: int = weights_decide(3, "image channels", ge=1)
    num_classes: int = weights_decide(1000, "classifier outputs; 0: no head, forward returns features", ge=0)
    global_pool: str = changes_function("token", "pooling before the head; '' (none): forward_head returns every token",
                                        choices=POOLS)
    embed_dim: int = weights_decide(768, "token width D", ge=1, multiple_of="num_heads")
    depth: int = weights_decide(12, "transformer blocks", ge=1, le=MAX_BLOCKS)
    num_heads: int = changes_function(12, "attention heads", ge=1)
    mlp_ratio: float = weights_decide(4.0, "MLP hidden width / embed_dim", gt=0)
    qkv_bias: bool = weights_decide(True, "bias in the q, k, v projection")
    class_token: bool = weights_decide(True, "a learned class token before the patches")
    reg_tokens: int = weights_decide(0, "register tokens (Darcet et al. 2024)", ge=0)
    no_embed_class: bool = weights_decide(False, "position embedding covers patch tokens only (DeiT-3)")
    pre_norm: bool = weights_decide(False, "LayerNorm before the blocks (CLIP)")
    fc_norm: bool | None = weights_decide(None, "final LayerNorm after pooling; None: timm's rule, only with avg pooling",
                                          compare=lambda c: c.use_fc_norm)
    init_values: float | None = weights_decide(None, "LayerScale init; None: no LayerScale",
                                               compare=lambda c: c.init_values is not None)  # the init is overwritten
    norm_eps: float = changes_function(1e-6, "LayerNorm epsilon", gt=0)
    act_layer: str = changes_function("gelu", "MLP activation (quick_gelu: OpenAI CLIP)", choices=("gelu", "quick_gelu"))
    patch_embed: str = free("conv", "patch projection as a Conv2d or reshape + Linear: the same function",
                            choices=("conv", "linear"))
    drop_rate: float = free(0.0, "dropout before the head", ge=0, le=1)
    pos_drop_rate: float = free(0.0, "dropout after the position embedding", ge=0, le=1)
    attn_drop_rate: float = free(0.0, "attention dropout", ge=0, le=1)
    proj_drop_rate: float = free(0.0, "dropout after the attention and MLP projections", ge=0, le=1)
    drop_path_rate: float = free(0.0, "stochastic depth of the last block (linear from 0)", ge=0, le=1)

    def validate(self):
        if isinstance(self.img_size, int):
            self.img_size = (self.img_size, self.img_size)
        if int(self.embed_dim * self.mlp_ratio) < 1:
            raise ConfigError(f"mlp_ratio={self.mlp_ratio} gives an MLP of int({self.embed_dim} * {self.mlp_ratio}) = 0 "
                              f"hidden units; the hidden width embed_dim * mlp_ratio must be at least 1",
                              fields=("mlp_ratio", "embed_dim"))
        if self.global_pool == "token" and not self.class_token:
            raise ConfigError("global_pool='token' needs class_token=True; use global_pool='avg' without a class token",
                              fields=("global_pool", "class_token"))

    @property
    def num_features(self) -> int:
        return self.embed_dim

    @property
    def use_fc_norm(self) -> bool:
        """timm's rule: the final LayerNorm goes after pooling with avg pooling, before it otherwise."""
        return self.global_pool == "avg" if self.fc_norm is None else self.fc_norm
