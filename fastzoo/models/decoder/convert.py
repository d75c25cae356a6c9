"""Hugging Face ``transformers`` checkpoints.

GPT-2: fastzoo's module names are HF's, so conversion is (1) adding/stripping the
``transformer.`` prefix (``GPT2Model`` checkpoints have none), (2) transposing the four
``Conv1D`` weights (HF stores ``[in, out]``; ``nn.Linear`` ``[out, in]``), (3) dropping the
causal-mask buffers old checkpoints carry (``attn.bias``, ``attn.masked_bias``), and
(4) the tied LM head: taken from ``wte`` when absent, refused when present and different.

The Llama-style layouts (Llama, Qwen2, Mistral, Qwen3, OLMo 2, Granite, SmolLM3, Phi-3, Gemma 2,
Gemma 3): the names are transformers' as they are (Phi-3's fused projections loaded fused); their
configs are read through transformers' own config classes (:func:`hf_to_fields`) and written
back with them (:func:`hf_config`).
"""
from __future__ import annotations

import dataclasses
import re

import torch

from fastzoo.errors import CheckpointError
from fastzoo.models.decoder.config import GPT2Config, LlamaConfig
from fastzoo.models.decoder.layouts import LAYOUTS as LAYOUT_TABLE
from fastzoo.models.spec import SameKeys

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


class _FastzooGPT2(SameKeys):
    """fastzoo's own GPT-2 keys (``nn.Linear`` orientation), e.g. ``model.state_dict()``."""

    format = "fastzoo"

    @staticmethod
    def matches(state: dict) -> bool:
        w = state.get("transformer.h.0.attn.c_attn.weight")
        return w is not None and w.ndim == 2 and w.shape[0] == 3 * w.shape[1]

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return _infer(state, c_attn_transposed=False)


GPT2 = _HfGPT2()
GPT2_FASTZOO = _FastzooGPT2()


# -- the Llama-style layouts --------------------------------------------------------------------
LLAMA_LAYOUTS = {name: layout.hf_class for name, layout in LAYOUT_TABLE.items()}
_ROTARY_BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # older checkpoints saved the frequencies
# config.json fields of architectures fastzoo's Llama does not compute, each refused by name:
# what the field means, and when it is set (value -> True: fastzoo cannot reproduce it)
_NOT_REPRODUCED = {
    "num_experts": ("a mixture of experts", lambda v: bool(v)),
    "num_local_experts": ("a mixture of experts", lambda v: bool(v)),
    "n_routed_experts": ("a mixture of experts", lambda v: bool(v)),
    "moe_intermediate_size": ("a mixture of experts", lambda v: bool(v)),
    "num_experts_per_tok": ("a mixture of experts", lambda v: bool(v)),
    "add_cross_attention": ("cross-attention", lambda v: bool(v)),
    "cross_attention_layers": ("cross-attention", lambda v: bool(v)),
    "is_encoder_decoder": ("an encoder-decoder", lambda v: bool(v)),
    "vision_config": ("a multimodal model (vision tower)", lambda v: v is not None),
    "audio_config": ("a multimodal model (audio tower)", lambda v: v is not None),
    "text_config": ("a multimodal model (its text model is nested under text_config)", lambda v: v is not None),
    "image_token_id": ("a multimodal model (image tokens)", lambda v: v is not None),
    "image_token_index": ("a multimodal model (image tokens)", lambda v: v is not None),
    "resid_pdrop": ("dropout on the residual branches (phi3)", lambda v: bool(v)),
    "embd_pdrop": ("dropout on the embeddings (phi3)", lambda v: bool(v)),
}


