"""The minimal cases the property-based tests (``tests/test_fuzz_*.py``) found, each kept as an
explicit example of the bug it showed, now fixed."""
from __future__ import annotations

import sys

import pytest
import torch
from conftest import SPECS, TINY, backends, sdpa_flags

import fastzoo
from fastzoo.errors import BackendUnavailableError, ConfigError


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


def test_a_switch_during_a_forward_applies_from_the_next_call():
    """Found: a padded GPT-2 forward whose input was read for sdpa met varlen (set by another thread)
    in its later layers, which refused the key-padding mask mid-forward. A forward now keeps the
    backend it started with; here the switch happens inside the forward, from a hook."""
    cfg = TINY["gpt2"]
    model = fastzoo.create("gpt2", attn="sdpa", **cfg).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    handle = model.transformer.h[0].register_forward_hook(lambda *a: model.set_attention("varlen") and None)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    handle.remove()
    assert model.attn_name == "varlen"
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max() <= 1e-5  # the same backend throughout: the same sums


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


def test_flex_from_two_threads_at_once():
    """Found by the concurrency property: two threads running one model on flex at once; one of them
    was refused ('compiled FlexAttention on CPU is refused') though nothing is compiled: uncompiled
    flex traces its own kernel with dynamo, which sets torch.compiler.is_compiling()'s flag for the
    whole process, and the other thread's forward read it. fastzoo asks fastzoo.tracing.tracing()."""
    import threading

    from fastzoo.errors import BackendUnavailableError

    cfg = TINY["vit"]
    model = fastzoo.create("vit_s16", attn="flex", **cfg).eval()
    x = torch.randn(1, 3, cfg["img_size"], cfg["img_size"])
    errors = []

    def run():
        try:
            for _ in range(20):
                with torch.no_grad():
                    model(x)
        except BackendUnavailableError as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_another_threads_flex_call_is_not_tracing_here():
    """The flag behind the flex refusal, the skipped SDPA lock and backend pin, and the input checks
    a traced forward leaves out: while a thread runs uncompiled flex, torch.compiler.is_compiling()
    reads True in every thread, fastzoo's tracing() in none."""
    import threading

    from fastzoo.tracing import tracing

    cfg = TINY["vit"]
    model = fastzoo.create("vit_s16", attn="flex", **cfg).eval()
    x = torch.randn(1, 3, cfg["img_size"], cfg["img_size"])
    stop, seen = threading.Event(), {"torch": 0, "fastzoo": 0}
    torch._dynamo.reset()  # flex traces its kernel on its first call (per shape): that trace sets the flag

    def poll():
        while not stop.is_set():
            seen["torch"] += torch.compiler.is_compiling()
            seen["fastzoo"] += tracing()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=poll)
    t.start()
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert seen["torch"] > 0  # the process-wide flag this test is about (torch 2.14)
    assert seen["fastzoo"] == 0


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


def test_pinned_sdpa_kernels_from_threads_leave_torchs_flags_as_they_were(monkeypatch):
    """Found by the threads property once pinned kernels were in it: torch's sdpa_kernel sets process-wide
    flags, so threads entering and leaving it interleaved ran on one another's kernels ('No viable backend
    for scaled_dot_product_attention' in an unpinned or nested call that met a pin) and left one kernel
    enabled for the whole process. Each SDPA call here takes 20 ms (torch's own, after a sleep), time for
    every other thread to come in: a pinned call must see only its kernel, the others the flags as set."""
    import copy
    import threading
    import time

    real = torch.nn.functional.scaled_dot_product_attention
    seen, who = [], threading.local()

    def slow_sdpa(*args, **kwargs):
        before = sdpa_flags()
        time.sleep(0.02)
        seen.append((who.kernel, before, sdpa_flags()))
        return real(*args, **kwargs)

    cfg = TINY["vit"]
    torch.manual_seed(0)
    base = fastzoo.create("vit_s16", attn="eager", **cfg).eval()
    x = torch.randn(2, 3, cfg["img_size"], cfg["img_size"])
    with torch.no_grad():
        want = base(x)
    flags, errors, worst = sdpa_flags(), [], [0.0]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", slow_sdpa)

    def run(name, options):
        who.kernel = options.get("sdpa_backend")
        model = copy.deepcopy(base).set_attention(name, **options)
        try:
            for _ in range(2):
                with torch.no_grad():
                    worst[0] = max(worst[0], (model(x) - want).abs().max().item())
        except Exception as e:  # noqa: BLE001 -- any error is the failure looked for
            errors.append(e)

    runs = [("sdpa", {"sdpa_backend": "math"}), ("sdpa", {"sdpa_backend": "flash"}), ("sdpa", {}), ("nested", {})]
    threads = [threading.Thread(target=run, args=r) for r in runs * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]
    only = {"math": "math_sdp_enabled", "flash": "flash_sdp_enabled"}
    for kernel, before, after in seen:
        want_flags = flags if kernel is None else {k: k == only[kernel] for k in flags}
        assert before == after == want_flags, (kernel, before, after)
    assert len(seen) == 2 * 2 * 4 * cfg["depth"]  # threads x forwards x layers: every call seen
    assert worst[0] <= 1e-4  # fastzoo.equivalence's fp32 rule: each kernel against eager
    assert sdpa_flags() == flags


