"""What each Llama-style layout changes, declared once: transformers' ``model_type`` -> its
differences from Llama. The blocks of :mod:`fastzoo.models.decoder.llama` read these flags;
no layout has code of its own.

- ``llama``: pre-norm blocks, RMSNorm, SwiGLU, rotary on every layer (the reference layout).
- ``qwen2``: q/k/v biases; sliding windows on the upper layers (``layer_types``).
- ``mistral``: a sliding window on every layer.
- ``qwen3``: RMSNorm per head on q and k (QK-norm) before rotary; ``head_dim`` apart from hidden / heads.
- ``olmo2``: no pre-norms: RMSNorm after attention and after the MLP (inside the residual),
  QK-norm over all heads' q and k together.
- ``granite``: multipliers on the embedding, the residual branches, the attention scores
  (instead of 1/sqrt(head dim)) and the logits (divided by ``logits_scaling``).
- ``smollm3``: some layers without rotary embeddings (``no_rope_layers``).
- ``phi3``: fused ``qkv_proj`` and ``gate_up_proj`` (kept fused: one matmul each), a window on every layer.
- ``gemma2``: embedding scaled by sqrt(hidden), RMSNorm with (1 + weight), norms before and after
  attention and MLP, GeGLU (gelu-tanh), scores scaled by ``query_pre_attn_scalar``^-0.5 and
  soft-capped, logits soft-capped, sliding and global layers alternating (``layer_types``).
- ``gemma3_text``: Gemma 2's block plus QK-norm per head, separate rotary bases for sliding and
  global layers (``rope_parameters`` per layer type); no attention soft-capping (transformers'
  Gemma 3 does not apply ``attn_logit_softcapping``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    hf_class: str  # transformers' *ForCausalLM class
    qk_norm: str | None = None  # "head": RMSNorm over each head's width; "all": over all heads' q (and k) together
    norms: str = "pre"  # "pre": x + f(norm(x)); "post": x + norm(f(x)); "sandwich": x + norm(f(norm(x)))
    gemma_norm: bool = False  # RMSNorm scaled by (1 + weight), weights start at 0
    weight_in_fp32: bool = False  # the norm's weight applied before casting back (OLMo 2, Gemma), not after (Llama)
    fused: bool = False  # qkv_proj and gate_up_proj (Phi-3)
    embed_scale: bool = False  # token embeddings times sqrt(hidden_size) (Gemma)
    qkv_bias: bool = False  # q/k/v biases always (Qwen2), whatever attention_bias says
    windows: str = "none"  # "none"; "all": every layer (sliding_window); "layer_types": per layer
    window_required: bool = False  # transformers builds the sliding mask on every forward: sliding_window set (Gemma)
    global_every: int | None = None  # layer_types left out: every global_every-th layer full, the others sliding (Gemma)
    fields: tuple[str, ...] = ()  # the config fields only this layout has (others must keep their defaults)
    act_field: str = "hidden_act"  # the config.json name of the MLP activation
    refused: tuple[tuple[str, str], ...] = ()  # (transformers field, why) that fastzoo refuses when set


_GEMMA = dict(norms="sandwich", gemma_norm=True, weight_in_fp32=True, embed_scale=True, windows="layer_types",
              window_required=True, act_field="hidden_activation")
LAYOUTS = {
    "llama": Layout("LlamaForCausalLM", fields=("attention_bias", "mlp_bias")),
    "qwen2": Layout("Qwen2ForCausalLM", qkv_bias=True, windows="layer_types"),
    "mistral": Layout("MistralForCausalLM", windows="all"),
    "qwen3": Layout("Qwen3ForCausalLM", qk_norm="head", windows="layer_types", fields=("attention_bias",)),
    "olmo2": Layout("Olmo2ForCausalLM", qk_norm="all", norms="post", weight_in_fp32=True, fields=("attention_bias",)),
    "granite": Layout("GraniteForCausalLM", fields=("attention_bias", "mlp_bias", "embedding_multiplier",
                                                    "residual_multiplier", "attention_multiplier", "logits_scaling")),
    "smollm3": Layout("SmolLM3ForCausalLM", windows="layer_types", fields=("attention_bias", "mlp_bias", "no_rope_layers")),
    "phi3": Layout("Phi3ForCausalLM", fused=True, windows="all"),
    "gemma2": Layout("Gemma2ForCausalLM", **_GEMMA, global_every=2, fields=(
        "attention_bias", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
        refused=(("use_bidirectional_attention", "bidirectional attention (an encoder)"),)),
    "gemma3_text": Layout("Gemma3ForCausalLM", qk_norm="head", **_GEMMA, global_every=6, fields=(
        "attention_bias", "query_pre_attn_scalar", "final_logit_softcapping"),
        refused=(("use_bidirectional_attention", "bidirectional attention (an encoder)"),
                 ("attn_logit_softcapping", "attention soft-capping, which transformers' Gemma 3 does not apply"))),
}