def _llama_infer(state: dict) -> dict:
    """Sizes the weights fix, and the layout where the keys show it (Phi-3's fused projections,
    OLMo 2's norms after the blocks, Gemma's four norms, QK-norm per head or over all heads);
    heads and head width come from config.json or the variant. Llama, Granite and SmolLM3 have
    the same keys: a bare state dict of the latter two needs ``model_type=``."""
    layers = {int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    vocab, hidden = state["model.embed_tokens.weight"].shape
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    fused = attn + "qkv_proj.weight" in state
    q_bias, o_bias = attn + "q_proj.bias" in state, attn + "o_proj.bias" in state
    head = state.get("lm_head.weight")
    out = {
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": len(layers),
        "intermediate_size": (state[mlp + "gate_up_proj.weight"].shape[0] // 2 if fused
                              else state[mlp + "gate_proj.weight"].shape[0]),
        "tie_word_embeddings": head is None or head is state["model.embed_tokens.weight"]
        or torch.equal(head, state["model.embed_tokens.weight"]),
    }
    q_norm = state.get(attn + "q_norm.weight")
    if fused:
        out["model_type"] = "phi3"
    elif "model.layers.0.pre_feedforward_layernorm.weight" in state:
        out["model_type"] = "gemma3_text" if q_norm is not None else "gemma2"
    elif "model.layers.0.post_feedforward_layernorm.weight" in state:
        out["model_type"] = "olmo2"
    elif q_norm is not None:
        out["model_type"] = "qwen3"
    elif q_bias and not o_bias:
        out["model_type"] = "qwen2"
    if out.get("model_type") in (None, "qwen3", "olmo2", "gemma2", "gemma3_text"):
        out["attention_bias"] = o_bias
    if out.get("model_type") is None:
        out["mlp_bias"] = mlp + "gate_proj.bias" in state
    return out


class _HfLlama(SameKeys):
    """transformers' causal LMs of the Llama-style layouts (``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
    ``Gemma2ForCausalLM`` ...): fastzoo's module names are theirs, so conversion is the identity but
    for the tied head (stored once) and the rotary frequencies older checkpoints carry (recomputed,
    dropped)."""

    format = "hf"

    @staticmethod
    def matches(state: dict) -> bool:
        return "model.embed_tokens.weight" in state and any(
            f"model.layers.0.self_attn.{p}.weight" in state for p in ("q_proj", "qkv_proj"))

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        return {k: v for k, v in state.items() if not _ROTARY_BUFFERS.search(k)}

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return _llama_infer(state)

    @staticmethod
    def config_from_json(cfg: dict) -> dict:
        """fastzoo config fields from a transformers config (config.json or a live model's): read
        through transformers' own config class for its ``model_type``, so its defaults and its
        normalisation (``rope_scaling`` / ``rope_theta`` -> ``rope_parameters``, ``layer_types``)
        are transformers'. A field fastzoo cannot reproduce (a mixture of experts...) is refused by name."""
        for name, (what, is_set) in _NOT_REPRODUCED.items():
            if name in cfg and is_set(cfg[name]):
                raise CheckpointError(f"config.json sets {name}={cfg[name]!r}: {what}, which fastzoo's decoders do not "
                                      "reproduce (a dense decoder only)")
        model_type = cfg.get("model_type", "llama")
        if model_type not in LLAMA_LAYOUTS:
            raise CheckpointError(f"config.json has model_type={model_type!r}; fastzoo's Llama-style decoders read "
                                  f"{', '.join(map(repr, LLAMA_LAYOUTS))} configs")
        from transformers import AutoConfig

        hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("transformers_version", "architectures")})
        return hf_to_fields(hf)


_OWN_FIELDS = {name for layout in LAYOUT_TABLE.values() for name in layout.fields}
_READ_APART = ("model_type", "hidden_act", "layer_types", "sliding_window", "rope_parameters", "no_rope_layers",
               "attention_multiplier", "query_pre_attn_scalar")


