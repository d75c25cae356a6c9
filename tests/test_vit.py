"""ViT equals timm's VisionTransformer on the same weights: logits and gradients.

Tolerances (fp32, CPU): logits max abs diff <= 1e-4 (DESIGN.md). Gradients are compared
per parameter relative to that gradient's largest magnitude (<= 1e-4): absolute sizes of
gradients vary by orders of magnitude between the head and the first block.
"""
import pytest
import timm
import torch

import fastzoo

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
LOGIT_TOL = 1e-4
GRAD_RTOL = 1e-4

# backend name, options: every backend that runs forward AND backward on this CPU
TRAIN_BACKENDS = [
    ("eager", {}),
    ("sdpa", {}),
    ("sdpa", {"sdpa_backend": "math"}),
    ("sdpa", {"sdpa_backend": "flash"}),  # PyTorch's C++ flash kernel on CPU
]
INFER_BACKENDS = TRAIN_BACKENDS + [("flex", {})]  # flex has no backward on CPU


def timm_vit(**kw):
    torch.manual_seed(0)
    return timm.create_model("vit_base_patch16_224", pretrained=False, **kw)


def assert_grads_match(ours, ref, rtol=GRAD_RTOL):
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in ours.named_parameters():
        g, g_ref = p.grad, ref_grads[name]
        scale = g_ref.abs().max().clamp_min(1e-12)
        err = ((g - g_ref).abs().max() / scale).item()
        assert err <= rtol, f"grad of {name}: relative error {err:.2e} > {rtol}"


def forward_backward(model, x):
    model.zero_grad()
    out = model(x)
    out.square().mean().backward()  # a loss that touches every logit
    return out.detach()


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
    out, out_ref = forward_backward(ours, x), forward_backward(ref, x)
    assert (out - out_ref).abs().max().item() <= LOGIT_TOL
    assert_grads_match(ours, ref)


@pytest.mark.slow
def test_vit_b16_full_size_equal_timm():
    """The real ViT-B/16 at batch 2: sdpa logits + gradients, eager and flex logits."""
    ref = timm_vit()
    ours = fastzoo.create("vit_b16", attn="sdpa", pretrained=ref)
    x = torch.randn(2, 3, 224, 224)
    out, out_ref = forward_backward(ours, x), forward_backward(ref, x)
    assert (out - out_ref).abs().max().item() <= LOGIT_TOL
    assert_grads_match(ours, ref, rtol=1e-3)  # 12 blocks of fp32 reassociation at width 768
    ref.eval(), ours.eval()
    with torch.no_grad():
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
}


@pytest.mark.parametrize("name", sorted(ODD_CONFIGS))
def test_odd_configs_equal_timm(name):
    cfg = ODD_CONFIGS[name]
    ref = timm_vit(**cfg)
    # only what the weights cannot tell is passed: the rest is read from the checkpoint
    arch = {k: v for k, v in cfg.items() if k in ("embed_dim", "depth", "num_heads", "patch_size", "mlp_ratio",
                                                  "qkv_bias", "pre_norm", "init_values")}
    ours = fastzoo.create("vit_b16", pretrained=ref, **arch)
    h, w = ours.patch_embed.img_size
    x = torch.randn(2, 3, h, w)
    out, out_ref = forward_backward(ours, x), forward_backward(ref, x)
    assert (out - out_ref).abs().max().item() <= LOGIT_TOL
    assert_grads_match(ours, ref)


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
