"""timm checkpoints. fastzoo's ViT uses timm's parameter names, so conversion is a check
that the keys are timm's, plus reading what the checkpoint fixes of the architecture: from
the keys of a state dict, or everything, from a live timm module."""
from __future__ import annotations

import math

from torch import nn

from fastzoo.errors import CheckpointError
from fastzoo.models.spec import SameKeys


class _TimmViT(SameKeys):
    format = "timm"

    @staticmethod
    def matches(state: dict) -> bool:
        return "patch_embed.proj.weight" in state and "blocks.0.attn.qkv.weight" in state

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        """Config fields the checkpoint decides.

        A live timm ``VisionTransformer`` states its whole architecture, as a config.json
        does: every field is read from it (see :func:`read_live_timm`), and timm options
        fastzoo's ViT does not implement are refused with :class:`CheckpointError`.

        From a bare state dict only what the keys fix is read: the head (``num_classes``),
        ``patch_size`` and ``in_chans`` (from the patch projection), the prefix tokens (``class_token``, ``reg_tokens``), whether the position embedding
        covers them (``no_embed_class``), the image size (from the position embedding), and
        where the final LayerNorm sits: an ``fc_norm`` key means after pooling, read as avg
        pooling (timm's default for it); neither a class token nor ``fc_norm`` means avg
        pooling with the norm before it (``fc_norm=False``). The keys cannot tell, so the
        model's YAML or the caller gives: ``embed_dim``, ``depth``, ``num_heads``,
        ``mlp_ratio``, ``qkv_bias``, ``pre_norm``, ``init_values``, the LayerNorm
        ``norm_eps``, the MLP ``act_layer``, and for a class-token model, avg pooling with
        the norm before pooling (``global_pool="avg", fc_norm=False``) or token pooling with
        the norm after it (``global_pool="token", fc_norm=True``).
        """
        out = _from_keys(state)
        if module is not None and type(module).__module__.startswith("timm."):
            out.update(read_live_timm(module))
        return out


def _from_keys(state: dict) -> dict:
    out = {"num_classes": state["head.weight"].shape[0] if "head.weight" in state else 0}
    out["class_token"] = "cls_token" in state
    out["reg_tokens"] = state["reg_token"].shape[1] if "reg_token" in state else 0
    if "fc_norm.weight" in state or not out["class_token"]:
        out["global_pool"] = "avg"
        out["fc_norm"] = None if "fc_norm.weight" in state else False  # None: timm's rule, fc_norm with avg
    else:
        out["global_pool"] = "token"
    _, out["in_chans"], patch_h, patch = state["patch_embed.proj.weight"].shape
    if patch_h == patch:
        out["patch_size"] = patch
    if "pos_embed" in state:
        n = state["pos_embed"].shape[1]
        prefix = int(out["class_token"]) + out["reg_tokens"]
        for cand in (c for c in (n - prefix, n) if c > 0):  # with / without prefix tokens in the embedding
            side = math.isqrt(cand)
            if side * side == cand:
                out["img_size"] = side * patch
                out["no_embed_class"] = cand == n and prefix > 0
                break
    return out


def _is(module, *names: str) -> bool:
    return type(module).__name__ in names


def _is_layer_norm(module) -> bool:
    """timm's LayerNorm or torch's, with weight and bias: what fastzoo's ViT builds."""
    return _is(module, "LayerNorm") and isinstance(module, nn.LayerNorm) and module.weight is not None and (
        module.bias is not None)


def _activation(act) -> str | None:
    if _is(act, "GELU") and getattr(act, "approximate", "none") == "none":  # torch's nn.GELU or timm's GELU
        return "gelu"
    if _is(act, "QuickGELU"):  # timm's act_layer='quick_gelu'
        return "quick_gelu"
    return None


