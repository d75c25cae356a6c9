"""What the Llama-style layouts add beyond Llama, each shown to matter: soft-capped scores and
logits (in the fused loss too), the attention capability that carries the cap (refused where a
backend lacks it), Phi-3's fused projections kept fused, the layout read from a state dict's
keys, and the configs fastzoo refuses by the field's name (mixtures of experts, another layout's
settings). Equality with transformers per layout and backend is tests/test_llama.py's."""
import pytest
import torch
import transformers
from test_llama import V, assert_close, hf_model, seqs

import fastzoo
from fastzoo.data import pack
from fastzoo.errors import BackendUnavailableError, CheckpointError, ConfigError, UnknownModelError
from fastzoo.losses import linear_cross_entropy


# -- soft-capping --------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("block_bytes", [None, 1 << 30], ids=["two-pass", "one-pass-budget"])
def test_fused_loss_with_final_softcap_equals_capped_logits_cross_entropy(reduction, block_bytes):
    """Logits large enough for the cap (2.0) to bite; loss and both gradients as the reference's
    (fp32: 1e-5 relative, a sum of a few hundred terms in another order)."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(37, 16, generator=g) * 2).requires_grad_()
    w = (torch.randn(300, 16, generator=g) * 2).requires_grad_()
    t = torch.randint(0, 300, (37,), generator=g)
    t[::5] = -100
    grads = {}
    for impl in ("reference", "fused"):
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, t, reduction=reduction, impl=impl, block_bytes=block_bytes, softcap=2.0)
        (loss if reduction != "none" else loss @ torch.linspace(0.5, 1.5, 37)).backward()
        grads[impl] = (loss.detach(), h.grad.clone(), w.grad.clone())
    for name, got, want in zip(("loss", "grad h", "grad w"), grads["fused"], grads["reference"]):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name
    uncapped = linear_cross_entropy(h, w, t, reduction=reduction, impl="reference")
    assert (uncapped - grads["reference"][0]).abs().max() > 1e-2  # the cap changes the loss


def test_torch_linear_cross_entropy_has_no_cap_and_says_so():
    with pytest.raises(ValueError, match="soft-capping"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.arange(4), impl="torch", softcap=30.0)


@pytest.mark.parametrize("field", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_softcap_changes_the_function(field):
    """Without the cap the model is another function: the caps are really applied (and equal HF's)."""
    hf = hf_model("gemma2")
    ids = seqs((11,))[0][None]
    uncapped = fastzoo.create("gemma2", attn="eager", pretrained=hf, **{field: None}).eval()
    capped = fastzoo.create("gemma2", attn="eager", pretrained=hf).eval()
    with torch.no_grad():
        want = hf(ids).logits
        assert (uncapped(ids).logits - want).abs().max() > 1e-2
        assert_close(capped(ids).logits, want)


def test_a_backend_without_softcap_is_refused_naming_it_and_the_default_serves_the_model():
    hf = hf_model("gemma2")
    for name in ("sdpa", "nested"):
        with pytest.raises(BackendUnavailableError, match="soft-capping"):
            fastzoo.create("gemma2", attn=name, pretrained=hf)
    m = fastzoo.create("gemma2", pretrained=hf).eval()
    assert m.attn_name == "varlen"  # sdpa cannot cap the scores: the first default that can
    with pytest.raises(BackendUnavailableError, match="soft-capping"):
        m.set_attention("sdpa")
    assert m.attn_name == "varlen"  # a refused switch changes nothing
    batch = pack(seqs())
    with torch.no_grad():
        want = torch.cat([hf(s[None]).logits[0] for s in seqs()])
        assert_close(m(**batch.model_inputs()).logits[0], want)


def test_gemma3_text_is_not_given_an_attention_cap_transformers_does_not_apply():
    cfg = transformers.Gemma3TextConfig(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        attn_logit_softcapping=5.0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        fastzoo.create("gemma3_text", pretrained=hf)


# -- fused projections, layouts from keys ---------------------------------------------------------
def test_phi3_projections_stay_fused_one_matmul_each():
    hf = hf_model("phi3")
    m = fastzoo.create("phi3", attn="eager", pretrained=hf)
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    assert hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj")
    assert hasattr(mlp, "gate_up_proj") and not hasattr(mlp, "gate_proj")
    assert set(m.state_dict()) == set(hf.state_dict())  # HF's keys, loaded as they are


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "phi3", "gemma2", "gemma3_text", "qwen2", "llama"])
def test_the_layout_is_read_from_a_state_dicts_keys(model_type):
    from fastzoo.models.decoder.convert import LLAMA

    inferred = LLAMA.infer_config(hf_model(model_type).state_dict())
    assert inferred.get("model_type", "llama") == model_type


def test_a_bare_phi3_state_dict_with_what_the_keys_cannot_show_equals_hf():
    hf = hf_model("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    m = fastzoo.create("phi3", attn="eager", pretrained=hf.state_dict(), num_attention_heads=4, num_key_value_heads=2,
                       sliding_window=4, rms_norm_eps=hf.config.rms_norm_eps,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).eval()
    ids = seqs((9,))[0][None]
    with torch.no_grad():
        assert_close(m(ids).logits, hf(ids).logits)


# -- refused by the field's name -----------------------------------------------------------------
MOE = {  # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    "qwen3_moe": (transformers.Qwen3MoeConfig, "num_(local_)?experts"),
    "mixtral": (transformers.MixtralConfig, "num_local_experts"),
}


