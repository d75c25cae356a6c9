"""The Llama-style layouts (Llama, Qwen2, Mistral, Qwen3, OLMo 2, Granite, SmolLM3, Phi-3, Gemma 2,
Gemma 3) equal transformers' models on the same weights: logits, loss and gradients (fp32 CPU)
through every CPU attention backend that serves the layout, padded and packed; every rotary
schedule; generate token for token; save_pretrained read back by transformers; PEFT LoRA."""
import copy
import tempfile

import conftest
import pytest
import torch
import torch.nn.functional as F
import transformers

import fastzoo
from fastzoo.equivalence import draw_
from fastzoo import equivalence
from fastzoo.data import nested, pack, pad_to_longest
from fastzoo.errors import BackendUnavailableError, CheckpointError, ConfigError
from fastzoo.losses import causal_lm_loss

LOGIT_TOL = equivalence.FP32_OUT_ATOL  # DESIGN.md: fp32 CPU, same weights (1e-4)
GRAD_RTOL = equivalence.FP32_GRAD_RTOL  # gradients relative to each tensor's scale (fastzoo.equivalence's rule)
V = 96
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0)
# one config per layout, each exercising what that layout adds (window 4 < the longest sequence, 11)
LAYOUTS = {
    # head_dim != hidden / heads, q/k/v/o and MLP biases, untied head, llama3 frequencies
    "llama": (transformers.LlamaConfig, dict(
        head_dim=12, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8))),
    # q/k/v biases, tied head, sliding window on the upper layer only (max_window_layers)
    "qwen2": (transformers.Qwen2Config, dict(
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # sliding window on every layer
    "mistral": (transformers.MistralConfig, dict(sliding_window=4, tie_word_embeddings=False)),
    # QK-norm per head, head_dim != hidden / heads, sliding window on the upper layer, tied head
    "qwen3": (transformers.Qwen3Config, dict(
        head_dim=12, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # norms after attention and MLP, QK-norm over all heads, q/k/v/o biases
    "olmo2": (transformers.Olmo2Config, dict(attention_bias=True, tie_word_embeddings=False)),
    # the four multipliers, biases
    "granite": (transformers.GraniteConfig, dict(
        embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    # the upper layer without rotary embeddings and with a sliding window
    "smollm3": (transformers.SmolLM3Config, dict(
        no_rope_layer_interval=2, use_sliding_window=True, sliding_window=4, tie_word_embeddings=True)),
    # fused qkv_proj / gate_up_proj, sliding window on every layer
    "phi3": (transformers.Phi3Config, dict(sliding_window=4, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0)),
    # soft-capped scores and logits (caps low enough to bite at this init), sliding then global layer,
    # query_pre_attn_scalar != head_dim, pre- and post-norms, GeGLU
    "gemma2": (transformers.Gemma2Config, dict(
        head_dim=16, query_pre_attn_scalar=20, sliding_window=4, attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0, initializer_range=0.3)),
    # QK-norm, a rotary schedule per layer type (linear on the global layer), logits soft-capped
    "gemma3_text": (transformers.Gemma3TextConfig, dict(
        head_dim=16, query_pre_attn_scalar=20, sliding_window=4, final_logit_softcapping=2.0, initializer_range=0.3,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=2.0)})),
}
TRAIN_BACKENDS = [("eager", {}), ("sdpa", {}), ("sdpa", {"sdpa_backend": "math"}), ("nested", {}), ("varlen", {}),
                  ("varlen", {"impl": "cpu"})]
ALL_BACKENDS = TRAIN_BACKENDS + [("flex", {}), ("varlen", {"impl": "flex"})]
IDS = lambda b: f"{b[0]}{'-' + '-'.join(map(str, b[1].values())) if b[1] else ''}"  # noqa: E731


def hf_model(layout="llama", seed=1, **kw):
    cls, fields = LAYOUTS[layout]
    torch.manual_seed(seed)
    cfg = cls(**{**BASE, **fields, **kw}, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "eager"
    return draw_(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"), seed=seed).eval()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def hf(request):
    return hf_model(request.param)


def ours(hf, attn="eager", **opts):
    return fastzoo.create(hf.config.model_type, attn=attn, attn_options=opts, pretrained=hf).eval()


def ours_or_refused(hf, backend):
    """The model on ``backend``, or None where the backend lacks what the model needs (a sliding
    window, soft-capped scores): then create refuses it, naming it (never a silent full attention
    or uncapped scores)."""
    name, opts = backend
    caps = fastzoo.attention.get_backend(name, **opts).capabilities
    windowed = getattr(hf.config, "sliding_window", None) is not None
    if windowed and not caps.window:
        with pytest.raises(BackendUnavailableError, match="sliding-window"):
            ours(hf, name, **opts)
        return None
    if getattr(hf.config, "attn_logit_softcapping", None) and hf.config.model_type == "gemma2" and not caps.softcap:
        with pytest.raises(BackendUnavailableError, match="soft-capping"):
            ours(hf, name, **opts)
        return None
    return ours(hf, name, **opts)


def serving(hf, *names):
    """The first backend of ``names`` that serves the model (Gemma 2's soft-capped scores: not sdpa)."""
    caps = lambda n: fastzoo.attention.get_backend(n).capabilities  # noqa: E731
    capped = hf.config.model_type == "gemma2" and bool(hf.config.attn_logit_softcapping)
    return next(n for n in names if caps(n).softcap or not capped)


def seqs(lengths=(5, 11, 3)):
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def assert_close(got, want, name="logits"):
    c = equivalence.compare_outputs(name, got, want)
    assert c.err <= LOGIT_TOL, f"{name}: max |diff| {c.err:.2e}"


def assert_grads_close(model, hf):
    ref = {k: p.grad for k, p in hf.named_parameters()}  # HF's names are fastzoo's
    grads = {n: p.grad for n, p in model.named_parameters()}
    c = equivalence.compare_grads("grads", grads, {n: g for n, g in ref.items() if n in grads})
    assert c.err <= GRAD_RTOL, f"grad of {c.worst}: relative error {c.err:.2e}"


def hf_each_alone(hf, sequences):
    with torch.no_grad():
        return torch.cat([hf(s[None]).logits[0] for s in sequences])


# -- padded and packed, every CPU backend ---------------------------------------------------------
# right padding on every backend that trains on CPU; left padding (generation's) on one of each kind
PADDED = [(b, "right") for b in TRAIN_BACKENDS] + [(("sdpa", {}), "left"), (("varlen", {}), "left")]


@pytest.mark.parametrize("backend, side", PADDED, ids=lambda x: IDS(x) if isinstance(x, tuple) else x)
def test_padded_logits_loss_grads_equal_hf(hf, backend, side):
    batch = pad_to_longest(seqs(), side=side)
    # padding scores nothing, nor predicts anything: a left-padded row's last padding position would
    # be scored against the first token, from a query that sees no key (each library's own value)
    real = batch.attention_mask.bool()
    labels = batch.input_ids.masked_fill(~real | ~F.pad(real, (1, 0))[:, :-1], -100)
    inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    hf.zero_grad()
    want = hf(**inputs)
    want.loss.backward()
    m = ours_or_refused(hf, backend)
    if m is None:
        return
    got = m(**inputs)
    assert_close(got.logits[real], want.logits[real])
    assert (got.loss - want.loss).abs() <= 1e-5  # a mean CE of O(5): fp32 rounding
    got.loss.backward()
    assert_grads_close(m, hf)


@pytest.mark.parametrize("backend", ALL_BACKENDS, ids=IDS)
def test_packed_sequences_equal_each_sequence_alone(hf, backend):
    m = ours_or_refused(hf, backend)
    if m is None:
        return
    with torch.no_grad():
        packed = m(**pack(seqs()).model_inputs()).logits
        jagged = m(nested(seqs())).logits
    want = hf_each_alone(hf, seqs())
    assert_close(packed[0], want, "packed logits")
    assert_close(jagged.values(), want, "nested logits")


@pytest.mark.parametrize("backend", [("sdpa", {}), ("varlen", {}), ("nested", {})], ids=IDS)
def test_packed_training_step_equals_hf_padded(hf, backend):
    padded = pad_to_longest(seqs())
    hf.zero_grad()
    want = hf(padded.input_ids, attention_mask=padded.attention_mask, labels=padded.labels).loss
    want.backward()
    m = ours_or_refused(hf, backend)
    if m is None:
        return
    m.train()  # dropout is 0: train() changes nothing but the fused loss
    batch = pack(seqs())
    got = m(**batch.model_inputs(), labels=batch.labels)
    assert got.logits is None  # train mode: the loss is fused with the LM head
    assert (got.loss - want).abs() <= 1e-5
    got.loss.backward()
    assert_grads_close(m, hf)


# -- rotary schedules, grouped-query attention, head width, windows ----------------------------
ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8),
    "longrope": dict(rope_type="longrope", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
                     short_factor=[1.0 + 0.1 * i for i in range(4)], long_factor=[2.0 + 0.3 * i for i in range(4)]),
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_every_rope_type_equals_hf_past_the_original_context(rope):
    """Sequences of 40 tokens: past max_position_embeddings (dynamic grows its base) and past
    original_max_position_embeddings (longrope switches to its long factors)."""
    hf = hf_model("llama", rope_parameters=ROPES[rope], head_dim=None, max_position_embeddings=24)
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(3))
    hf.zero_grad()
    want = hf(ids, labels=ids)
    want.loss.backward()
    m = ours(hf, "sdpa")
    got = m(ids, labels=ids)
    assert_close(got.logits, want.logits)
    got.loss.backward()
    assert_grads_close(m, hf)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, None), (4, 1, None), (2, 2, 24)])
