"""The minimal cases the property-based tests (``tests/test_fuzz_*.py``) found, each kept as an
explicit example of the bug it showed, now fixed."""
from __future__ import annotations


import pytest
import torch
from conftest import SPECS, TINY, backends

import fastzoo
from fastzoo.errors import BackendUnavailableError, ConfigError


# at collection, before tests register kernels of their own (a dropout spy, a bf16-only kernel): the ones fastzoo ships
SHIPPED_FP32 = backends(dtype=torch.float32)


def _left_padded(vocab: int):
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return ids, mask


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_padding_position_predicts_nothing_on_every_backend(family):
    """Found: left padding with labels, the padded form (eager) scored the first real token from the
    last pad's output and the unpadded form (varlen) did not: two backends, two losses. Now a pad
    predicts nothing in every form; the original agrees once that label is -100."""
    spec = SPECS[family]
    torch.manual_seed(0)
    ref = spec.original.build(dict(spec.tiny)).eval()
    ids, mask = _left_padded(spec.tiny["vocab_size"])
    labels = ids.masked_fill(mask == 0, -100)
    losses = {}
    for attn in ("eager", "varlen"):
        model = fastzoo.create(spec.variants[0].name, pretrained=ref, attn=attn).eval()
        with torch.no_grad():
            losses[attn] = model(ids, attention_mask=mask, labels=labels).loss
    assert abs(losses["eager"] - losses["varlen"]) <= 1e-5  # fp32, the same terms summed in another order
    first = labels.clone()
    first[0, 3] = -100  # the first real token of the left-padded row
    with torch.no_grad():
        want = ref(ids, attention_mask=mask, labels=first).loss
    assert abs(losses["eager"] - want) <= 1e-4  # fastzoo.equivalence's fp32 rule


@pytest.mark.parametrize("train", [False, True])
def test_labels_outside_the_vocabulary_are_refused_naming_labels(train):
    """Found: eval mode raised torch's IndexError from cross_entropy, train mode a ValueError about ``target_N``."""
    cfg = TINY["gpt2"]
    model = fastzoo.create("gpt2", attn="eager", **cfg).train(train)
    ids = torch.randint(0, cfg["vocab_size"], (1, 4))
    with pytest.raises(ValueError, match="labels must be token ids"):
        model(ids, labels=ids + cfg["vocab_size"])


@pytest.mark.parametrize("name", ["vit_s16", "resnet50"])
def test_images_that_are_not_a_tensor_are_refused_naming_images(name):
    """Found: a nested list gave AttributeError: 'list' object has no attribute 'ndim'."""
    model = fastzoo.create(name, **SPECS[fastzoo.registry.get_entry(name).spec.family].tiny)
    with pytest.raises(ValueError, match="images must be a torch.Tensor"):
        model(torch.randn(1, 3, 32, 32).tolist())


def test_llama_hidden_size_must_be_a_multiple_of_the_heads_even_with_head_dim():
    """Found: hidden_size=1, num_attention_heads=4, head_dim=2 was accepted, then save_pretrained and
    conversion crashed in transformers' config validation (StrictDataclassClassValidationError)."""
    with pytest.raises(ConfigError, match="hidden_size=1 is not divisible by num_attention_heads=4") as e:
        fastzoo.create("llama", **{**TINY["llama"], "hidden_size": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
                                   "head_dim": 2})
    assert set(e.value.fields) == {"hidden_size", "num_attention_heads"}


def test_torchvision_original_of_a_headless_resnet_is_refused():
    """Found: num_classes=0 built torchvision's ResNet with a 0-output Linear (empty logits), which
    fastzoo (as timm) reads as no head at all: not the same function, so no original to compare."""
    with pytest.raises(ValueError, match="num_classes=0"):
        SPECS["resnet"].original.build({**TINY["resnet"], "num_classes": 0})