def _mlp_ratio(dim: int, hidden: int) -> float:
    """A ratio with int(dim * ratio) == hidden, as timm's Block computes the hidden width."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else math.nextafter(ratio, math.inf)


def refusals(m) -> list[str]:
    """timm options this live VisionTransformer uses that fastzoo's ViT does not reproduce."""
    from timm.models.vision_transformer import VisionTransformer

    if type(m) is not VisionTransformer:
        return [f"model class {type(m).__name__} (fastzoo reproduces timm's VisionTransformer itself)"]
    out = []
    if m.global_pool not in ("token", "avg", ""):
        out.append(f"global_pool={m.global_pool!r} (fastzoo pools with 'token' or 'avg', or not at all)")
    if m.pool_include_prefix:
        out.append("pool_include_prefix=True")
    if m.dynamic_img_size or getattr(m.patch_embed, "dynamic_img_pad", False):
        out.append("dynamic_img_size / dynamic_img_pad")
    if m.pos_embed is None:
        out.append("pos_embed='none'")
    if not isinstance(m.patch_drop, nn.Identity):
        out.append("patch_drop_rate > 0 (PatchDropout)")
    pe = m.patch_embed
    if not _is(pe, "PatchEmbed") or not isinstance(pe.norm, nn.Identity) or pe.patch_size[0] != pe.patch_size[1]:
        out.append("a patch embedding other than PatchEmbed with square patches and no norm (embed_layer / embed_norm_layer)")
    if isinstance(m.norm, nn.Identity) and isinstance(m.fc_norm, nn.Identity):
        out.append("final_norm=False")
    norms = [("norm_pre", m.norm_pre), ("norm", m.norm), ("fc_norm", m.fc_norm)]
    for i, b in enumerate(m.blocks):
        if not _is(b, "Block"):
            out.append(f"block_fn={type(b).__name__} (blocks.{i})")
            continue
        norms += [(f"blocks.{i}.norm1", b.norm1), (f"blocks.{i}.norm2", b.norm2)]
        a, mlp = b.attn, b.mlp
        if not _is(a, "Attention") or getattr(a, "gate", None) is not None:
            out.append(f"attn_layer={type(a).__name__}{' (gated)' if getattr(a, 'gate', None) is not None else ''} (blocks.{i})")
        else:
            if not (isinstance(a.q_norm, nn.Identity) and isinstance(a.k_norm, nn.Identity)):
                out.append(f"qk_norm=True (blocks.{i}.attn)")
            if not isinstance(a.norm, nn.Identity):
                out.append(f"scale_attn_norm=True (blocks.{i}.attn)")
            if a.num_heads * a.head_dim != m.embed_dim:
                out.append(f"attention width {a.num_heads * a.head_dim} != embed_dim {m.embed_dim} (blocks.{i}.attn)")
            if a.proj.bias is None:
                out.append(f"proj_bias=False (blocks.{i}.attn.proj)")
        if not _is(mlp, "Mlp"):
            out.append(f"mlp_layer={type(mlp).__name__} (blocks.{i})")
        else:
            if not isinstance(mlp.norm, nn.Identity):
                out.append(f"scale_mlp_norm=True (blocks.{i}.mlp)")
            if mlp.fc1.bias is None or mlp.fc2.bias is None:
                out.append(f"proj_bias=False (blocks.{i}.mlp)")
            if _activation(mlp.act) is None:
                out.append(f"act_layer={type(mlp.act).__name__} (blocks.{i}.mlp.act; fastzoo has GELU and QuickGELU)")
        for name in ("ls1", "ls2"):
            ls = getattr(b, name)
            if not (isinstance(ls, nn.Identity) or _is(ls, "LayerScale")):
                out.append(f"{type(ls).__name__} as blocks.{i}.{name}")
    present = [(n, x) for n, x in norms if not isinstance(x, nn.Identity)]
    bad = [f"{n}: {type(x).__name__}" for n, x in present if not _is_layer_norm(x)]
    if bad:
        out.append(f"norm_layer other than LayerNorm with weight and bias ({', '.join(bad[:3])})")
    elif len({x.eps for _, x in present}) > 1:
        out.append(f"LayerNorms with different eps ({sorted({x.eps for _, x in present})})")
    return out


def read_live_timm(m) -> dict:
    """Every config field, read from a live timm VisionTransformer (refusing what fastzoo lacks)."""
    refused = refusals(m)
    if refused:
        raise CheckpointError(
            f"live timm {type(m).__name__}: uses what fastzoo's ViT does not implement, so it cannot compute the "
            f"same function: {'; '.join(refused)}"
        )
    b0, last = m.blocks[0], m.blocks[-1]
    use_fc_norm = not isinstance(m.fc_norm, nn.Identity)
    return {
        "img_size": tuple(m.patch_embed.img_size),
        "patch_size": m.patch_embed.patch_size[0],
        "in_chans": m.patch_embed.proj.in_channels,
        "num_classes": m.head.out_features if isinstance(m.head, nn.Linear) else 0,
        "global_pool": m.global_pool,
        "fc_norm": None if use_fc_norm == (m.global_pool == "avg") else use_fc_norm,
        "embed_dim": m.embed_dim,
        "depth": len(m.blocks),
        "num_heads": b0.attn.num_heads,
        "mlp_ratio": _mlp_ratio(m.embed_dim, b0.mlp.fc1.out_features),
        "qkv_bias": b0.attn.qkv.bias is not None,
        "class_token": m.cls_token is not None,
        "reg_tokens": m.num_reg_tokens,
        "no_embed_class": bool(m.no_embed_class),
        "pre_norm": not isinstance(m.norm_pre, nn.Identity),
        # LayerScale's init value only initialises gamma, which the weights overwrite
        "init_values": float(b0.ls1.init_values) if _is(b0.ls1, "LayerScale") else None,
        "norm_eps": b0.norm1.eps,
        "act_layer": _activation(b0.mlp.act),
        "drop_rate": m.head_drop.p,
        "pos_drop_rate": m.pos_drop.p,
        "attn_drop_rate": b0.attn.attn_drop.p,
        "proj_drop_rate": b0.attn.proj_drop.p,
        "drop_path_rate": getattr(last.drop_path1, "drop_prob", 0.0),  # timm's rates rise linearly to the last block
    }


VIT = _TimmViT()

