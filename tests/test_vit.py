"""ViT equals timm's VisionTransformer on the same weights: logits and gradients.

The reference timm model's parameters are re-drawn at O(1) scale (``fastzoo.equivalence.draw_``)
before they are copied: at timm's init (std 0.02) the logits are ~0.1 and a wrong
activation (QuickGELU for GELU) moved them by only ~1e-4, under the tolerance. Here
logits are O(1-10) and such a deviation is O(1e-2).

Tolerances (fp32, CPU): logits max abs diff <= 1e-4 (fastzoo.equivalence's rule), i.e. a relative error
<= ~1e-5 at this scale, well above fp32 reassociation across two blocks. Gradients are
compared per parameter relative to that gradient's largest magnitude (<= 1e-4): absolute
sizes of gradients vary by orders of magnitude between the head and the first block.
"""
import re
from functools import partial

import pytest
import timm
import torch
from timm.layers import LayerNorm
from torch import nn

import conftest
import fastzoo
from fastzoo.equivalence import draw_
from conftest import backends
from fastzoo import equivalence
from fastzoo.errors import CheckpointError

TINY = conftest.TINY["vit"]
LOGIT_TOL = 1e-4
GRAD_RTOL = 1e-4

# backend name, options, from the registry: every backend (and variant) that runs forward AND
# backward on this CPU; inference adds those without a CPU backward (flex)
TRAIN_BACKENDS = backends(backward=True)
INFER_BACKENDS = backends()


def timm_vit(name="vit_base_patch16_224", **kw):
    torch.manual_seed(0)
    return draw_(timm.create_model(name, pretrained=False, **kw), seed=1)


def assert_equal_to_timm(ours, ref, x, grad_rtol=GRAD_RTOL):
    """Logits and every parameter gradient against timm's, by fastzoo.equivalence's rule."""
    logits, grads = equivalence.compare(ours, ref, (x,))[0]
    assert logits.err <= LOGIT_TOL, f"max |logit diff| {logits.err:.2e}"
    assert grads.err <= grad_rtol, f"grad of {grads.worst}: relative error {grads.err:.2e} > {grad_rtol}"


@pytest.mark.parametrize("attn,opts", INFER_BACKENDS, ids=lambda v: str(v) if v else "")
def test_tiny_logits_equal_timm(attn, opts):
    ref = timm_vit(**TINY).eval()
    ours = fastzoo.create("vit_b16", attn=attn, attn_options=opts, pretrained=ref, **TINY).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        err = (ours(x) - ref(x)).abs().max().item()
    assert err <= LOGIT_TOL, f"{attn} {opts}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("attn,opts", TRAIN_BACKENDS, ids=lambda v: str(v) if v else "")
def test_tiny_gradients_equal_timm(attn, opts):
    ref = timm_vit(**TINY)
    ours = fastzoo.create("vit_b16", attn=attn, attn_options=opts, pretrained=ref, **TINY)
    x = torch.randn(2, 3, 32, 32)
    assert_equal_to_timm(ours, ref, x)


@pytest.mark.slow
def test_vit_b16_full_size_equal_timm():
    """The real ViT-B/16 at batch 2: sdpa logits + gradients, eager and flex logits."""
    ref = timm_vit()
    ours = fastzoo.create("vit_b16", attn="sdpa", pretrained=ref)
    x = torch.randn(2, 3, 224, 224)
    assert_equal_to_timm(ours, ref, x, grad_rtol=1e-3)  # 12 blocks of fp32 reassociation at width 768
    ref.eval(), ours.eval()
    with torch.no_grad():
        out_ref = ref(x)
        for attn in ("eager", "flex"):
            ours.set_attention(attn)
            err = (ours(x) - out_ref).abs().max().item()
            assert err <= LOGIT_TOL, f"{attn}: {err:.2e}"


