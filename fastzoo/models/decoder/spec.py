"""The decoder families as the rest of fastzoo reads them (GPT-2; the Llama-style layouts: Llama,
Qwen2, Mistral, Qwen3, OLMo 2, Granite, SmolLM3, Phi-3, Gemma 2, Gemma 3): variants named by their
hub ids, converters, tiny configs, the originals, FLOP counts."""
from __future__ import annotations

import torch
from torch import nn

from fastzoo.models.decoder.convert import GPT2, GPT2_FASTZOO, LLAMA, LLAMA_LAYOUTS, hf_config
from fastzoo.models.decoder.gpt2 import GPT2LMHeadModel
from fastzoo.models.decoder.llama import LlamaForCausalLM
from fastzoo.models.spec import BenchSettings, ModelSpec, Original, Variant, Workload
from fastzoo.tasks import CAUSAL_LM


def hf_gpt2(cfg: dict) -> nn.Module:
    """transformers' GPT2LMHeadModel on fastzoo config fields, eager attention (the reference)."""
    from transformers import GPT2Config, GPT2LMHeadModel as HFGPT2

    return HFGPT2(GPT2Config(**cfg, attn_implementation="eager"))


def hf_as_users_run_it(model: nn.Module) -> nn.Module:
    """transformers' default attention, SDPA, where it computes the model's function. Its SDPA path has no
    attention-logit soft-capping (a tiny Gemma 2 with a cap of 2: logits 1.65 from its eager run), so a model
    with one stays on eager, as transformers recommends for Gemma 2."""
    if getattr(model.config, "attn_logit_softcapping", None) is None:
        model.set_attn_implementation("sdpa")
    return model


def gpt2_flops(cfg, *, tokens: int, attended: int, train: bool = True) -> int:
    """Matmul FLOPs of one step over ``tokens`` tokens of which ``attended`` (query, key) pairs
    are computed (the sum of squared sequence lengths when packed, B * S^2 when padded)."""
    D, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
    per_token = cfg.n_layer * 2 * D * (3 * D + D + 2 * inner) + 2 * D * cfg.vocab_size
    forward = tokens * per_token + cfg.n_layer * 2 * 2 * attended * D
    return forward * (3 if train else 1)


def _gpt2(name: str, n_embd: int, n_layer: int, n_head: int, what: str) -> Variant:
    """A GPT-2 size under Hugging Face's model id, also spelled ``openai-community/<id>`` (its hub
    organisation) and with an underscore (``gpt2_medium``); the name picks the architecture, no hub
    is contacted."""
    aliases = (f"openai-community/{name}",) + ((name.replace("-", "_"),) if "-" in name else ())
    return Variant(name, dict(vocab_size=50257, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head),
                   f"GPT-2 {what}, as Hugging Face's {name} (GPT2LMHeadModel)", f"transformers GPT2LMHeadModel ({name})",
                   aliases=aliases)


GPT2_SPEC = ModelSpec(
    family="gpt2",
    task=CAUSAL_LM,
    model=GPT2LMHeadModel,
    variants=(
        _gpt2("gpt2", 768, 12, 12, "small (124M)"),
        _gpt2("gpt2-medium", 1024, 24, 16, "medium (355M)"),
        _gpt2("gpt2-large", 1280, 36, 20, "large (774M)"),
        _gpt2("gpt2-xl", 1600, 48, 25, "XL (1.5B)"),
        Variant("distilgpt2", dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=6, n_head=12),
                "DistilGPT-2 (82M), as Hugging Face's distilgpt2 (GPT2LMHeadModel)",
                "transformers GPT2LMHeadModel (distilgpt2)", aliases=("distilbert/distilgpt2",)),
    ),
    converters=(GPT2, GPT2_FASTZOO),
    tiny=dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64),
    original=Original(hf_gpt2, "transformers GPT2LMHeadModel (eager attention)", "attn_pdrop", users=hf_as_users_run_it),
    shallow=lambda cfg: {**cfg, "n_layer": 1, "vocab_size": 512, "n_positions": 64},
    flops=gpt2_flops,
    bench=BenchSettings(
        variant="gpt2", library="HF", peer_attention="sdpa", compile=False,
        deterministic=dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        sizes={"bench": Workload("4x256, 8 seqs in [1,512]", dict(n_layer=4, n_embd=256, n_head=4), batch=8, max_len=512),
               "tour": Workload("GPT-2 4x256, 8 seqs of 1-128 tokens", dict(n_layer=4, n_embd=256, n_head=4), batch=8,
                                max_len=128),
               "quick": Workload("tiny GPT-2", dict(n_layer=1, n_embd=64, n_head=4, vocab_size=256), batch=4, max_len=32)}),
)


def hf_llama(cfg: dict) -> nn.Module:
    """transformers' model of the config's layout (``model_type``) on fastzoo config fields,
    eager attention (the reference)."""
    import transformers

    from fastzoo.models.decoder.config import LlamaConfig

    hf_cfg = hf_config(LlamaConfig.from_dict(cfg))
    hf_cfg._attn_implementation = "eager"  # else transformers picks its default (SDPA)
    return getattr(transformers, LLAMA_LAYOUTS[hf_cfg.model_type])(hf_cfg).to(torch.float32)


