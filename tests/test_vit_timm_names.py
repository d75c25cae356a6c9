"""fastzoo's ViT under timm's names: the committed list is timm's own, every name computes
timm's function, and every full-size name has timm's parameter count.

- The list (``fastzoo/models/vit/timm_variants.json``) is derived again here from the
  installed timm's registry and must be equal: it cannot fall behind timm.
- Equivalence: each name built by timm (``timm.create_model(name, depth=1)``) and by fastzoo
  from the same name on timm's weights; same widths, one block, a 2x2-patch image (the
  position embedding's length is the parameter count's business). Names whose configs differ
  only in depth and image size compute the same one-block function, so one name of each such
  group is run (the first derivation test pins every name's config to timm's). Logits and gradients by
  fastzoo.equivalence's fp32 rule: logits within ``FP32_OUT_ATOL`` = 1e-4, gradients within
  ``FP32_GRAD_RTOL`` = 1e-4 of their scale. Parameters are re-drawn at O(1) scale first
  (``fastzoo.equivalence.draw_``: at timm's init a wrong activation moves the logits by only ~1e-4).
- Full size: built on the meta device (no storage), fastzoo's parameter count equals timm's.
"""
import pytest
import torch

import fastzoo
from fastzoo.equivalence import FP32_GRAD_RTOL, FP32_OUT_ATOL, compare
from fastzoo.errors import UnknownModelError
from fastzoo.models.vit import timm_names
from fastzoo.equivalence import draw_

timm = pytest.importorskip("timm")

COMMITTED = timm_names.load()
NAMES = sorted(COMMITTED["variants"])


@pytest.fixture(scope="module")
def timm_meta():
    """Every candidate timm architecture, built once on the meta device."""
    return {name: timm_names.build_meta(name) for name in timm_names.candidates()}


def test_committed_names_are_what_the_installed_timm_derives(timm_meta):
    derived = timm_names.derive(timm_meta)
    assert derived["timm"] == COMMITTED["timm"], "timm's version changed: python -m fastzoo.models.vit.timm_names"
    assert derived == COMMITTED, "regenerate with: python -m fastzoo.models.vit.timm_names"


def test_every_full_size_name_has_timms_parameter_count(timm_meta):
    wrong = {}
    for name in NAMES:
        ours = sum(p.numel() for p in fastzoo.create(name, device="meta").parameters())
        theirs = sum(p.numel() for p in timm_meta[name].parameters())
        if ours != theirs:
            wrong[name] = (ours, theirs)
    assert not wrong, f"parameter counts (fastzoo, timm) differ: {wrong}"


def _one_block_pair(name: str):
    """timm's and fastzoo's ``name`` at one block on a 2x2-patch image, on the same O(1)-scale
    weights. Neither library's own init runs (timm: weight_init='skip'; fastzoo: built on
    meta, then storage): every value is draw_'s, and the init of the widest names is
    most of their cost."""
    patch = COMMITTED["variants"][name]["config"].get("patch_size", 16)
    shrink = dict(depth=1, img_size=2 * patch)
    ref = draw_(timm.create_model(name, pretrained=False, weight_init="skip", **shrink), seed=1).eval()
    ours = fastzoo.create(name, device="meta", **shrink).to_empty(device="cpu")
    fastzoo.load_pretrained(ours, ref.state_dict())
    return ours.eval(), ref, (torch.randn(1, 3, 2 * patch, 2 * patch, generator=torch.Generator().manual_seed(0)),)


def _one_block_groups() -> dict[str, list[str]]:
    """Names by their config without depth and image size: each group is one function at one block."""
    groups = {}
    for name in NAMES:
        config = COMMITTED["variants"][name]["config"]
        key = repr(sorted((k, v) for k, v in config.items() if k not in ("depth", "img_size")))
        groups.setdefault(key, []).append(name)
    return groups


RUN = [names[0] for names in _one_block_groups().values()]


def test_the_one_block_groups_cover_every_name():
    covered = [n for names in _one_block_groups().values() for n in names]
    assert sorted(covered) == NAMES and len(RUN) < len(NAMES)


@pytest.mark.parametrize("group", range(4))
def test_every_name_equals_timm_at_one_block(group):
    """The names run, in four groups (one pytest item per group keeps the report short)."""
    failed = {}
    for name in RUN[group::4]:
        comparisons, _ = compare(*_one_block_pair(name))
        assert [c.bound for c in comparisons] == [FP32_OUT_ATOL, FP32_GRAD_RTOL]  # logits, then gradients
        failed.update({f"{name} {c.name}": c.err for c in comparisons if not c.passed})
    assert not failed, f"differs from timm (fp32 rule: logits {FP32_OUT_ATOL}, gradients {FP32_GRAD_RTOL}): {failed}"


def test_short_names_are_aliases_of_timms():
    for short, name in [("vit_s16", "vit_small_patch16_224"), ("vit_b16", "vit_base_patch16_224"),
                        ("vit_l16", "vit_large_patch16_224")]:
        model = fastzoo.create(short, device="meta")
        assert model.model_name == name and model.pretrained_cfg["architecture"] == name


def test_each_name_carries_timms_pretrained_cfg():
    for name in ("vit_small_patch14_reg4_dinov2", "deit3_base_patch16_384", "vit_base_patch32_clip_224"):
        expected = timm.models.resolve_pretrained_cfg(name).to_dict()
        assert fastzoo.create(name, device="meta").pretrained_cfg == expected
        assert expected["tag"] == COMMITTED["variants"][name]["tag"]


@pytest.mark.parametrize("name, option", [
    ("vit_base_patch16_siglip_224", "global_pool='map'"),
    ("vit_base_r50_s16_224", "embed_layer"),
    ("aimv2_large_patch14_224", "mlp_layer=SwiGLU"),
    ("deit_base_distilled_patch16_224", "VisionTransformerDistilled"),
])
def test_a_timm_name_fastzoo_does_not_reproduce_is_refused_naming_the_option(name, option):
    assert name in COMMITTED["refused"]
    with pytest.raises(UnknownModelError, match="not reproduced by fastzoo") as e:
        fastzoo.create(name)
    assert option in str(e.value)


def test_list_models_filters_timm_names_with_wildcards(capsys):
    from fastzoo.cli import main

    dinov2 = fastzoo.list_models("vit_*_dinov2")
    assert "vit_small_patch14_dinov2" in dinov2 and "vit_large_patch14_reg4_dinov2" in dinov2
    assert all(n.startswith("vit_") and n.endswith("_dinov2") for n in dinov2)
    assert main(["list", "vit_*_dinov2"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == dinov2
