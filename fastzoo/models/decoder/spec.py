"""The decoder families as the rest of fastzoo reads them (GPT-2; the Llama layouts: Llama, Qwen2,
Mistral): variants, converters, tiny configs, the originals, FLOP counts."""
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
    """transformers' default attention: SDPA."""
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
    original=Original(hf_gpt2, "transformers GPT2LMHeadModel (eager attention)", "attn_pdrop"),
    shallow=lambda cfg: {**cfg, "n_layer": 1, "vocab_size": 512, "n_positions": 64},
    flops=gpt2_flops,
    bench=BenchSettings(
        variant="gpt2", library="HF", peer=hf_as_users_run_it, peer_attention="sdpa", compile=False,
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


def _llama(name: str, hf: str, what: str, **config) -> Variant:
    return Variant(name, config, f"{what}, as transformers' {LLAMA_LAYOUTS[config['model_type']]} ({hf})",
                   f"transformers {LLAMA_LAYOUTS[config['model_type']]} ({hf})")


# The CPU benchmark's Llama: 4 layers x 256 wide, 8 query heads sharing 2 key/value heads, SwiGLU 8/3 wide.
_LLAMA_SMALL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=680, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=32000)

LLAMA_SPEC = ModelSpec(
    family="llama",
    task=CAUSAL_LM,
    model=LlamaForCausalLM,
    variants=(
        _llama("llama", "meta-llama/Llama-3.2-1B", "Llama 3.2 1B: grouped-query attention, llama3 rotary, tied head",
               model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
               rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
               rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=8192)),
        _llama("qwen2", "Qwen/Qwen2-0.5B", "Qwen2 0.5B: q/k/v biases, grouped-query attention, tied head",
               model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-6,
               tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
               rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        _llama("mistral", "mistralai/Mistral-7B-v0.1", "Mistral 7B: sliding-window attention (4096), grouped-query",
               model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
               sliding_window=4096, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
    converters=(LLAMA,),
    tiny=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64),
    original=Original(hf_llama, "transformers LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM (eager attention)",
                      "attention_dropout"),
    shallow=lambda cfg: {**cfg, "num_hidden_layers": 1, "vocab_size": 512},  # rotary: no position table to shrink
    flops=llama_flops,
    bench=BenchSettings(
        variant="llama", library="HF", peer=hf_as_users_run_it, peer_attention="sdpa", compile=False,
        sizes={"bench": Workload("Llama 4x256 GQA 8/2, 8 seqs of 16-1024 tokens (median 128)", _LLAMA_SMALL, batch=8,
                                 max_len=1024, median_len=128),
               "tour": Workload("Llama 4x256 GQA 8/2, 8 seqs of 16-512 tokens (median 64)", _LLAMA_SMALL, batch=8,
                                max_len=512, median_len=64),
               "quick": Workload("tiny Llama", dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2), batch=4, max_len=32)}),
)
SPECS = (GPT2_SPEC, LLAMA_SPEC)
