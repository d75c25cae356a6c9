"""timm's ViT names, derived from timm itself: which of its ``VisionTransformer`` architectures
fastzoo's ViT reproduces (with their config fields) and which it refuses (with the timm options
it would need).

The derivation walks timm's registry: every architecture whose timm module builds
``VisionTransformer`` is built on the meta device and read with the same live-module reading
that loads a live timm model (:func:`fastzoo.models.vit.convert.read_live_timm`); what that
refuses, or what fastzoo's config rejects, is refused here with the reason. Importing timm and
building a few hundred models takes seconds, too slow for ``import fastzoo``, so the result is
committed as ``timm_variants.json`` beside this file and ``tests/test_vit_timm_names.py``
derives it again from the installed timm and asserts equality. Regenerate it with

    python -m fastzoo.models.vit.timm_names
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from fastzoo.errors import CheckpointError, ConfigError
from fastzoo.models.vit.config import ViTConfig
from fastzoo.models.vit.convert import read_live_timm, refusals

DATA = Path(__file__).with_name("timm_variants.json")
_FREE = {f.name for f in dataclasses.fields(ViTConfig) if ViTConfig.field_kind(f.name) == "free"}


def candidates() -> list[str]:
    """timm's architectures from the timm modules that build its ``VisionTransformer``."""
    import timm
    from timm.models.vision_transformer import VisionTransformer

    modules = [m for m in timm.list_modules()
               if getattr(sys.modules.get(f"timm.models.{m}"), "VisionTransformer", None) is VisionTransformer]
    return timm.list_models(module=modules)


SIZES = ("img_size", "patch_size", "embed_dim", "depth", "num_heads")  # stated for every name


def _config_fields(live: dict) -> dict:
    """The sizes, and the fields that differ from ViTConfig's defaults (dropout rates are
    training choices, not the name's)."""
    defaults = ViTConfig().to_dict()
    out = {k: v for k, v in live.items() if k not in _FREE and (k in SIZES or v != defaults.get(k))}
    if "img_size" in out and out["img_size"][0] == out["img_size"][1]:
        out["img_size"] = out["img_size"][0]
    return out


def _once_per_block(reasons: list[str]) -> list[str]:
    """One reason per option (``blocks.N`` for every block that has it)."""
    return list(dict.fromkeys(re.sub(r"blocks\.\d+", "blocks.N", r) for r in reasons))


def build_meta(name: str) -> nn.Module:
    """timm's model ``name`` without storage (meta device) and without timm's init (not read here)."""
    import timm

    with torch.device("meta"):
        return timm.create_model(name, pretrained=False, weight_init="skip")


def derive(modules: Mapping[str, nn.Module] | None = None) -> dict:
    """``{"timm": version, "variants": {name: {config, tag}}, "refused": {name: [reasons]}}``
    from the installed timm; ``modules``: the candidates already built by :func:`build_meta`."""
    import timm

    modules = modules if modules is not None else {name: build_meta(name) for name in candidates()}
    variants, refused = {}, {}
    for name, module in modules.items():
        reasons = _once_per_block(refusals(module))
        if not reasons:
            config = _config_fields(read_live_timm(module))
            try:
                ViTConfig.from_dict(dict(config))
            except (ConfigError, CheckpointError) as e:
                reasons = [f"{e} (fastzoo's ViT config refuses it)"]
        if reasons:
            refused[name] = reasons
        else:
            variants[name] = {"config": config, "tag": module.pretrained_cfg.get("tag") or ""}
    return {"timm": timm.__version__, "variants": variants, "refused": refused}


# what timm's other ViT-like modules build that fastzoo's ViT (timm's VisionTransformer) lacks
OTHER_MODULES = {
    "timm.models.eva": "EVA's blocks: rotary position embeddings (the '_rope' names), SwiGLU MLPs, a norm inside "
                       "the MLP",
}


def why_not(name: str) -> str | None:
    """Why a timm vision-transformer name outside :func:`candidates` is not fastzoo's: the timm module
    that builds it and what that module has (None: not such a timm name)."""
    import timm

    if not isinstance(name, str) or not timm.is_model(name):
        return None
    module = timm.models.model_entrypoint(name).__module__
    if module not in OTHER_MODULES and not name.startswith(("vit", "deit", "beit", "eva")):
        return None
    what = OTHER_MODULES.get(module) or (sys.modules[module].__doc__ or module).strip().splitlines()[0]
    return (f"timm builds it in {module} ({what}), not with timm's VisionTransformer, which fastzoo's ViT reproduces "
            f"(`fastzoo list 'vit*'` lists those names)")


def load() -> dict:
    """The committed derivation (``timm_variants.json``)."""
    return json.loads(DATA.read_text())


def main() -> int:
    data = derive()
    DATA.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{DATA}: {len(data['variants'])} timm ViT names reproduced, {len(data['refused'])} refused (timm {data['timm']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