ODD_CONFIGS = {
    "non_square": dict(img_size=(32, 48), patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5),
    "img384_patch32": dict(img_size=384, patch_size=32, embed_dim=64, depth=1, num_heads=2, num_classes=3),
    "avg_no_cls": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, class_token=False,
                       global_pool="avg", num_classes=7),
    "avg_with_cls": dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, global_pool="avg", num_classes=7),
    "headless": dict(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4, num_classes=0),
    "registers_deit3": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, reg_tokens=4,
                            no_embed_class=True, init_values=1e-5, num_classes=10),
    "clip_prenorm": dict(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4, pre_norm=True,
                         qkv_bias=False, mlp_ratio=2.0, num_classes=10),
    "quick_gelu": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, act_layer="quick_gelu",
                       num_classes=10),
    "avg_without_fc_norm": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, global_pool="avg",
                                fc_norm=False, num_classes=10),
    "token_with_fc_norm": dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, fc_norm=True,
                               num_classes=10),
    "norm_eps_1e-5_odd_mlp": dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=2, mlp_ratio=2.6667,
                                  norm_layer=partial(LayerNorm, eps=1e-5), num_classes=10),
}


@pytest.mark.parametrize("name", sorted(ODD_CONFIGS))
def test_odd_configs_equal_timm(name):
    cfg = ODD_CONFIGS[name]
    ref = timm_vit(**cfg)
    ours = fastzoo.create("vit_b16", pretrained=ref)  # a live timm module states its whole architecture
    h, w = ours.patch_embed.img_size
    x = torch.randn(2, 3, h, w)
    assert_equal_to_timm(ours, ref, x)