def test_a_non_finite_pixel_stays_in_its_image_on_every_backend():
    """Looked for after the non-finite-image property failed: a NaN or inf pixel spoils its own image's
    logits and no other's, on every CPU backend (the nested and varlen ones pack the images into one row)."""
    cfg = {**TINY["vit"], "reg_tokens": 2}
    clean_x = torch.randn(3, 3, cfg["img_size"], cfg["img_size"], generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = fastzoo.create("vit_s16", attn="eager", **cfg).eval()
    for name, options in backends(dtype=torch.float32):
        try:
            model.set_attention(name, **options)
        except BackendUnavailableError:  # refused at the switch, by name (a test's registered kernel, say): not run
            continue
        for value in (float("nan"), float("inf"), -float("inf")):
            x = clean_x.clone()
            x[1, 2, 5, 7] = value
            with torch.no_grad():
                clean, out = model(clean_x), model(x)
            assert not torch.isfinite(out[1]).any(), (name, options, value)
            # the same rows through the same kernels: equal but for a reordered sum (the property's 1e-5)
            assert torch.allclose(out[[0, 2]], clean[[0, 2]], atol=1e-5, rtol=0), (name, options, value)


def test_a_non_finite_pixel_stays_in_its_detr_image_on_every_backend_that_reads_each_image_alone():
    """Found: with varlen's flex impl a NaN pixel in one image changed another's class logits: flex
    attends over the whole packed batch under a document mask, and a masked key's NaN value arrives
    as 0 x NaN. Declared in fastzoo/attention/varlen.py; every other backend, packed or padded,
    keeps a non-finite pixel in its own image (padding pixels included)."""
    model = fastzoo.create("detr", **TINY["detr"]).eval()
    clean_x = torch.randn(2, 3, 40, 40, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 40, 40, dtype=torch.long)
    mask[1, :, 30:] = 0
    isolated = {}
    for name, options in SHIPPED_FP32:
        try:
            model.set_attention(name, **options)
        except BackendUnavailableError:  # refused at the switch, by name (a test's registered kernel, say): not run
            continue
        for image, where in ((0, (0, 5, 5)), (1, (1, 10, 35))):  # a real pixel; a padding pixel
            x = clean_x.clone()
            x[(image, *where)] = float("nan")
            with torch.no_grad():
                clean = model(pixel_values=clean_x, pixel_mask=mask)
                out = model(pixel_values=x, pixel_mask=mask)
            other = 1 - image
            isolated[(name, options.get("impl"), image)] = (
                torch.allclose(out.logits[other], clean.logits[other], atol=1e-5, rtol=0)
                and torch.allclose(out.pred_boxes[other], clean.pred_boxes[other], atol=1e-5, rtol=0))
    assert isolated[("varlen", "cpu", 0)] and isolated[("nested", None, 0)] and isolated[("sdpa", None, 0)]
    leaks = sorted({k[:2] for k, ok in isolated.items() if not ok})
    assert leaks in ([], [("varlen", "flex")]), leaks


def test_a_pad_that_is_nan_in_the_original_leaves_fastzoos_packed_sequences_their_own_function():
    """Found: with pad_token_id=0 the pad's embedding row is zero, and an rms_norm_eps that is 0 in
    fp32 makes the pad's normed state 0/0 = NaN; transformers' padded batch then carries NaN to the
    real tokens (a masked key's NaN value as 0 x NaN), where each sequence run alone is finite. A
    backend that never reads padding (varlen, nested) computes each sequence's own function: the
    property compares it with the original on each sequence alone (tests/test_fuzz_equivalence.py)."""
    from fastzoo.data import pack

    spec = SPECS["llama"]
    cfg = {**TINY["llama"], "rms_norm_eps": 1e-320, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
    torch.manual_seed(0)
    hf = spec.original.build(cfg).eval()
    ours = fastzoo.create("llama", pretrained=hf, attn="varlen").eval()
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])]
    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.zeros(2, 4, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    with torch.no_grad():
        padded = hf(ids, attention_mask=mask).logits
        alone = torch.cat([hf(s[None]).logits[0] for s in seqs])
        packed = pack(seqs)
        mine = ours(packed.input_ids, position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens,
                    max_seqlen=packed.max_seqlen).logits[0]
        mine_padded = ours(ids, attention_mask=mask).logits
    assert not torch.isfinite(padded[mask.bool()]).all()  # transformers' real tokens: NaN through the padding
    assert torch.isfinite(alone).all()
    torch.testing.assert_close(mine, alone, atol=1e-4, rtol=0)
    torch.testing.assert_close(mine_padded[mask.bool()], alone, atol=1e-4, rtol=0)  # unpadded inside: the same


@pytest.mark.parametrize("multiplier", [5e-324, 1e-46])
def test_an_attention_scale_that_is_zero_in_fp32_attends_uniformly_on_every_backend(multiplier):
    """Found: Granite with attention_multiplier=5e-324 (0 in fp32) gave NaN logits on sdpa, nested and
    varlen: torch's CPU flash kernel masks causally with -inf x scale, NaN at scale 0. transformers'
    eager scores are all 0 (uniform attention over the past); every fastzoo backend gives that."""
    spec = SPECS["llama"]
    cfg = {**TINY["llama"], "model_type": "granite", "attention_multiplier": multiplier, "embedding_multiplier": 12.0,
           "residual_multiplier": 0.25, "logits_scaling": 1.0}
    torch.manual_seed(0)
    hf = spec.original.build(cfg).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
    assert torch.isfinite(want).all()
    ours = fastzoo.create("llama", pretrained=hf, attn="eager").eval()
    for name, options in SHIPPED_FP32:
        try:
            ours.set_attention(name, **options)
        except BackendUnavailableError:  # refused at the switch, by name (a test's registered kernel, say): not run
            continue
        with torch.no_grad():
            got = ours(ids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"{name} {options}")


def test_a_config_whose_logits_are_nan_for_every_image_is_timms_too():
    """Found as 'a non-finite pixel changed another image's logits': with embed_dim=1 every LayerNorm
    computes (x - mean) / sqrt(var + eps) = 0 / sqrt(eps), and norm_eps=5e-324 (a float64) is 0 in the
    float32 the norm computes in, so every logit of every image is 0/0 = NaN, the clean batch's included:
    no image spoiled another. timm computes the same NaNs; the property compares NaN with NaN as equal."""
    cfg = {**TINY["vit"], "embed_dim": 1, "num_heads": 1, "depth": 1, "norm_eps": 5e-324}
    torch.manual_seed(0)
    ref = SPECS["vit"].original.build(dict(cfg)).eval()
    ours = fastzoo.create("vit_s16", pretrained=ref, **cfg).eval()
    x = torch.randn(2, 3, cfg["img_size"], cfg["img_size"])
    with torch.no_grad():
        assert ours(x).isnan().all() and ref(x).isnan().all()
    ok = {**cfg, "norm_eps": 1e-6}
    with torch.no_grad():
        assert torch.isfinite(fastzoo.create("vit_s16", **ok).eval()(x)).all()


def test_token_avg_pooling_with_a_norm_after_pooling_is_refused():
    """Found by the threads and non-finite-image properties (the forward raised in every thread):
    global_pool='token_avg' with fc_norm=True built a LayerNorm(embed_dim) after pooling and fed it the
    2 * embed_dim pooled features (RuntimeError in forward). DINOv2's classifier, the one original of
    'token_avg', norms every token before pooling; timm has no 'token_avg'."""
    with pytest.raises(ConfigError, match="global_pool='token_avg'.*fc_norm") as e:
        fastzoo.create("vit_s16", **{**TINY["vit"], "global_pool": "token_avg", "fc_norm": True})
    assert set(e.value.fields) == {"global_pool", "fc_norm"}
    model = fastzoo.create("vit_s16", **{**TINY["vit"], "global_pool": "token_avg", "fc_norm": None}).eval()
    assert model(torch.randn(1, 3, TINY["vit"]["img_size"], TINY["vit"]["img_size"])).shape == (1, TINY["vit"]["num_classes"])


def test_gemma_without_a_sliding_window_is_refused_as_transformers_refuses_it():
    """Found: gemma2 with sliding_window=None was accepted and ran its sliding layers as full attention.
    transformers' Gemma 2 and 3 build the sliding-window mask on every forward and raise ('Could not find
    a `sliding_window`') without a window, even when no layer slides: no original to equal. Refused
    when the config is made, naming the field."""
    from test_llama import hf_model

    hf = hf_model("gemma2")
    cfg = fastzoo.create("gemma2", pretrained=hf).config.to_dict()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    hf.config.sliding_window = None
    for kinds in (("sliding_attention", "full_attention"), ("full_attention", "full_attention")):
        with pytest.raises(ConfigError, match="sliding_window=None") as e:
            fastzoo.create("gemma2", **{**cfg, "sliding_window": None, "layer_types": kinds})
        assert "sliding_window" in e.value.fields
        hf.config.layer_types = list(kinds)
        with pytest.raises(ValueError, match="sliding_window"):
            hf(ids, use_cache=False)


def test_a_sliding_layer_without_a_window_is_refused_where_full_layers_run():
    """The same rule for the other layouts with layer_types (Qwen2, Qwen3, SmolLM3): transformers builds
    the sliding mask only when a layer slides, so a sliding layer without a window is refused and a
    windowless model of full layers runs, equal to transformers'."""
    from test_llama import hf_model

    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    cfg = fastzoo.create("qwen2", pretrained=hf).config.to_dict()
    assert cfg["layer_types"] == ("full_attention", "sliding_attention")
    with pytest.raises(ConfigError, match="sliding_window=None with sliding_attention layers") as e:
        fastzoo.create("qwen2", **{**cfg, "sliding_window": None})
    assert set(e.value.fields) == {"sliding_window", "layer_types"}
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    hf.config.sliding_window = None
    with pytest.raises(ValueError, match="sliding_window"):
        hf(ids, use_cache=False)
    full = hf_model("qwen2", use_sliding_window=False)  # the same weights (seed), no window, every layer full
    assert full.config.sliding_window is None and set(full.config.layer_types) == {"full_attention"}
    ours = fastzoo.create("qwen2", attn="eager", pretrained=full).eval()
    with torch.no_grad():
        assert (ours(ids).logits - full(ids, use_cache=False).logits).abs().max() <= 1e-4  # the fp32 rule


_KINDS = ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("layout", ["qwen2", "qwen3", "smollm3"])
def test_sliding_layers_read_from_transformers_without_a_window_are_refused_as_transformers_refuses_them(layout):
    """Found: a transformers config whose layer_types has a sliding layer but no window (sliding_window=None;
    for qwen2 / qwen3 also use_sliding_window=False, which drops the window) was read as full attention on
    every layer; transformers' own forward raises on it. Now the layer kinds are read as they are and the
    config refuses them, naming sliding_window (the rule the other layouts with layer_types follow)."""
    from test_llama import hf_model

    from fastzoo.errors import CheckpointError

    settings = [dict(use_sliding_window=True, sliding_window=None, layer_types=_KINDS)]
    if layout != "smollm3":  # smollm3 keeps the window without use_sliding_window (next test)
        settings.append(dict(use_sliding_window=False, sliding_window=4, layer_types=_KINDS))
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(0))
    for kw in settings:
        hf = hf_model(layout, **kw)
        assert hf.config.sliding_window is None and "sliding_attention" in hf.config.layer_types
        with pytest.raises((TypeError, ValueError)):  # transformers' refusal, at its forward
            hf(ids, use_cache=False)
        with pytest.raises(CheckpointError, match="sliding_window=None with sliding_attention layers"):
            fastzoo.create(layout, pretrained=hf)


