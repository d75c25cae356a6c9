"""ViT config: timm ``VisionTransformer``'s field names and defaults."""
from __future__ import annotations

from dataclasses import dataclass

from fastzoo.errors import ConfigError
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide
from fastzoo.models.vit.hf_config import check as check_hf_config

POOLS = ("token", "avg", "map", "token_avg", "")
HF_PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")

@dataclass
class ViTConfig(ModelConfig):
    """timm ``VisionTransformer`` field names and defaults; each field's kind (see
    :mod:`fastzoo.models.config`), meaning and constraint is declared with it."""

    img_size: int | tuple[int, int] = weights_decide(224, "input height and width (an int: square)", ge=1,
                                                      multiple_of="patch_size")
    patch_size: int = weights_decide(16, "side of a square patch", ge=1)
    in_chans: int = weights_decide(3, "image channels", ge=1)
    num_classes: int = weights_decide(1000, "classifier outputs; 0: no head, forward returns features", ge=0)
    global_pool: str = changes_function("token", "pooling before the head: the class token, the mean patch token, 'map' "
                                        "(a learned query attends to every token: SigLIP), 'token_avg' (class token and "
                                        "mean patch token concatenated: DINOv2's classifier); '' (none): forward_head "
                                        "returns every token", choices=POOLS)
    embed_dim: int = weights_decide(768, "token width D", ge=1, multiple_of="num_heads")
    depth: int = weights_decide(12, "transformer blocks", ge=1, le=MAX_BLOCKS)
    num_heads: int = changes_function(12, "attention heads", ge=1)
    mlp_ratio: float = weights_decide(4.0, "MLP hidden width / embed_dim", gt=0,
                                      compare=lambda c: int(c.embed_dim * c.mlp_ratio))  # the width the weights have
    qkv_bias: bool = weights_decide(True, "bias in the q, k, v projection")
    class_token: bool = weights_decide(True, "a learned class token before the patches")
    reg_tokens: int = weights_decide(0, "register tokens (Darcet et al. 2024)", ge=0)
    dist_token: bool = weights_decide(False, "a distillation token after the class token (DeiT, Touvron et al. 2021)")
    distilled_head: bool = weights_decide(False, "a second classifier (head_dist) on the distillation token; logits are "
                                          "the mean of both heads' (DeiT distilled)")
    mask_token: bool = weights_decide(False, "a learned token that replaces masked patches (transformers' "
                                      "bool_masked_pos: DINOv2, masked image modeling)")
    pooler: bool = weights_decide(False, "transformers ViTModel's pooler: tanh(Linear(class token)) after the final norm")
    mlp_layer: str = weights_decide("mlp", "the block's MLP: 'mlp' (fc1, act, fc2) or 'swiglu_packed' (fc1 gives gate "
                                    "and value, SiLU gate: DINOv2-giant)", choices=("mlp", "swiglu_packed"))
    no_embed_class: bool = weights_decide(False, "position embedding covers patch tokens only (DeiT-3)")
    pre_norm: bool = weights_decide(False, "LayerNorm before the blocks (CLIP)")
    fc_norm: bool | None = weights_decide(None, "final LayerNorm after pooling; None: timm's rule, only with avg pooling",
                                          compare=lambda c: c.use_fc_norm)
    init_values: float | None = weights_decide(None, "LayerScale init; None: no LayerScale",
                                               compare=lambda c: c.init_values is not None)  # the init is overwritten
    norm_eps: float = changes_function(1e-6, "LayerNorm epsilon", gt=0)
    act_layer: str = changes_function("gelu", "MLP activation (quick_gelu: OpenAI CLIP; gelu_tanh: SigLIP)",
                                      choices=("gelu", "quick_gelu", "gelu_tanh"))
    patch_embed: str = free("conv", "patch projection as a Conv2d or reshape + Linear: the same function",
                            choices=("conv", "linear"))
    drop_rate: float = free(0.0, "dropout before the head", ge=0, le=1)
    pos_drop_rate: float = free(0.0, "dropout after the position embedding", ge=0, le=1)
    attn_drop_rate: float = free(0.0, "attention dropout", ge=0, le=1)
    proj_drop_rate: float = free(0.0, "dropout after the attention and MLP projections", ge=0, le=1)
    drop_path_rate: float = free(0.0, "stochastic depth of the last block (linear from 0)", ge=0, le=1)
    hf_config: dict | None = free(None, "the transformers config this model came from or stands in for (its class, "
                                  "labels, problem_type): the labels= loss rule and the save_pretrained format follow it; "
                                  "refused where its class is another network than the other fields'")

    def validate(self):
        if isinstance(self.img_size, int):
            self.img_size = (self.img_size, self.img_size)
        if int(self.embed_dim * self.mlp_ratio) < 1:
            raise ConfigError(f"mlp_ratio={self.mlp_ratio} gives an MLP of int({self.embed_dim} * {self.mlp_ratio}) = 0 "
                              f"hidden units; the hidden width embed_dim * mlp_ratio must be at least 1",
                              fields=("mlp_ratio", "embed_dim"))
        if self.global_pool in ("token", "token_avg") and not self.class_token:
            raise ConfigError(f"global_pool={self.global_pool!r} needs class_token=True; use global_pool='avg' without "
                              f"a class token", fields=("global_pool", "class_token"))
        if self.global_pool == "token_avg" and self.fc_norm:
            raise ConfigError("global_pool='token_avg' norms every token before pooling (DINOv2's classifier), it has no "
                              "norm after pooling: use fc_norm=None or False", fields=("global_pool", "fc_norm"))
        if self.dist_token and not self.class_token:
            raise ConfigError("dist_token=True needs class_token=True (DeiT's tokens: class, distillation, patches)",
                              fields=("dist_token", "class_token"))
        if self.distilled_head and not (self.dist_token and self.num_classes and self.global_pool == "token"):
            raise ConfigError("distilled_head=True needs dist_token=True, num_classes > 0 and global_pool='token'",
                              fields=("distilled_head", "dist_token", "num_classes", "global_pool"))
        if self.pooler and self.global_pool != "token":
            raise ConfigError("pooler=True pools the class token: it needs global_pool='token'", fields=("pooler", "global_pool"))
        if self.mlp_layer == "swiglu_packed" and int(self.embed_dim * self.mlp_ratio) % 2:
            raise ConfigError(f"mlp_layer='swiglu_packed' splits fc1's int(embed_dim * mlp_ratio) = "
                              f"{int(self.embed_dim * self.mlp_ratio)} outputs into gate and value: it must be even",
                              fields=("mlp_layer", "mlp_ratio", "embed_dim"))
        if self.hf_config is not None and not isinstance(self.hf_config, dict):
            raise ConfigError(f"hf_config must be a dict (a transformers config's to_dict()), got "
                              f"{type(self.hf_config).__name__}", fields=("hf_config",))
        if self.hf_config is not None:
            check_hf_config(self)

    @property
    def num_features(self) -> int:
        return self.embed_dim

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + int(self.dist_token) + self.reg_tokens

    @property
    def head_in_features(self) -> int:
        """The classifier's input width: twice embed_dim for 'token_avg' (class and mean patch token)."""
        return 2 * self.embed_dim if self.global_pool == "token_avg" else self.embed_dim

    @property
    def use_fc_norm(self) -> bool:
        """timm's rule: the final LayerNorm goes after pooling with avg pooling, before it otherwise."""
        return self.global_pool == "avg" if self.fc_norm is None else self.fc_norm