def llama_flops(cfg, *, tokens: int, attended: int, train: bool = True) -> int:
    """Matmul FLOPs of one step over ``tokens`` tokens of which ``attended`` (query, key) pairs
    are computed (the sum of squared sequence lengths when packed, B * S^2 when padded; a
    sliding window is not subtracted: the dense kernels compute the masked pairs too)."""
    D, hd, H, Hkv = cfg.hidden_size, cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
    per_token = cfg.num_hidden_layers * 2 * (D * hd * (2 * H + 2 * Hkv) + 3 * D * cfg.intermediate_size)
    forward = tokens * (per_token + 2 * D * cfg.vocab_size) + cfg.num_hidden_layers * 2 * 2 * attended * H * hd
    return forward * (3 if train else 1)


def _llama(name: str, hf: str, what: str, *aliases: str, **config) -> Variant:
    """A checkpoint's architecture: its config.json's fields (as published on the hub, rotary
    and token ids included; dropout and init left at their defaults), named by its hub id too."""
    cls = LLAMA_LAYOUTS[config["model_type"]]
    return Variant(name, config, f"{what}, as transformers' {cls} ({hf})", f"transformers {cls} ({hf})",
                   aliases=(hf, *aliases))


def _rope(theta: float, **more) -> dict:
    return dict(rope_type="default", rope_theta=theta, **more)


_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
_LLAMA32 = dict(model_type="llama", vocab_size=128256, intermediate_size=8192, num_key_value_heads=8,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000,
                eos_token_id=128001, rope_parameters=_LLAMA3_ROPE)
_QWEN2 = dict(model_type="qwen2", vocab_size=151936, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960,
              rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645, rope_parameters=_rope(1000000.0))