def test_a_pinned_sdpa_call_that_raises_leaves_the_flags_and_the_other_threads_free():
    import threading

    from torch.nn.attention import SDPBackend

    from fastzoo.attention.sdpa import sdpa

    flags = sdpa_flags()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError):
        sdpa(q, q, torch.randn(1, 2, 5, 8), kernel=SDPBackend.MATH)  # 4 keys, 5 values
    assert sdpa_flags() == flags
    out = []
    t = threading.Thread(target=lambda: out.append(sdpa(q, q, q)))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and torch.allclose(out[0], torch.nn.functional.scaled_dot_product_attention(q, q, q))


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


def test_the_bf16_bound_is_the_originals_error_on_its_users_kernels_too():
    """Found: small ViTs under bf16 autocast were up to 4.5x past 3x timm's own bf16 error on sdpa /
    flex / nested (embed_dim 52 with 2 heads; img_size 8 with one head). The bound was timm's error on
    its eager attention, which rounds scores and probabilities to bf16 where a fused kernel keeps them
    in fp32: timm itself, as its users run it (fused attention), fails that bound on these inputs.
    The original's own error is now the worse of its two runs (fastzoo.equivalence.rule)."""
    import copy

    from fastzoo import equivalence

    spec = SPECS["vit"]
    cfg = {**TINY["vit"], "img_size": 8, "num_classes": 1, "num_heads": 1, "depth": 1, "reg_tokens": 1}
    torch.manual_seed(15)
    ref = spec.original.build(dict(cfg))
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(15))

    def logits(model, bf16: bool):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return equivalence.logits_of(model(x)).float()

    want = logits(ref, False)
    eager_bf16, users_bf16 = logits(copy.deepcopy(ref), True), logits(spec.as_users_run_it(copy.deepcopy(ref)), True)
    assert not equivalence.compare_outputs("timm, fused attention", users_bf16, want, eager_bf16).passed
    ours = fastzoo.create("vit_s16", pretrained=ref, attn="eager")
    for name, options in backends(dtype=torch.bfloat16):
        try:
            ours.set_attention(name, **options)
        except BackendUnavailableError:  # refused at the switch, by name (a test's registered kernel, say): not run
            continue
        c = equivalence.compare_outputs("logits", logits(ours, True), want, [eager_bf16, users_bf16])
        assert c.passed, (name, options, c)