@pytest.mark.parametrize("model_type", list(MOE))
def test_mixture_of_experts_is_refused_naming_the_field(model_type):
    cls, field = MOE[model_type]
    cfg = cls(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(CheckpointError, match=field):
        fastzoo.create("qwen3", pretrained=hf)
    with pytest.raises(UnknownModelError, match="mixture of experts"):  # its name says what it is
        fastzoo.create(model_type)


@pytest.mark.parametrize("model_type, field, value", [
    ("llama", "logits_scaling", 2.0), ("qwen3", "no_rope_layers", (1, 0)), ("mistral", "final_logit_softcapping", 30.0),
    ("olmo2", "query_pre_attn_scalar", 64), ("phi3", "mlp_bias", True), ("llama", "layer_types", ("full_attention",) * 2),
])
def test_another_layouts_setting_is_refused_naming_the_field(model_type, field, value):
    with pytest.raises(ConfigError, match=field):
        fastzoo.create(model_type, device="meta", num_hidden_layers=2, **{field: value})


# -- rotary and kernels the layouts lean on ----------------------------------------------------------
def test_phi3_longrope_past_the_original_context_equals_hf():
    """Phi-3's 128k checkpoints: longrope, short factors up to original_max_position_embeddings (16
    here), long factors past it (40 tokens)."""
    factors = dict(short_factor=[1.0 + 0.1 * i for i in range(4)], long_factor=[2.0 + 0.3 * i for i in range(4)])
    hf = hf_model("phi3", max_position_embeddings=64, original_max_position_embeddings=16,
                  rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, **factors))
    m = fastzoo.create("phi3", attn="sdpa", pretrained=hf).eval()
    for length in (10, 40):
        ids = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            assert_close(m(ids).logits, hf(ids).logits)


def test_varlen_cpu_kernel_caps_scores_alike_eager_and_under_compile():
    """The CPU varlen kernel's soft-capped path (per sequence, and the one-call slot form it takes
    while compiling) against eager on the same packed batch: fp32, 1e-6."""
    from fastzoo.attention import AttnContext, get_backend
    from fastzoo.attention import varlen

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=g) * 3 for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    ctx = AttnContext(causal=True, cu_seqlens=cu, max_seqlen=7, window=3, softcap=1.5)
    want = get_backend("eager")(q, k, v, ctx)
    assert (want - get_backend("eager")(q, k, v, ctx.replace(softcap=None))).abs().max() > 1e-2
    got = get_backend("varlen", impl="cpu")(q, k, v, ctx)
    assert (got - want).abs().max() <= 1e-6
    to_THD = lambda x: x[0].transpose(0, 1)  # noqa: E731
    slots = varlen._slot_sdpa(to_THD(q), to_THD(k), to_THD(v), cu, 7, cu, 7, causal=True, scale=None, dropout_p=0.0,
                              ctx=None, window=3, softcap=1.5)
    assert (slots - to_THD(want)).abs().max() <= 1e-6


def test_flex_caps_the_scores_before_a_users_score_mod_as_eager_does():
    hf = hf_model("gemma2")
    ids = seqs((11,))[0][None]
    bias = lambda score, b, h, q_idx, kv_idx: score + 0.1 * (q_idx - kv_idx)  # noqa: E731
    with torch.no_grad():  # flex on CPU: inference only
        outs = [fastzoo.create("gemma2", attn=name, attn_options={"score_mod": bias}, pretrained=hf).eval()(ids).logits
                for name in ("eager", "flex")]
        assert (outs[0] - hf(ids).logits).abs().max() > 1e-3  # the user's score_mod is applied ...
    assert_close(outs[1], outs[0])  # ... after the cap, in both


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "granite", "smollm3", "phi3", "gemma2", "gemma3_text"])
def test_fastzoo_check_runs_each_layout_at_the_familys_tiny_size(name):
    """`fastzoo check NAME --tiny`: the family's tiny sizes over each layout's variant (its per-layer
    lists, head width and token ids reset to fit), logits and grads padded and packed (fp32 rule)."""
    from fastzoo.equivalence import check, tiny_overrides

    result = check(name, "varlen", overrides=tiny_overrides(name), batch=2)
    assert result.passed, result.rows()
    assert {c.name.split(" ")[0] for c in result.comparisons} >= {"logits", "grads"}


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "granite", "smollm3", "phi3", "gemma2", "gemma3_text"])
def test_bf16_logits_within_the_low_precision_rule_of_hfs_own_bf16(model_type):
    """The norms' cast order (OLMo 2's and Gemma's weight in fp32, Gemma's 1 + weight), Gemma's
    embedding scale rounded to the weights' dtype: in bf16, fastzoo's distance to HF's fp32 logits
    is at most 3x HF's own bf16 distance (DESIGN.md's low-precision rule, fastzoo.equivalence)."""
    import copy

    from fastzoo.equivalence import compare_outputs

    hf = hf_model(model_type)
    ids = seqs((11,))[0][None]
    with torch.no_grad():
        ref = hf(ids).logits
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits
        ours = fastzoo.create(model_type, attn="eager", pretrained=hf, dtype=torch.bfloat16).eval()(ids).logits
    c = compare_outputs("bf16 logits", ours, ref, peer=theirs)
    assert c.err <= c.bound, f"max |ours - fp32| {c.err:.2e} > {c.bound:.2e} (3x HF bf16's {c.peer_err:.2e})"


def test_explain_names_the_capped_cpu_kernel_gemma2_runs_by_default():
    """varlen's CPU kernel writes capped attention out in plain ops: explain says so, no fallback."""
    hf = hf_model("gemma2")
    report = fastzoo.explain(fastzoo.create("gemma2", pretrained=hf), seqs((11,))[0][None])
    assert "soft-capped" in str(report) and "_scaled_dot_product" not in str(report)