@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_grouped_query_and_head_widths_equal_hf(heads, kv_heads, head_dim, attn):
    hf = hf_model("mistral", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    batch = pad_to_longest(seqs(), side="left")
    with torch.no_grad():
        got = ours(hf, attn)(batch.input_ids, attention_mask=batch.attention_mask).logits
        want = hf(batch.input_ids, attention_mask=batch.attention_mask).logits
    real = batch.attention_mask.bool()
    assert_close(got[real], want[real])


def test_the_window_changes_the_function():
    """Without a window each token would see all of its sequence: the window is really applied."""
    hf = hf_model("mistral")
    ids = seqs((11,))[0][None]
    windowless = fastzoo.create("mistral", attn="eager", pretrained=hf, sliding_window=None).eval()
    with torch.no_grad():
        assert (windowless(ids).logits - hf(ids).logits)[:, 4:].abs().max() > 1e-3
        assert_close(ours(hf)(ids).logits, hf(ids).logits)


# -- generate, the KV cache ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["greedy", "top_k", "beams"])
@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_generate_equals_hf_token_for_token(hf, kind, attn):
    """Left-padded prompts, 12 new tokens: past the window (4) of the sliding layouts, whose
    transformers cache keeps only the keys the window still sees (sdpa: eager for Gemma 2)."""
    m = ours(hf, serving(hf, attn, "eager"))
    conftest.assert_generate_equals_original(m, hf, pad_to_longest(seqs(), side="left"), kind)


def test_cache_continuation_equals_full_forward(hf):
    m = ours(hf, serving(hf, "sdpa", "eager"))
    ids = seqs((11,))[0][None]
    first = m(ids[:, :6], use_cache=True)
    step = m(ids[:, 6:], past_key_values=first.past_key_values)
    with torch.no_grad():
        assert_close(step.logits, hf(ids).logits[:, 6:])


def test_sliding_window_cache_layers_on_a_packed_only_backend_are_refused_naming_the_cache():
    from transformers.cache_utils import DynamicCache

    hf = hf_model("mistral")
    m = ours(hf, "varlen")
    b = pad_to_longest(seqs(), side="left")
    cache = DynamicCache(config=hf.config)  # keeps only the last sliding_window - 1 keys
    out = m(b.input_ids, attention_mask=b.attention_mask, past_key_values=cache)
    mask = F.pad(b.attention_mask, (0, 1), value=1)
    with pytest.raises(ValueError, match="past_key_values.*sliding-window"):
        m(b.input_ids[:, :1], attention_mask=mask, past_key_values=out.past_key_values)


# -- training with transformers' tools -------------------------------------------------------------
def _trainer_losses(model, gradient_checkpointing: bool) -> list[float]:
    g = torch.Generator().manual_seed(1)
    ds = [{"input_ids": torch.randint(0, V, (int(n),), generator=g).tolist()} for n in torch.randint(4, 20, (12,), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3, logging_steps=1, report_to=[],
        learning_rate=1e-3, seed=0, use_cpu=True, save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   data_collator=transformers.DataCollatorWithFlattening())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_trainer_with_flattening_and_gradient_checkpointing_matches_hf(model_type):
    """transformers' Trainer, packed batches (DataCollatorWithFlattening), gradient checkpointing:
    fastzoo's loss curve is HF's (HF's model trained the same way, padded inside its own kernels)."""
    hf = hf_model(model_type)
    ref = _trainer_losses(copy.deepcopy(hf).train(), gradient_checkpointing=True)
    model = ours(hf, "varlen").train()
    got = _trainer_losses(model, gradient_checkpointing=True)
    assert model.is_gradient_checkpointing
    assert len(got) == len(ref) == 3
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4  # fp32, 3 AdamW steps apart from rounding


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_peft_lora_trains_only_the_adapters_as_on_hf(model_type, layout):
    """peft's LoRA on attention and MLP projections (Phi-3's fused ones as they are): HF's adapters,
    the base frozen, HF's loss and adapter gradients (packed: fastzoo's packed batch against HF's
    padded one); merged, HF's logits."""
    hf = hf_model(model_type)
    batch = pad_to_longest(seqs())
    packed = pack(seqs())
    inputs = dict(**packed.model_inputs(), labels=packed.labels) if layout == "packed" else {}
    targets = ["qkv_proj", "o_proj", "gate_up_proj"] if model_type == "phi3" else ["q_proj", "v_proj", "down_proj"]
    mine, theirs = conftest.assert_lora_equals_original(ours(hf, "varlen"), copy.deepcopy(hf), targets, batch, **inputs)
    merged, hf_merged = mine.merge_and_unload(), theirs.merge_and_unload()
    assert isinstance(merged, type(ours(hf)))  # peft hands back fastzoo's model, adapters folded in
    with torch.no_grad():
        assert_close(merged(**packed.model_inputs()).logits[0], hf_each_alone(hf_merged, seqs()))


# -- checkpoints ---------------------------------------------------------------------------------
def test_save_pretrained_is_read_by_transformers_and_back(hf, tmp_path):
    m = ours(hf, serving(hf, "sdpa", "eager"))
    m.save_pretrained(tmp_path / "ours")
    # eager: transformers' default (SDPA) drops Gemma 2's attention soft-capping
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    ids = seqs((9,))[0][None]
    with torch.no_grad():
        assert_close(back(ids).logits, hf(ids).logits)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # several shards and an index
    again = fastzoo.create(hf.config.model_type, attn=serving(hf, "sdpa", "eager"), pretrained=tmp_path / "hf")
    with torch.no_grad():
        assert_close(again(ids).logits, hf(ids).logits)


def test_state_dict_with_overrides_in_hf_names():
    """A bare state dict fixes the sizes; what it cannot show (heads, rotary, epsilon) is passed by HF's names."""
    hf = hf_model("llama", head_dim=None, rope_parameters=None, attention_bias=False, mlp_bias=False)
    m = fastzoo.create("llama", pretrained=hf.state_dict(), num_attention_heads=4, num_key_value_heads=BASE["num_key_value_heads"],
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6).eval()
    ids = seqs((9,))[0][None]
    with torch.no_grad():
        assert_close(m(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("field, value", [
    ("num_local_experts", 8), ("add_cross_attention", True), ("vision_config", {"model_type": "clip"}),
    ("rope_parameters", {"rope_type": "mrope", "rope_theta": 10000.0}),
])
def test_configs_fastzoo_does_not_reproduce_are_refused_naming_the_field(tmp_path, field, value):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    cfg = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
    cfg[field] = value
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    with pytest.raises((CheckpointError, ConfigError), match=field if field != "rope_parameters" else "mrope"):
        fastzoo.create("llama", pretrained=tmp_path)


def test_unknown_rope_type_override_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="rope_parameters"):
        fastzoo.create("llama", **BASE, rope_parameters={"rope_type": "su", "rope_theta": 1.0})


def test_loss_function_takes_the_output_object():
    m = fastzoo.create("llama", **BASE).eval()
    ids = seqs((9,))[0][None]
    out = m(ids)
    assert torch.equal(causal_lm_loss(out, ids), causal_lm_loss(out.logits, ids))
    with pytest.raises(ValueError, match="logits"):
        causal_lm_loss(m.train()(ids, labels=ids), ids)  # train mode with labels: no logits (fused loss)