def test_gradients_of_a_loss_constant_in_every_weight_are_compared_on_a_scale_of_one():
    """Found: a Llama with a one-token vocabulary in training mode: its cross-entropy is 0 whatever the
    weights, transformers' gradients are exactly 0 and fastzoo's fused cross-entropy leaves rounding
    noise (about 4e-8 on lm_head.weight); the relative gradient rule divided it by its 1e-30 floor
    (an error of 1e22). With no reference gradient to scale by, the scale is 1. (The fused loss forms
    ``softmax - onehot`` before rounding, so its gradients are exactly 0 here as well.)"""
    from fastzoo import equivalence

    spec = SPECS["llama"]
    cfg = {**TINY["llama"], "vocab_size": 1, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    torch.manual_seed(0)
    ref = spec.original.build(dict(cfg)).train()
    ours = fastzoo.create("llama", pretrained=ref, attn="eager").train()
    ids = torch.zeros(2, 7, dtype=torch.long)
    grads = []
    for model in (ref, ours):
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert all(not g.any() for g in grads[0].values()) and set(grads[0]) <= set(grads[1])  # transformers': exactly 0
    assert all(not grads[1][n].any() for n in grads[0])  # fastzoo's too (softmax - onehot formed before rounding)
    for noise, passes in ((4e-8, True), (1e-3, False)):  # the noise the fused loss left, judged on a scale of 1
        c = equivalence.compare_grads("grads", {n: torch.full_like(g, noise) for n, g in grads[0].items()}, grads[0])
        assert c.passed == passes and c.err == pytest.approx(noise), c


def test_an_ill_conditioned_detr_gradient_is_judged_against_the_originals_own_fp32_rounding():
    """Found: the packed path (varlen: one SDPA per image, torch's CPU flash kernel) gave DETR's
    ``input_projection.weight`` a gradient 1.42e-4 of its scale from transformers' eager, past the
    1e-4 bound, where transformers' SDPA agrees with its eager to 2e-7. That gradient cancels:
    transformers' own fp32 gradient is 5.2e-5 of the scale from its fp64 one, the packed path on
    torch's math kernel gives the same 5.2e-5, and the flash kernel 1.7e-4. Rounding, not another
    function: the fp32 bound counts the original's own rounding against fp64 (3x), and stays tight
    enough that a gradient off by 10x that rounding fails."""
    from test_fuzz_detection import detector_step, nontrivial_statistics, original_rounding
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fastzoo import equivalence

    spec = SPECS["detr"]
    fields = dict(num_labels=5, num_queries=6, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
                  decoder_ffn_dim=26, encoder_attention_heads=2, decoder_attention_heads=2, activation_function="silu",
                  dropout=0.0, backbone="transformers", layer_type="basic", depths=(1, 1, 1, 1),
                  hidden_sizes=(30, 30, 28, 15), embedding_size=8, bbox_cost=0.0, bbox_loss_coefficient=0.0)
    torch.manual_seed(579)
    ref = spec.original.build(fields)
    nontrivial_statistics(ref)
    for p in ref.parameters():
        p.requires_grad_(True)
    ref.eval()
    images = torch.randn(2, 3, 64, 42, generator=torch.Generator().manual_seed(1398))
    mask = torch.zeros(2, 64, 42, dtype=torch.long)
    mask[0, :33, :1] = mask[1, :1, :1] = 1  # one real feature position in the second image, two in the first
    labels = [{"class_labels": torch.tensor([4, 0]),
               "boxes": torch.tensor([[0.0364, 0.1444, 0.0, 0.0], [0.3088, 0.6743, 0.9361, 0.7871]])},
              {"class_labels": torch.zeros(0, dtype=torch.long), "boxes": torch.zeros(0, 4)}]
    want = detector_step(ref, images, mask, labels, grads=True)[1]
    users, exact = original_rounding(ref, images, mask, labels)
    model = fastzoo.create("detr", pretrained=ref, attn="varlen", dropout=0.0, bbox_cost=0.0, bbox_loss_coefficient=0.0).eval()
    name = "model.input_projection.weight"

    def error(g, r):
        return ((g[name] - r[name]).abs().max() / r[name].abs().max()).item()

    got = detector_step(model, images, mask, labels, grads=True)[1]
    with sdpa_kernel(SDPBackend.MATH):
        on_math = detector_step(model, images, mask, labels, grads=True)[1]
    hf_rounding = error(want, exact)
    assert error(on_math, exact) < 1.5 * hf_rounding < error(got, exact)  # the kernel's rounding, not the model's
    want, users, exact = ({k: r[k] for k in got} for r in (want, users, exact))  # what fastzoo trains
    c = equivalence.compare_grads("grads", got, want, kernels=users, exact=exact)
    assert c.passed, c
    off = dict(got)  # the bound is this parameter's own: 10x its rounding fails
    off[name] = want[name] + 10 * hf_rounding * want[name].abs().max() * torch.sign(torch.randn_like(want[name]))
    assert not equivalence.compare_grads("grads", off, want, kernels=users, exact=exact).passed


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


def test_a_constant_loss_under_bf16_has_zero_gradients_as_the_original():
    """Found (equivalence property replaying the long run's vocab_size=1 case in bf16): the loss over one
    class is constant; transformers' bf16 gradients are exactly 0, fastzoo's fused path gave 8e-3 to 1e-2:
    it subtracted the onehot after rounding the softmax to bf16. Now ``softmax - onehot`` is formed in fp32
    first, as the original's backward does."""
    cfg = {**TINY["gpt2"], "vocab_size": 1, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    torch.manual_seed(0)
    model = fastzoo.create("gpt2", attn="eager", **cfg).train()
    ids = torch.zeros(2, 5, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.float().backward()
    worst = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
    assert worst == 0, worst  # transformers': exactly 0 (the loss is log(1) whatever the weights)


def test_fp32_logits_of_1e7_are_compared_at_fp32_resolution():
    """Found by the long profile: Granite with ``logits_scaling=1.19e-7`` divides its logits by it, to ~1e7,
    where one fp32 unit in the last place is ~1; every backend was 0.75 from transformers' eager logits,
    'past' the absolute 1e-4. The fp32 rule reads 16 ulps of the largest value there, 1e-4 below 52."""
    from fastzoo import equivalence

    cfg = {**TINY["llama"], "model_type": "granite", "logits_scaling": 1.192092896e-07}
    torch.manual_seed(0)
    hf = SPECS["llama"].original.build(cfg).eval()
    ours = fastzoo.create("llama", pretrained=hf, attn="sdpa").eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 6))
    with torch.no_grad():
        a, b = ours(ids).logits, hf(ids).logits
    top = b.abs().max().item()
    assert top > 1e5  # the fuzzed regime: fp32 resolves these logits to O(1e-2) or coarser
    c = equivalence.compare_outputs("logits", a, b)
    assert c.passed and c.err > equivalence.FP32_OUT_ATOL < c.bound, (c.err, c.bound)  # failed the absolute rule alone
    assert c.bound <= equivalence.FP32_OUT_ULPS * torch.finfo(torch.float32).eps * top * 1.0001
    ordinary = b / top * 10  # logits up to 10 keep the absolute rule
    assert equivalence.compare_outputs("logits", ordinary, ordinary).bound == equivalence.FP32_OUT_ATOL