def hf_to_fields(hf) -> dict:
    """fastzoo LlamaConfig fields of a transformers config of one of the layouts (``LlamaConfig``,
    ``Qwen3Config``, ``Gemma3TextConfig`` ...)."""
    model_type = hf.model_type
    layout = LAYOUT_TABLE[model_type]
    for name, why in layout.refused:
        if getattr(hf, name, None):
            raise CheckpointError(f"config.json sets {name}={getattr(hf, name)!r}: {why}, which fastzoo's "
                                  f"{model_type} does not reproduce")
    fields = {f.name: getattr(hf, f.name) for f in dataclasses.fields(LlamaConfig)
              if f.name not in _READ_APART and (f.name not in _OWN_FIELDS or f.name in layout.fields) and hasattr(hf, f.name)}
    fields.update(model_type=model_type, hidden_act=getattr(hf, layout.act_field), rope_parameters=_rope_of(hf),
                  sliding_window=None, layer_types=None)
    # the window transformers' sliding mask reads (qwen2 / qwen3 drop it without use_sliding_window; smollm3's
    # eager and sdpa masks slide its sliding layers whatever use_sliding_window says)
    window = getattr(hf, "sliding_window", None)
    if layout.windows == "all":
        fields["sliding_window"] = window
    elif layout.windows == "layer_types":
        kinds = list(hf.layer_types or [])
        sliding = "sliding_attention" in kinds
        if (sliding or layout.window_required) and window is not None:
            fields["sliding_window"] = window
        per_type_rope = isinstance(fields["rope_parameters"], dict) and "full_attention" in fields["rope_parameters"]
        windowed = fields["sliding_window"] is not None and "full_attention" in kinds  # None: every layer slides
        unwindowed = sliding and window is None  # kept, so that the config refuses it as transformers' forward does
        if windowed or unwindowed or len(set(kinds)) > 1 and per_type_rope:
            fields["layer_types"] = tuple(kinds)
    if model_type == "smollm3":  # stated either way: a variant's own list must not outlive another depth
        fields["no_rope_layers"] = None if all(hf.no_rope_layers) else tuple(hf.no_rope_layers)
    if model_type == "granite":
        fields["attention_multiplier"] = hf.attention_multiplier
    if layout.embed_scale:  # gemma
        fields["query_pre_attn_scalar"] = hf.query_pre_attn_scalar
    head_dim = getattr(hf, "head_dim", None)
    fields["head_dim"] = head_dim if head_dim and head_dim != hf.hidden_size // hf.num_attention_heads else None
    return fields


def _rope_of(hf) -> dict:
    """transformers' ``rope_parameters`` (per layer type where every value is a layout's own schedule)."""
    rope = dict(hf.rope_parameters or {})
    if any(isinstance(v, dict) for v in rope.values()):
        if hf.model_type != "gemma3_text":
            raise CheckpointError(f"config.json: rope_parameters per layer type ({', '.join(rope)}): fastzoo's "
                                  f"{hf.model_type} has one rotary schedule for every layer")
        return {kind: {k: v for k, v in p.items() if k != "type"} for kind, p in rope.items()}
    return {k: v for k, v in rope.items() if k != "type"}


def hf_config(cfg: LlamaConfig):
    """A fastzoo :class:`LlamaConfig` as transformers' config of its layout (what its
    ``from_pretrained`` and ``generate`` read)."""
    from transformers import AutoConfig

    layout = cfg.layout
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    rope = cfg.rope
    fields = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads, layout.act_field: cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": dict(rope), "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id, "use_cache": cfg.use_cache,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        "output_hidden_states": cfg.output_hidden_states,
        **{name: getattr(cfg, name) for name in layout.fields},
    }
    if cfg.model_type in ("llama", "mistral", "qwen3", "granite", "gemma2", "gemma3_text"):
        fields["head_dim"] = cfg.head_size
    if layout.windows == "all":
        fields["sliding_window"] = cfg.sliding_window
    if layout.windows == "layer_types":
        sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
        fields.update(sliding_window=cfg.sliding_window, layer_types=kinds)
        if cfg.model_type in ("qwen2", "qwen3", "smollm3"):
            fields["use_sliding_window"] = cfg.sliding_window is not None and bool(sliding)
        if cfg.model_type in ("qwen2", "qwen3"):
            fields["max_window_layers"] = sliding[0] if sliding else cfg.num_hidden_layers
    if cfg.model_type == "smollm3":
        fields["no_rope_layers"] = list(cfg.no_rope_layers or [1] * cfg.num_hidden_layers)
    if cfg.model_type == "granite":
        fields["attention_multiplier"] = cfg.attention_scale
    if layout.embed_scale:  # gemma
        fields["query_pre_attn_scalar"] = cfg.query_pre_attn_scalar or cfg.head_size
    if cfg.model_type == "gemma3_text" and "full_attention" not in rope:  # one schedule: both kinds get it
        fields["rope_parameters"] = {kind: dict(rope) for kind in ("full_attention", "sliding_attention")}
    hf = AutoConfig.for_model(cfg.model_type, **fields)
    if cfg.head_size != cfg.hidden_size // cfg.num_attention_heads and "head_dim" not in fields:
        hf.head_dim = cfg.head_size  # no such field (Qwen2, OLMo 2, SmolLM3, Phi-3): their attention reads it when set
    return hf


LLAMA = _HfLlama()
