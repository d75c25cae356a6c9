"""timm checkpoints. fastzoo's ViT uses timm's parameter names, so conversion is a check
that the keys are timm's, plus reading from the weights what they fix of the architecture."""
from __future__ import annotations

import math

import torch


class _TimmViT:
    format = "timm"

    @staticmethod
    def matches(state: dict) -> bool:
        return "patch_embed.proj.weight" in state and "blocks.0.attn.qkv.weight" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return dict(state)

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return {k: v for k, v in state.items()}

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        """Config fields that the weights decide and a user would not retype: the head,
        the prefix tokens and pooling, and the image size (from the position embedding)."""
        out = {}
        out["num_classes"] = state["head.weight"].shape[0] if "head.weight" in state else 0
        out["class_token"] = "cls_token" in state
        out["reg_tokens"] = state["reg_token"].shape[1] if "reg_token" in state else 0
        if "fc_norm.weight" in state:
            out["global_pool"] = "avg"
        elif not out["class_token"]:
            out["global_pool"] = "avg"
        else:
            out["global_pool"] = "token"
        patch = state["patch_embed.proj.weight"].shape[-1]
        if "pos_embed" in state:
            n = state["pos_embed"].shape[1]
            prefix = int(out["class_token"]) + out["reg_tokens"]
            for cand in (n - prefix, n):  # with / without prefix tokens in the embedding
                side = math.isqrt(cand)
                if side * side == cand:
                    out["img_size"] = side * patch
                    out["no_embed_class"] = cand == n and prefix > 0
                    break
        if module is not None:  # a live timm model says exactly what it was built with
            pe = getattr(module, "patch_embed", None)
            if pe is not None and getattr(pe, "img_size", None) is not None:
                out["img_size"] = tuple(pe.img_size)
            if hasattr(module, "no_embed_class"):
                out["no_embed_class"] = bool(module.no_embed_class)
            if getattr(module, "global_pool", None) in ("token", "avg"):
                out["global_pool"] = module.global_pool
            block = module.blocks[0] if hasattr(module, "blocks") else None
            if block is not None and hasattr(block, "attn") and hasattr(block.attn, "num_heads"):
                out["num_heads"] = block.attn.num_heads
            if block is not None and isinstance(getattr(block, "norm1", None), torch.nn.LayerNorm):
                out["norm_eps"] = block.norm1.eps
        return out


VIT = _TimmViT()


# timm's ResNet has torchvision's keys (checked against timm.create_model("resnet50")).
from fastzoo.weights.torchvision import ResNetConverter  # noqa: E402

RESNET = ResNetConverter("timm")