def test_linear_patch_embed_equals_conv():
    conv = fastzoo.create("vit_b16", **TINY).eval()
    linear = fastzoo.create("vit_b16", patch_embed="linear", pretrained=conv.state_dict(), **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        a, b = conv.patch_embed(x), linear.patch_embed(x)
    # same weights, same function; only the float summation order of conv vs matmul differs
    assert (a - b).abs().max().item() <= 1e-5
    with torch.no_grad():
        assert (conv(x) - linear(x)).abs().max().item() <= LOGIT_TOL


def test_pos_embed_resampled_like_timm_when_img_size_changes():
    from timm.layers import resample_abs_pos_embed

    ref = timm_vit(**TINY)
    with pytest.warns(UserWarning, match="position embedding resampled"):
        ours = fastzoo.create("vit_b16", pretrained=ref, **{**TINY, "img_size": 48})
    expected = resample_abs_pos_embed(ref.pos_embed.detach(), new_size=(6, 6), num_prefix_tokens=1)
    assert torch.allclose(ours.pos_embed.detach(), expected, atol=1e-6)


def test_num_classes_override_gives_fresh_head_and_keeps_the_rest():
    ref = timm_vit(**TINY)
    with pytest.warns(UserWarning, match="fresh classifier head"):
        ours = fastzoo.create("vit_b16", pretrained=ref, **{**TINY, "num_classes": 3})
    assert ours.head.weight.shape == (3, 64)
    ref_sd = ref.state_dict()
    for k, v in ours.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(v, ref_sd[k]), k


def test_features_equal_timm():
    ref = timm_vit(**TINY).eval()
    ours = fastzoo.create("vit_b16", pretrained=ref, **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours.forward_features(x) - ref.forward_features(x)).abs().max().item() <= LOGIT_TOL
        pre, pre_ref = ours.forward_head(ours.forward_features(x), pre_logits=True), ref.forward_head(
            ref.forward_features(x), pre_logits=True)
        assert (pre - pre_ref).abs().max().item() <= LOGIT_TOL


def test_dropout_and_drop_path_train_like_timm():
    """With the same RNG stream, dropout masks match timm's: stochastic training is the same function too."""
    cfg = {**TINY, "drop_rate": 0.1, "proj_drop_rate": 0.1, "attn_drop_rate": 0.1, "drop_path_rate": 0.2}
    ref = timm_vit(**cfg).train()
    ours = fastzoo.create("vit_b16", attn="eager", pretrained=ref, **cfg).train()
    for blk in ref.blocks:  # timm's non-fused path applies attention dropout like our eager reference
        blk.attn.fused_attn = False
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    out_ref = ref(x)
    torch.manual_seed(1)
    out = ours(x)
    assert (out - out_ref).abs().max().item() <= LOGIT_TOL


# timm's named variants, shrunk: what each sets (no_embed_class + LayerScale, pre-norm +
# LayerNorm eps 1e-5 + QuickGELU, registers + avg pooling) must come from the live module alone.
NAMED_VARIANTS = ["deit3_small_patch16_224", "vit_base_patch16_clip_quickgelu_224", "vit_base_patch16_reg4_gap_256"]


@pytest.mark.parametrize("name", NAMED_VARIANTS)
def test_live_named_variants_need_no_overrides(name):
    ref = timm_vit(name, img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5)
    ours = fastzoo.create("vit_b16", pretrained=ref)
    x = torch.randn(2, 3, 32, 32)
    assert_equal_to_timm(ours, ref, x)


def test_quick_gelu_is_read_and_differs_from_gelu():
    """The live module's act_layer is read; the randomised scale makes GELU-for-QuickGELU visible."""
    ref = timm_vit(**TINY, act_layer="quick_gelu").eval()
    ours = fastzoo.create("vit_b16", pretrained=ref).eval()
    wrong = fastzoo.create("vit_b16", pretrained=ref.state_dict(), **TINY).eval()  # keys cannot tell: GELU
    assert ours.config.act_layer == "quick_gelu" and wrong.config.act_layer == "gelu"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out_ref = ref(x)
        assert (ours(x) - out_ref).abs().max().item() <= LOGIT_TOL
        assert (wrong(x) - out_ref).abs().max().item() > 100 * LOGIT_TOL  # the test can see the difference


@pytest.mark.parametrize("fc_norm", [True, False, None])
@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_fc_norm_placement_follows_timm(global_pool, fc_norm):
    ref = timm_vit(**TINY, global_pool=global_pool, fc_norm=fc_norm).eval()
    ours = fastzoo.create("vit_b16", pretrained=ref).eval()
    use_fc_norm = global_pool == "avg" if fc_norm is None else fc_norm  # timm's rule
    assert ours.config.use_fc_norm == use_fc_norm
    assert isinstance(ours.fc_norm, nn.LayerNorm) == use_fc_norm and isinstance(ours.norm, nn.LayerNorm) != use_fc_norm
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= LOGIT_TOL


def test_bare_state_dict_without_class_token_or_fc_norm_is_avg_with_the_norm_first():
    ref = timm_vit(**TINY, class_token=False, global_pool="avg", fc_norm=False).eval()
    ours = fastzoo.create("vit_b16", pretrained=ref.state_dict(), embed_dim=64, depth=2, num_heads=4).eval()
    assert (ours.config.global_pool, ours.config.fc_norm) == ("avg", False)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= LOGIT_TOL


REFUSED = {
    "qk_norm": dict(qk_norm=True),
    "global_pool='map'": dict(global_pool="map"),
    "global_pool='max'": dict(global_pool="max"),
    "global_pool='avgmax'": dict(global_pool="avgmax"),
    "dynamic_img_size": dict(dynamic_img_size=True),
    "act_layer=GELUTanh": dict(act_layer="gelu_tanh"),
    "norm_layer other than LayerNorm": dict(norm_layer="rmsnorm"),
    "final_norm=False": dict(final_norm=False),
    "proj_bias=False": dict(proj_bias=False),
    "pos_embed='none'": dict(pos_embed="none"),
    "patch_drop_rate": dict(patch_drop_rate=0.1),
    "scale_attn_norm": dict(scale_attn_norm=True),
    "pool_include_prefix": dict(pool_include_prefix=True),
}


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_timm_options_fastzoo_lacks_are_refused_by_name(what):
    torch.manual_seed(0)
    ref = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY, **REFUSED[what])
    with pytest.raises(CheckpointError, match="does not implement.*" + re.escape(what)):
        fastzoo.create("vit_b16", pretrained=ref)