_OLMO2 = dict(model_type="olmo2", vocab_size=100352, max_position_embeddings=4096, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=100257, pad_token_id=100277, rope_parameters=_rope(500000.0))
_GRANITE3 = dict(model_type="granite", vocab_size=49155, num_hidden_layers=40, num_attention_heads=32,
                 num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=True, embedding_multiplier=12.0,
                 residual_multiplier=0.22, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_PHI3 = dict(model_type="phi3", vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=2047,
             bos_token_id=1, eos_token_id=32000, pad_token_id=32000, rope_parameters=_rope(10000.0))
_GEMMA2 = dict(model_type="gemma2", vocab_size=256000, head_dim=256, hidden_act="gelu_pytorch_tanh",
               max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=4096, attn_logit_softcapping=50.0,
               final_logit_softcapping=30.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
               rope_parameters=_rope(10000.0))


# Which fields each checkpoint's config.json states (as published on the hub; these are the
# architecture, rotary, norm epsilon, window, multipliers / soft-caps and token ids):
LLAMA_VARIANTS = (
    _llama("llama", "meta-llama/Llama-3.2-1B", "Llama 3.2 1B: grouped-query attention, llama3 rotary, tied head",
           "llama-3.2-1b", **_LLAMA32, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32),
    _llama("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "Llama 3.2 3B", **_LLAMA32, hidden_size=3072, num_hidden_layers=28,
           num_attention_heads=24),
    _llama("qwen2", "Qwen/Qwen2-0.5B", "Qwen2 0.5B: q/k/v biases, grouped-query attention, tied head", "qwen2-0.5b",
           **_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
           num_key_value_heads=2, max_position_embeddings=131072, tie_word_embeddings=True,
           rope_parameters=_rope(1000000.0)),
    _llama("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "Qwen2.5 0.5B", **_QWEN2, hidden_size=896, intermediate_size=4864,
           num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
           tie_word_embeddings=True, rope_parameters=_rope(1000000.0)),
    _llama("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", "Qwen2.5 1.5B", **_QWEN2, hidden_size=1536, intermediate_size=8960,
           num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
           tie_word_embeddings=True, rope_parameters=_rope(1000000.0)),
    _llama("mistral", "mistralai/Mistral-7B-v0.1", "Mistral 7B: sliding-window attention (4096), grouped-query",
           "mistral-7b-v0.1", model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
           rms_norm_eps=1e-5, sliding_window=4096, rope_parameters=_rope(10000.0)),
    _llama("qwen3", "Qwen/Qwen3-0.6B", "Qwen3 0.6B: QK-norm per head, head_dim 128 apart from hidden / heads",
           "qwen3-0.6b", **_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
           tie_word_embeddings=True),
    _llama("qwen3-1.7b", "Qwen/Qwen3-1.7B", "Qwen3 1.7B", **_QWEN3, hidden_size=2048, intermediate_size=6144,
           num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
    _llama("qwen3-4b", "Qwen/Qwen3-4B", "Qwen3 4B", **_QWEN3, hidden_size=2560, intermediate_size=9728,
           num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=True),
    _llama("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3 8B", **_QWEN3, hidden_size=4096, intermediate_size=12288,
           num_hidden_layers=36, num_attention_heads=32),
    _llama("olmo2", "allenai/OLMo-2-0425-1B", "OLMo 2 1B: norms after attention and MLP, QK-norm over all heads",
           "olmo-2-0425-1b", **_OLMO2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
           num_attention_heads=16),
    _llama("granite", "ibm-granite/granite-3.1-2b-base", "Granite 3.1 2B: embedding, residual, attention and logits "
           "multipliers", "granite-3.1-2b", "ibm-granite/granite-3.1-2b-instruct", **_GRANITE3, hidden_size=2048,
           intermediate_size=8192, attention_multiplier=0.015625, logits_scaling=8.0, max_position_embeddings=131072,
           rope_parameters=_rope(5000000.0)),
    _llama("smollm3", "HuggingFaceTB/SmolLM3-3B", "SmolLM3 3B: every fourth layer without rotary embeddings",
           "smollm3-3b", model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
           num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536,
           rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128012, pad_token_id=128004,
           no_rope_layers=tuple(int((i + 1) % 4 != 0) for i in range(36)), rope_parameters=_rope(5000000.0)),
    _llama("phi3", "microsoft/Phi-3-mini-4k-instruct", "Phi-3 mini 4k: fused qkv_proj and gate_up_proj, window 2047",
           "phi-3-mini-4k", **_PHI3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
           num_attention_heads=32, num_key_value_heads=32),
    _llama("gemma2", "google/gemma-2-2b", "Gemma 2 2B: soft-capping, alternating sliding (4096) and global layers, "
           "pre- and post-norms, GeGLU", "gemma-2-2b", "google/gemma-2-2b-it", **_GEMMA2, hidden_size=2304,
           intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
           query_pre_attn_scalar=256),
    _llama("gemma-2-9b", "google/gemma-2-9b", "Gemma 2 9B", "google/gemma-2-9b-it", **_GEMMA2, hidden_size=3584,
           intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
           query_pre_attn_scalar=256),
    _llama("gemma3_text", "google/gemma-3-1b-pt", "Gemma 3 1B (text): QK-norm, sliding (512) and global layers 5:1 "
           "with their own rotary bases", "gemma-3-1b", "google/gemma-3-1b-it", model_type="gemma3_text",
           vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
           num_key_value_heads=1, head_dim=256, hidden_act="gelu_pytorch_tanh", max_position_embeddings=32768,
           rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=512,
           tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
           rope_parameters={"full_attention": _rope(1000000.0), "sliding_attention": _rope(10000.0)}),
)

def _shallow(cfg: dict) -> dict:
    """One block (per-layer settings: the first block's), a 512-token vocabulary without the token
    ids past it (rotary: no position table to shrink)."""
    per_layer = {k: tuple(cfg[k][:1]) for k in ("layer_types", "no_rope_layers") if cfg.get(k) is not None}
    ids = {k: None for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if any(i >= 512 for i in (cfg.get(k) if isinstance(cfg.get(k), tuple) else (cfg.get(k) or 0,)))}
    return {**cfg, "num_hidden_layers": 1, "vocab_size": 512, **per_layer, **ids}


# Sizes that replace a variant's: its per-layer lists, head width and token ids must go with them
# (every layout's other settings, windows, caps, QK-norm, stay).
_RESIZED = dict(head_dim=None, layer_types=None, no_rope_layers=None, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
# The CPU benchmark's Llama: 4 layers x 256 wide, 8 query heads sharing 2 key/value heads, SwiGLU 8/3 wide.
_LLAMA_SMALL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=680, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=32000, **_RESIZED)

LLAMA_SPEC = ModelSpec(
    family="llama",
    task=CAUSAL_LM,
    model=LlamaForCausalLM,
    variants=LLAMA_VARIANTS,
    converters=(LLAMA,),
    tiny=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, **_RESIZED),
    original=Original(hf_llama, "transformers' causal LM of the config's layout (LlamaForCausalLM, Qwen3ForCausalLM, "
                                "Gemma2ForCausalLM ...; eager attention)",
                      "attention_dropout", users=hf_as_users_run_it),
    shallow=lambda cfg: _shallow(cfg),
    refused={name: f"a mixture of experts ({field}): fastzoo's decoders are dense" for name, field in (
        ("qwen3_moe", "num_experts"), ("qwen2_moe", "num_experts"), ("mixtral", "num_local_experts"),
        ("olmoe", "num_experts"), ("granitemoe", "num_local_experts"))},
    flops=llama_flops,
    bench=BenchSettings(
        variant="llama", library="HF", peer_attention="sdpa", compile=False,
        sizes={"bench": Workload("Llama 4x256 GQA 8/2, 8 seqs of 16-1024 tokens (median 128)", _LLAMA_SMALL, batch=8,
                                 max_len=1024, median_len=128),
               "tour": Workload("Llama 4x256 GQA 8/2, 8 seqs of 16-512 tokens (median 64)", _LLAMA_SMALL, batch=8,
                                max_len=512, median_len=64),
               "quick": Workload("tiny Llama", dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2, **_RESIZED), batch=4, max_len=32)}),
)
SPECS = (GPT2_SPEC, LLAMA_SPEC)
