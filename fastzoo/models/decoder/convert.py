"""Hugging Face ``transformers`` checkpoints.

GPT-2: fastzoo's module names are HF's, so conversion is (1) adding/stripping the
``transformer.`` prefix (``GPT2Model`` checkpoints have none), (2) transposing the four
``Conv1D`` weights (HF stores ``[in, out]``; ``nn.Linear`` ``[out, in]``), (3) dropping the
causal-mask buffers old checkpoints carry (``attn.bias``, ``attn.masked_bias``), and
(4) the tied LM head: taken from ``wte`` when absent, refused when present and different.

The Llama layouts (Llama, Qwen2, Mistral): the names are transformers' as they are; their
configs are read through transformers' own config classes (:func:`hf_to_fields`) and written
back with them (:func:`hf_config`).
"""
from __future__ import annotations

import dataclasses
import re

import torch

from fastzoo.errors import CheckpointError
from fastzoo.models.decoder.config import GPT2Config, LlamaConfig

_CONV1D = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
_PREFIX = "transformer."
# HF fields that change the function and that fastzoo does not implement: value HF defaults to.
_UNSUPPORTED = {"reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True}


def _c_attn_weight(state: dict) -> torch.Tensor | None:
    return state.get("transformer.h.0.attn.c_attn.weight", state.get("h.0.attn.c_attn.weight"))


def _infer(state: dict, c_attn_transposed: bool) -> dict:
    """Sizes the weights fix. ``n_head`` is not among them: it comes from config.json or the
    model's YAML (pass ``n_head=`` when loading a bare state dict of another size)."""
    strip = {k[len(_PREFIX):] if k.startswith(_PREFIX) else k: v for k, v in state.items()}
    layers = {int(m.group(1)) for k in strip if (m := re.match(r"h\.(\d+)\.", k))}
    vocab, n_embd = strip["wte.weight"].shape
    fc = strip["h.0.mlp.c_fc.weight"].shape
    inner = fc[1] if c_attn_transposed else fc[0]
    return {
        "vocab_size": vocab, "n_embd": n_embd, "n_positions": strip["wpe.weight"].shape[0],
        "n_layer": len(layers), "n_inner": None if inner == 4 * n_embd else inner,
    }


class _HfGPT2:
    format = "hf"

    @staticmethod
    def matches(state: dict) -> bool:
        w = _c_attn_weight(state)
        return w is not None and w.ndim == 2 and w.shape[1] == 3 * w.shape[0]  # Conv1D: [in, 3 * in]

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        out = {}
        for k, v in state.items():
            k = k[len(_PREFIX):] if k.startswith(_PREFIX) else k
            if _BUFFERS.search(k):
                continue
            if k == "lm_head.weight":
                continue
            out[_PREFIX + k] = v.t() if _CONV1D.search(k) else v
        wte = out.get(_PREFIX + "wte.weight")
        head = state.get("lm_head.weight")
        if head is not None and wte is not None and not torch.equal(head, wte):
            raise CheckpointError(
                "lm_head.weight differs from transformer.wte.weight: this checkpoint has an untied LM head, "
                "and fastzoo's GPT-2 ties it to the token embedding (as every GPT-2 checkpoint does)"
            )
        if wte is not None:
            out["lm_head.weight"] = wte
        return out

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        """A state dict that ``transformers.GPT2LMHeadModel.load_state_dict(strict=True)`` takes."""
        out = {}
        for k, v in state.items():
            out[k] = v.t().contiguous() if _CONV1D.search(k) else v
        return out

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return _infer(state, c_attn_transposed=True)

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo config fields from an HF ``config.json``; an absent field takes HF's default, which is
        :class:`GPT2Config`'s (same names, same defaults)."""
        model_type = cfg.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise CheckpointError(f"config.json has model_type={model_type!r}; fastzoo's GPT-2 reads 'gpt2' configs")
        for name, default in _UNSUPPORTED.items():
            if cfg.get(name, default) != default:
                raise CheckpointError(
                    f"config.json sets {name}={cfg[name]!r}, which fastzoo's GPT-2 does not implement (only {default!r})"
                )
        return {f.name: cfg.get(f.name, f.default) for f in dataclasses.fields(GPT2Config)}


class _FastzooGPT2:
    """fastzoo's own GPT-2 keys (``nn.Linear`` orientation), e.g. ``model.state_dict()``."""

    format = "fastzoo"

    @staticmethod
    def matches(state: dict) -> bool:
        w = state.get("transformer.h.0.attn.c_attn.weight")
        return w is not None and w.ndim == 2 and w.shape[0] == 3 * w.shape[1]

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return dict(state)

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        return dict(state)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return _infer(state, c_attn_transposed=False)


GPT2 = _HfGPT2()
GPT2_FASTZOO = _FastzooGPT2()


# -- the Llama layouts (Llama, Qwen2, Mistral) --------------------------------------------------
LLAMA_LAYOUTS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
_ROTARY_BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # older checkpoints saved the frequencies
# config.json fields of architectures fastzoo's Llama does not compute, each refused by name:
# what the field means, and when it is set (value -> True: fastzoo cannot reproduce it)
_NOT_REPRODUCED = {
    "num_experts": ("a mixture of experts", lambda v: bool(v)),
    "num_local_experts": ("a mixture of experts", lambda v: bool(v)),
    "n_routed_experts": ("a mixture of experts", lambda v: bool(v)),
    "moe_intermediate_size": ("a mixture of experts", lambda v: bool(v)),
    "add_cross_attention": ("cross-attention", lambda v: bool(v)),
    "cross_attention_layers": ("cross-attention", lambda v: bool(v)),
    "is_encoder_decoder": ("an encoder-decoder", lambda v: bool(v)),
    "vision_config": ("a multimodal model (vision tower)", lambda v: v is not None),
    "audio_config": ("a multimodal model (audio tower)", lambda v: v is not None),
    "text_config": ("a multimodal model (its text model is nested under text_config)", lambda v: v is not None),
    "image_token_id": ("a multimodal model (image tokens)", lambda v: v is not None),
    "image_token_index": ("a multimodal model (image tokens)", lambda v: v is not None),
}


def _llama_infer(state: dict) -> dict:
    """Sizes the weights fix; heads and head width come from config.json or the variant."""
    layers = {int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    vocab, hidden = state["model.embed_tokens.weight"].shape
    q_bias, o_bias = "model.layers.0.self_attn.q_proj.bias" in state, "model.layers.0.self_attn.o_proj.bias" in state
    head = state.get("lm_head.weight")
    out = {
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": len(layers),
        "intermediate_size": state["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "mlp_bias": "model.layers.0.mlp.gate_proj.bias" in state,
        "tie_word_embeddings": head is None or head is state["model.embed_tokens.weight"]
        or torch.equal(head, state["model.embed_tokens.weight"]),
    }
    if q_bias and not o_bias:
        out.update(model_type="qwen2", attention_bias=False)
    else:
        out["attention_bias"] = o_bias
    return out


class _HfLlama:
    """transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``: fastzoo's
    module names are theirs, so conversion is the identity but for the tied head (stored once)
    and the rotary frequencies older checkpoints carry (recomputed, dropped)."""

    format = "hf"

    @staticmethod
    def matches(state: dict) -> bool:
        return "model.embed_tokens.weight" in state and "model.layers.0.self_attn.q_proj.weight" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return {k: v for k, v in state.items() if not _ROTARY_BUFFERS.search(k)}

    @staticmethod
    def from_fastzoo(state: dict, config) -> dict:
        """A state dict that transformers' ``*ForCausalLM.load_state_dict`` takes."""
        return dict(state)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return _llama_infer(state)

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo config fields from a transformers config (config.json or a live model's): read
        through transformers' own config class for its ``model_type``, so its defaults and its
        normalisation (``rope_scaling`` / ``rope_theta`` -> ``rope_parameters``, Qwen2's
        ``layer_types``) are transformers'. A field fastzoo cannot reproduce is refused by name."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in LLAMA_LAYOUTS:
            raise CheckpointError(f"config.json has model_type={model_type!r}; fastzoo's Llama reads "
                                  f"{', '.join(map(repr, LLAMA_LAYOUTS))} configs")
        for name, (what, is_set) in _NOT_REPRODUCED.items():
            if name in cfg and is_set(cfg[name]):
                raise CheckpointError(f"config.json sets {name}={cfg[name]!r}: {what}, which fastzoo's Llama does not "
                                      "reproduce (a dense decoder only)")
        from transformers import AutoConfig

        hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")})
        return hf_to_fields(hf)


def hf_to_fields(hf) -> dict:
    """fastzoo LlamaConfig fields of a transformers ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig``."""
    model_type = hf.model_type
    rope = {k: v for k, v in dict(hf.rope_parameters or {}).items() if k != "type"}
    if any(isinstance(v, dict) for v in rope.values()):
        raise CheckpointError(f"config.json: rope_parameters per layer type ({', '.join(rope)}): fastzoo's Llama "
                              "has one rotary schedule for every layer")
    fields = {f.name: getattr(hf, f.name) for f in dataclasses.fields(LlamaConfig)
              if f.name not in ("model_type", "layer_types", "sliding_window", "rope_parameters") and hasattr(hf, f.name)}
    fields.update(model_type=model_type, rope_parameters=rope, sliding_window=None, layer_types=None)
    if model_type == "mistral":
        fields["sliding_window"] = hf.sliding_window
    if model_type == "qwen2":
        fields.update(attention_bias=False, mlp_bias=False)
        kinds = list(hf.layer_types) if hf.sliding_window is not None else []
        if "sliding_attention" in kinds:
            fields["sliding_window"] = hf.sliding_window
            if "full_attention" in kinds:
                fields["layer_types"] = tuple(kinds)
    return fields


def hf_config(cfg: LlamaConfig):
    """A fastzoo :class:`LlamaConfig` as transformers' config of its layout (what its
    ``from_pretrained`` and ``generate`` read)."""
    import transformers

    fields = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads, "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": dict(cfg.rope), "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id, "use_cache": cfg.use_cache,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        "output_hidden_states": cfg.output_hidden_states,
    }
    if cfg.model_type == "llama":
        fields.update(head_dim=cfg.head_size, attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
        return transformers.LlamaConfig(**fields)
    if cfg.model_type == "mistral":
        return transformers.MistralConfig(**fields, head_dim=cfg.head_size, sliding_window=cfg.sliding_window)
    kinds = ["sliding_attention" if cfg.window_of(i) else "full_attention" for i in range(cfg.num_hidden_layers)]
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    qwen2 = transformers.Qwen2Config(
        **fields, use_sliding_window=bool(sliding), sliding_window=cfg.sliding_window, layer_types=kinds,
        max_window_layers=sliding[0] if sliding else cfg.num_hidden_layers)
    if cfg.head_dim is not None and cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        qwen2.head_dim = cfg.head_dim  # Qwen2Config has no such field; Qwen2Attention reads it when set
    return qwen2


LLAMA = _HfLlama()