@pytest.mark.parametrize("layout, kw", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=None)),  # transformers: every layer full
    ("qwen3", dict(use_sliding_window=True, sliding_window=None)),
    ("smollm3", dict(use_sliding_window=True, sliding_window=None)),
    ("smollm3", dict(use_sliding_window=False, sliding_window=4, layer_types=_KINDS)),  # its masks slide layer 1
])
def test_sliding_settings_read_from_transformers_attend_as_transformers(layout, kw):
    """The windowless settings transformers runs: fastzoo reads the attention transformers' eager and sdpa
    masks give (every layer full; SmolLM3's sliding layer with its window whatever use_sliding_window
    says) and equals it on sequences longer than the window."""
    from test_llama import hf_model

    hf = hf_model(layout, **kw)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    ours = fastzoo.create(layout, pretrained=hf, attn="eager").eval()
    assert [ours.config.window_of(i) for i in range(2)] == [
        hf.config.sliding_window if k == "sliding_attention" else None for k in hf.config.layer_types]
    for attn in ("eager", "sdpa"):
        hf.config._attn_implementation = attn
        with torch.no_grad():
            assert (ours(ids).logits - hf(ids, use_cache=False).logits).abs().max() <= 1e-4  # the fp32 rule


@pytest.mark.parametrize("family", ["detr", "vit", "gpt2"])
def test_non_reentrant_checkpointing_on_the_nested_backend_is_refused_by_name_both_ways(family):
    """Found: DETR with gradient checkpointing on the nested backend raised torch's RuntimeError in the
    backward (non-reentrant torch.utils.checkpoint reads the shape of the strided NestedTensors of CPU's
    jagged SDPA; without that check its recompute makes jagged tensors of another ragged size); ViT the
    same. Now refused where it is asked for, naming both, and nothing changes; the reentrant kind is served
    (its gradients: tests/test_detr_checkpointing.py)."""
    name, match = SPECS[family].variants[0].name, "'nested' cannot run inside non-reentrant gradient checkpointing"
    model = fastzoo.create(name, attn="nested", **TINY[family])
    with pytest.raises(BackendUnavailableError, match=match):
        model.gradient_checkpointing_enable()
    assert not model.attention_checkpointed() and model.attn_name == "nested"
    model.set_attention("sdpa").gradient_checkpointing_enable()
    with pytest.raises(BackendUnavailableError, match=match):
        model.set_attention("nested")
    assert model.attention_checkpointed() and model.attn_name == "sdpa"
    if family != "vit":  # timm's switch is non-reentrant whatever it is asked
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        assert model.set_attention("nested").attn_name == "nested" and not model.attention_checkpointed()
        with pytest.raises(BackendUnavailableError, match=match):
            fastzoo.create(name, attn="nested", **TINY[family], gradient_checkpointing=True)  # the config field