def test_live_timm_model_without_pooling_loads_and_returns_every_token():
    ref = timm_vit(**{**TINY, "num_classes": 0, "global_pool": ""}).eval()
    ours = fastzoo.create("vit_b16", pretrained=ref).eval()
    assert ours.config.global_pool == ""
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= LOGIT_TOL  # [B, S, D]: no pooling, no head


def test_residual_post_norm_block_is_refused():
    from timm.models.vision_transformer import ResPostBlock

    torch.manual_seed(0)
    ref = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY, block_fn=ResPostBlock)
    with pytest.raises(CheckpointError, match="block_fn=ResPostBlock"):
        fastzoo.create("vit_b16", pretrained=ref)


@pytest.mark.parametrize("p", [0.3, 1.0])
def test_drop_path_matches_timm_even_at_p_1(p):
    from timm.layers import DropPath as TimmDropPath

    from fastzoo.layers import DropPath

    x = torch.randn(16, 5, 8, requires_grad=True)
    ours, ref = DropPath(p).train(), TimmDropPath(p).train()
    torch.manual_seed(3)
    out = ours(x)
    torch.manual_seed(3)
    out_ref = ref(x)
    assert torch.equal(out, out_ref)  # same RNG draws, same arithmetic: bit-identical
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    if p == 1.0:
        assert not out.any() and not x.grad.any()  # every sample's branch dropped


def test_drop_path_rate_out_of_range_is_named():
    from fastzoo.layers import DropPath

    with pytest.raises(ValueError, match="p=1.5"):
        DropPath(1.5)
    with pytest.raises(ValueError, match="drop_path_rate=-0.1"):
        fastzoo.create("vit_b16", **TINY, drop_path_rate=-0.1)


def test_reset_classifier_keeps_device_and_dtype():
    model = fastzoo.create("vit_b16", **TINY, dtype=torch.bfloat16)
    model.reset_classifier(3)
    assert model.head.weight.dtype == torch.bfloat16 and model.head.weight.device == model.pos_embed.device
    out = model(torch.randn(2, 3, 32, 32, dtype=torch.bfloat16))
    assert out.shape == (2, 3) and out.dtype == torch.bfloat16
    model.reset_classifier(0)
    assert model(torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)).shape == (2, 64)  # pooled features
    with pytest.raises(ValueError, match="num_classes=-2"):
        model.reset_classifier(-2)


def test_bad_images_are_named():
    model = fastzoo.create("vit_b16", **TINY)
    with pytest.raises(ValueError, match="images have 1 channels, the model was built for in_chans=3"):
        model(torch.randn(2, 1, 32, 32))
    with pytest.raises(ValueError, match="images are torch.uint8: convert them to a floating dtype"):
        model(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))


@pytest.mark.parametrize("field,value", [("num_classes", -1), ("depth", 0), ("embed_dim", 0), ("num_heads", -4),
                                         ("patch_size", 0), ("reg_tokens", -1), ("img_size", 0)])
def test_invalid_sizes_are_named(field, value):
    with pytest.raises(ValueError, match=rf"{field}=\(?{value}"):  # img_size is named as the (h, w) it became
        fastzoo.create("vit_b16", **{**TINY, field: value})


def test_embed_dim_not_divisible_by_num_heads_is_a_config_error():
    with pytest.raises(ValueError, match="embed_dim=64 is not divisible by num_heads=5"):
        fastzoo.create("vit_b16", **{**TINY, "num_heads": 5})


def test_act_layer_and_fc_norm_values_are_checked():
    with pytest.raises(ValueError, match="act_layer='relu'"):
        fastzoo.create("vit_b16", **TINY, act_layer="relu")
    with pytest.raises(ValueError, match="fc_norm='yes'"):
        fastzoo.create("vit_b16", **TINY, fc_norm="yes")