@pytest.mark.parametrize("where, value, match", [
    ("class_labels", -1, r"labels\[0\]\['class_labels'\]\[0\] = -1"),  # was torch's RuntimeError from the cost's gather
    ("boxes", -1.0, r"labels\[0\]\['boxes'\]\[0\]"),  # a centre left of the image: was accepted
    ("boxes", 1.5, r"labels\[0\]\['boxes'\]\[0\]"),  # past the image: was accepted
])
def test_detr_labels_out_of_range_are_refused_naming_the_box(where, value, match):
    """Found: a negative class id raised a bare RuntimeError; box coordinates outside [0, 1] were accepted."""
    model = fastzoo.create("detr", **TINY["detr"]).train()
    labels = [{"class_labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])}]
    labels[0][where].view(-1)[0] = value
    with pytest.raises(ValueError, match=match):
        model(pixel_values=torch.randn(1, 3, 64, 64), labels=labels)


@pytest.mark.parametrize("fields, named", [
    (dict(d_model=10, encoder_attention_heads=1, decoder_attention_heads=1), "d_model"),  # the sine embedding's pairs
    (dict(layer_type="bottleneck", hidden_sizes=(1, 1, 1, 1)), "hidden_sizes"),  # a 0-channel bottleneck
])
def test_detr_configs_that_crash_in_forward_are_refused_naming_the_field(fields, named):
    """Found: accepted, then a bare RuntimeError in the first forward (transformers' model crashes on them too)."""
    with pytest.raises(ConfigError) as e:
        fastzoo.create("detr", device="meta", **{**TINY["detr"], **fields})
    assert named in e.value.fields


_DINOV2 = {"architectures": ["Dinov2Model"], "model_type": "dinov2"}
_DINOV2_CLS = {"architectures": ["Dinov2ForImageClassification"], "model_type": "dinov2"}
_CLIP = {"architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model"}
_SIGLIP = {"architectures": ["SiglipVisionModel"], "model_type": "siglip_vision_model"}
_VIT = {"architectures": ["ViTForImageClassification"], "model_type": "vit"}
_VIT_MODEL = {"architectures": ["ViTModel"], "model_type": "vit"}
_RESNET = {"architectures": ["ResNetForImageClassification"], "model_type": "resnet"}
_CLIP_TOWER = dict(pre_norm=True, fc_norm=True, num_classes=0, hf_config=_CLIP)


@pytest.mark.parametrize("family, fields, named", [
    # every field transformers' config.json writes or leaves to the class, each made to differ
    ("vit", dict(init_values=None, num_classes=0, hf_config=_DINOV2), "init_values"),  # DINOv2 has LayerScale
    ("vit", dict(_CLIP_TOWER, fc_norm=None), "fc_norm"),  # CLIP norms the pooled class token only, no final norm
    ("vit", dict(_CLIP_TOWER, qkv_bias=False), "qkv_bias"),  # CLIP's q, k, v have biases
    ("vit", dict(_CLIP_TOWER, num_classes=10), "num_classes"),  # a tower has no classifier
    ("vit", dict(hf_config=_VIT_MODEL), "num_classes"),  # ViTModel has no classifier
    ("vit", dict(init_values=1.0, hf_config=_DINOV2_CLS), "global_pool"),  # DINOv2's classifier: class + mean patch token
    ("vit", dict(init_values=1.0, num_classes=0, global_pool="token_avg", hf_config=_DINOV2), "global_pool"),
    ("vit", dict(init_values=1.0, num_classes=0, mlp_layer="swiglu_packed", mlp_ratio=2 / 64, hf_config=_DINOV2),
     "mlp_ratio"),  # a SwiGLU width no DINOv2 mlp_ratio gives
    ("vit", dict(init_values=1.0, num_classes=0, mlp_ratio=2.5, hf_config=_DINOV2), "mlp_ratio"),  # DINOv2's is an int
    ("vit", dict(img_size=(32, 48), hf_config=_VIT), "img_size"),  # square images only
    ("vit", dict(reg_tokens=1, hf_config=_VIT), "reg_tokens"),
    ("vit", dict(no_embed_class=True, hf_config=_VIT), "no_embed_class"),
    ("vit", dict(dist_token=True, hf_config=_VIT), "dist_token"),  # DeiT's token on ViT's class
    ("vit", dict(pooler=True, hf_config=_VIT), "pooler"),  # the classifier's base model has no pooler
    ("vit", dict(mask_token=True, hf_config=_VIT), "mask_token"),  # ViT's use_mask_token is no config field
    ("vit", dict(pre_norm=True, hf_config=_VIT), "pre_norm"),
    ("vit", dict(global_pool="avg", hf_config=_VIT), "global_pool"),
    ("vit", dict(num_classes=0, global_pool="map", class_token=True, hf_config=_SIGLIP), "class_token"),
    ("resnet", dict(width_per_group=13, hf_config=_RESNET), "width_per_group"),
    ("resnet", dict(groups=2, width_per_group=32, hf_config=_RESNET), "groups"),
    ("resnet", dict(out_channels=(1, 1, 1, 1), hf_config=_RESNET), "out_channels"),  # 1 // 4 = 0-channel bottlenecks
    ("resnet", dict(hf_config={"architectures": ["ResNetModel"]}), "num_classes"),
    ("resnet", dict(num_classes=0, global_pool="", hf_config={"architectures": ["ResNetModel"]}), "global_pool"),
])
def test_an_hf_config_its_fields_cannot_be_is_refused_when_the_config_is_made(family, fields, named):
    """Found (the equivalence property drawing ``hf_config`` from the variants): a config whose
    ``hf_config`` names a transformers class that is another network (a DINOv2 without LayerScale, a
    CLIP tower with a final norm, a widened ResNet bottleneck) was accepted by ``create`` and failed
    in ``save_pretrained`` (a bare huggingface_hub error for DINOv2). Now refused when the config is
    made, naming ``hf_config`` and the field, by the rule ``save_pretrained`` writes with."""
    name = {"vit": "vit_s16", "resnet": "resnet50"}[family]
    with pytest.raises(ConfigError) as e:
        fastzoo.create(name, device="meta", **{**TINY[family], **fields})
    assert e.value.fields[0] == "hf_config" and named in e.value.fields, e.value.fields
    assert named in str(e.value)


@pytest.mark.parametrize("family, fields, kwargs", [
    ("vit", dict(init_values=1.0, num_classes=0, hf_config=_DINOV2), {}),
    ("vit", dict(_CLIP_TOWER), {}),
    ("vit", dict(num_classes=0, hf_config=_VIT_MODEL), {"add_pooling_layer": False}),  # a constructor argument
    ("vit", dict(num_classes=0, hf_config=_VIT), {}),  # transformers' classifier of 0 labels is the identity, as fastzoo's
    ("resnet", dict(hf_config=_RESNET), {}),
    ("resnet", dict(frozen_bn=True, hf_config=_RESNET), {}),  # a training choice: the same tensors, the same function
])
def test_an_hf_config_its_fields_can_be_is_written_as_that_class(family, fields, kwargs, tmp_path):
    """The accepted side of the rule: save_pretrained writes the class, transformers reads every key."""
    import transformers

    name = {"vit": "vit_s16", "resnet": "resnet50"}[family]
    model = fastzoo.create(name, **{**TINY[family], **fields}).eval()
    model.save_pretrained(tmp_path)
    arch = fields["hf_config"]["architectures"][0]
    back, info = getattr(transformers, arch).from_pretrained(tmp_path, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(pixel_values=x), back.eval()(pixel_values=x)
    compared = [k for k, v in theirs.items() if isinstance(v, torch.Tensor)]
    assert compared and [k for k, v in ours.items() if isinstance(v, torch.Tensor)] == compared
    assert max((ours[k] - theirs[k]).abs().max().item() for k in compared) <= 1e-4  # fp32 rule


@pytest.mark.parametrize("name, sizes", [
    ("google/vit-base-patch16-224", dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)),
    ("microsoft/resnet-50", dict(layers=(1, 1, 1, 1))),
])
def test_a_hub_classifier_with_other_labels_is_written_with_its_own(name, sizes, tmp_path):
    """Found (the checkpoint property drawing the hub variants' ``hf_config``): a hub classifier given
    num_classes=3 wrote its config.json with the hub's num_labels=1000 beside 3 labels, so transformers
    built a 1000-way head for the 3-row weights. Now written with the model's labels."""
    import transformers

    model = fastzoo.create(name, num_classes=3, **sizes).eval()
    model.save_pretrained(tmp_path)
    arch = model.config.hf_config["architectures"][0]
    back = getattr(transformers, arch).from_pretrained(tmp_path).eval()
    assert back.config.num_labels == 3
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(pixel_values=x).logits - model(pixel_values=x).logits).abs().max() <= 1e-4  # fp32 rule




def test_a_state_of_no_transformers_vit_layout_is_refused_by_the_vit_converter_naming_its_keys():
    """Found (the damaged-checkpoint property on RF-DETR, its draws moved by a new config field): a flipped byte in a
    fastzoo-format RF-DETR safetensors file read as transformers' format, whose backbone keys, fastzoo's ViT names,
    reached transformers' ViT converter: a bare ``KeyError: None``. Now a CheckpointError naming the keys."""
    from fastzoo.errors import CheckpointError
    from fastzoo.models.vit import hf

    with pytest.raises(CheckpointError, match=r"none of its keys names a layout fastzoo reads \(blocks\.0\.norm1\.weight"):
        hf.to_fastzoo({"blocks.0.norm1.weight": torch.ones(2), "cls_token": torch.zeros(1, 1, 2)})


@pytest.mark.parametrize("family, heads", [("gpt2", {"n_embd": 96, "n_head": 4}),
                                           ("llama", {"hidden_size": 96, "num_attention_heads": 4})])
def test_a_decoders_eager_attention_rounds_as_transformers_eager_attention_in_bf16(family, heads):
    """Found by the equivalence property (long profile): a GPT-2 with a one-unit MLP in bf16 whose
    ``ln_2.bias`` gradient on fastzoo's eager backend was 0.087 of its scale from fp32, past 3x transformers'
    own bf16 error (bound 0.079; transformers' eager run 0.008, its SDPA run 0.013). fastzoo's eager attention
    scaled q before the product q k^T (timm's order) where transformers' eager scales the product (every decoder
    of transformers 5.17: ``torch.matmul(query, key.transpose(...)) * scaling``); for a head width whose scale is
    no power of two (24 here) the two round otherwise in bf16, and a gradient through a one-unit bottleneck
    amplifies it. The decoders' attention now says so (``scale_scores``): under bf16 autocast fastzoo's eager
    computes transformers' eager logits to the last bit."""
    from fastzoo import equivalence

    spec = SPECS[family]
    torch.manual_seed(0)
    ref = spec.original.build({**spec.tiny, **heads}).eval()
    equivalence.draw_(ref, seed=0)
    ours = fastzoo.create(spec.variants[0].name, pretrained=ref, attn="eager").eval()
    ids = torch.randint(0, spec.tiny["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        theirs, mine = ref(ids).logits, ours(ids).logits
    assert torch.equal(theirs, mine), (theirs - mine).abs().max()


def test_the_one_unit_gpt2_mlp_found_in_bf16_is_within_the_rule_on_the_eager_backend():
    """The found case itself (config and weights as the property drew them), its gradients judged as the property
    judges them: against fp32 transformers, within 3x transformers' own bf16 runs (eager and SDPA). Before the
    fix the eager backend's ``mlp.c_fc.bias`` gradient was 1.4x that bound on these inputs; now 0.33x
    (transformers' eager run's own error)."""
    import copy

    from test_fuzz_equivalence import _in_fastzoo_names

    from fastzoo import equivalence

    spec = SPECS["gpt2"]
    cfg = {"vocab_size": 76, "n_positions": 18, "n_head": 2, "n_embd": 64, "n_layer": 1, "n_inner": 1,
           "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    torch.manual_seed(586)
    ref = spec.original.build(cfg).eval()
    equivalence.draw_(ref, seed=586)
    ours = fastzoo.create("gpt2", pretrained=ref, attn="eager").eval()
    peers = [copy.deepcopy(ref), spec.as_users_run_it(copy.deepcopy(ref))]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 76, (2, 9), generator=gen)
    proj = torch.randn(2, 9, 76, generator=gen)  # the property's gradients: of a fixed projection of the logits

    def grads(m, bf16):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = m(ids).logits
        (logits.float() * proj).sum().backward()
        return {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    want = _in_fastzoo_names(spec, ours, grads(ref, False))
    own = [_in_fastzoo_names(spec, ours, grads(p, True)) for p in peers]
    c = equivalence.compare_grads("grads", grads(ours, True), want, own)
    assert c.passed, (c.err, c.bound, c.worst)
