"""Decoder configs: Hugging Face's field names and defaults (``GPT2Config``; the configs of the
Llama-style layouts, ``LlamaConfig``, ``Qwen2Config``, ``MistralConfig``, ``Qwen3Config``,
``Olmo2Config``, ``GraniteConfig``, ``SmolLM3Config``, ``Phi3Config``, ``Gemma2Config`` and
``Gemma3TextConfig``, as one config whose ``model_type`` picks the layout)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fastzoo.errors import ConfigError
from fastzoo.layers.rotary import REQUIRED, ROPE_TYPES
from fastzoo.models.decoder.layouts import LAYOUTS as LAYOUT_TABLE
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide


# the activations (HF ACT2FN names) the decoders take, from the one table in fastzoo.layers.activations
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu")


@dataclass
class GPT2Config(ModelConfig):
    """HF ``GPT2Config`` field names and defaults: the fields that change the function, then
    the token ids and cache default that ``generate`` reads (they change no weight); each
    field's kind, meaning and constraint is declared with it."""

    vocab_size: int = weights_decide(50257, "tokens in the vocabulary", ge=1)
    n_positions: int = weights_decide(1024, "longest sequence (learned position embeddings)", ge=1)
    n_embd: int = weights_decide(768, "width D", ge=1, multiple_of="n_head")
    n_layer: int = weights_decide(12, "transformer blocks", ge=1, le=MAX_BLOCKS)
    n_head: int = changes_function(12, "attention heads", ge=1)
    n_inner: int | None = weights_decide(None, "MLP hidden width; None: 4 * n_embd", ge=1,
                                         compare=lambda c: c.n_inner or 4 * c.n_embd)
    activation_function: str = changes_function("gelu_new", "MLP activation (HF ACT2FN name)", choices=HF_ACTIVATIONS)
    resid_pdrop: float = free(0.1, "dropout after the attention and MLP projections", ge=0, le=1)
    embd_pdrop: float = free(0.1, "dropout after the embeddings", ge=0, le=1)
    attn_pdrop: float = free(0.1, "attention dropout", ge=0, le=1)
    layer_norm_epsilon: float = changes_function(1e-5, "LayerNorm epsilon", gt=0)
    initializer_range: float = free(0.02, "std of the initial weights", ge=0)
    scale_attn_weights: bool = changes_function(True, "scale attention scores by 1/sqrt(head dim)")
    scale_attn_by_inverse_layer_idx: bool = changes_function(False, "also scale them by 1/(layer index + 1)")
    bos_token_id: int | None = free(50256, "beginning-of-text token id (generate)", ge=0)
    eos_token_id: int | None = free(50256, "end-of-text token id (generate)", ge=0)
    pad_token_id: int | None = free(None, "padding token id (generate)", ge=0)
    use_cache: bool = free(True, "eval forwards return past_key_values unless told otherwise (HF's default)")
    output_hidden_states: bool = free(False, "forwards return every layer's hidden states unless told otherwise (HF's)")
    gradient_checkpointing: bool = free(False, "transformers' legacy field: the model is built with gradient "
                                               "checkpointing on (as gradient_checkpointing_enable())")

    # what code written for transformers reads of any model's config (not fields: fixed here)
    is_encoder_decoder = False
    sub_configs = {}  # no vision / audio sub-models (transformers' composite configs have some)
    # transformers' GPT2Config.attribute_map: the common names code written for any model reads
    hidden_size = property(lambda self: self.n_embd)
    num_attention_heads = property(lambda self: self.n_head)
    num_hidden_layers = property(lambda self: self.n_layer)
    max_position_embeddings = property(lambda self: self.n_positions)

    def get_text_config(self, decoder=None, encoder=None) -> "GPT2Config":
        """transformers' ``PretrainedConfig.get_text_config``: a text-only model's is itself."""
        return self


LAYOUTS = tuple(LAYOUT_TABLE)
LAYER_TYPES = ("full_attention", "sliding_attention")


def _is_per_type(rope) -> bool:
    """``rope_parameters`` given per layer type (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``)."""
    return isinstance(rope, dict) and bool(rope) and all(k in LAYER_TYPES and isinstance(v, dict) for k, v in rope.items())


@dataclass
class LlamaConfig(ModelConfig):
    """Hugging Face's configs of the Llama-style layouts as one: ``model_type`` says which (as in
    their config.json; :mod:`fastzoo.models.decoder.layouts` declares what each changes). Field
    names and defaults are transformers' (Llama's where they differ); a field of one layout only
    (Granite's multipliers, Gemma's soft-capping...) keeps its neutral default in the others.
    Rotary settings are transformers' v5 ``rope_parameters`` (per layer type for Gemma 3)."""

    model_type: str = changes_function("llama", "the Hugging Face layout: " + ", ".join(LAYOUTS), choices=LAYOUTS)
    vocab_size: int = weights_decide(32000, "tokens in the vocabulary", ge=1)
    hidden_size: int = weights_decide(4096, "width D (transformers' configs: a multiple of the query heads, head_dim given or not)", ge=1,
                                      multiple_of="num_attention_heads")
    intermediate_size: int = weights_decide(11008, "gated MLP hidden width", ge=1)
    num_hidden_layers: int = weights_decide(32, "decoder blocks", ge=1, le=MAX_BLOCKS)
    num_attention_heads: int = changes_function(32, "query heads (a multiple of the key/value heads)", ge=1,
                                                multiple_of="num_key_value_heads")
    num_key_value_heads: int | None = changes_function(
        None, "key/value heads (grouped-query attention); None: num_attention_heads",
        ge=1, compare=lambda c: c.kv_heads)
    head_dim: int | None = changes_function(None, "width of a head; None: hidden_size // num_attention_heads", ge=2,
                                            compare=lambda c: c.head_size)
    hidden_act: str = changes_function("silu", "gated MLP activation (HF ACT2FN name; Gemma's hidden_activation)",
                                       choices=HF_ACTIVATIONS)
    max_position_embeddings: int = changes_function(
        2048, "context length the rotary schedule is set for (dynamic / yarn / longrope read it); longer inputs run",
        ge=1)
    rms_norm_eps: float = changes_function(1e-6, "RMSNorm epsilon", gt=0)
    rope_parameters: dict | None = changes_function(
        None, "transformers' rope_parameters: rope_type (default, linear, dynamic, llama3, yarn, longrope), rope_theta "
              "and the type's fields, or one such dict per layer type (gemma3_text); None: default with rope_theta 10000",
        compare=lambda c: c.rope)
    attention_bias: bool = weights_decide(False, "biases on q/k/v/o_proj (llama, qwen3, olmo2, granite, smollm3, gemma); "
                                                 "qwen2 always has q/k/v biases")
    mlp_bias: bool = weights_decide(False, "biases on gate/up/down_proj (llama, granite, smollm3)")
    tie_word_embeddings: bool = weights_decide(False, "the LM head is the token embedding")
    sliding_window: int | None = changes_function(
        None, "attention window of sliding layers: a query sees itself and the sliding_window - 1 keys before it", ge=1)
    layer_types: tuple[str, ...] | None = changes_function(
        None, "per layer full_attention or sliding_attention (qwen2's max_window_layers, gemma's alternation); None: "
              "gemma's alternation as transformers derives it, else every layer sliding if sliding_window is set, else full",
        compare=lambda c: tuple(c.layer_kind(i) for i in range(c.num_hidden_layers)))
    no_rope_layers: tuple[int, ...] | None = changes_function(
        None, "smollm3: per layer 1 (rotary embeddings) or 0 (none); None: rotary on every layer")
    embedding_multiplier: float = changes_function(1.0, "granite: token embeddings are multiplied by it", gt=0)
    residual_multiplier: float = changes_function(1.0, "granite: each block's attention and MLP outputs are "
                                                       "multiplied by it before the residual sum", gt=0)
    attention_multiplier: float | None = changes_function(
        None, "granite: the attention scores' scale; None: 1/sqrt(head_dim)", gt=0)
    logits_scaling: float = changes_function(1.0, "granite: the logits are divided by it", gt=0)
    query_pre_attn_scalar: int | None = changes_function(
        None, "gemma: the attention scores' scale is query_pre_attn_scalar^-0.5; None: head_dim", gt=0)
    attn_logit_softcapping: float | None = changes_function(
        None, "gemma2: attention scores soft-capped, cap * tanh(score / cap); None: not capped", gt=0)
    final_logit_softcapping: float | None = changes_function(
        None, "gemma: logits soft-capped, cap * tanh(logit / cap) (inside the fused loss too); None: not capped", gt=0)
    attention_dropout: float = free(0.0, "attention dropout", ge=0, le=1)
    initializer_range: float = free(0.02, "std of the initial weights", ge=0)
    bos_token_id: int | None = free(1, "beginning-of-text token id (generate)", ge=0)
    eos_token_id: int | tuple[int, ...] | None = free(2, "end-of-text token id(s) (generate)", ge=0)
    pad_token_id: int | None = free(None, "padding token id (generate)", ge=0)
    use_cache: bool = free(True, "eval forwards return past_key_values unless told otherwise (HF's default)")
    output_hidden_states: bool = free(False, "forwards return every layer's hidden states unless told otherwise (HF's)")
    gradient_checkpointing: bool = free(False, "transformers' legacy field: the model is built with gradient "
                                               "checkpointing on (as gradient_checkpointing_enable())")

    is_encoder_decoder = False
    sub_configs = {}  # no vision / audio sub-models (transformers' composite configs have some)

    def get_text_config(self, decoder=None, encoder=None) -> "TextConfigView":
        """transformers' ``PretrainedConfig.get_text_config``: a text-only model's is itself, as the code
        that asks reads it (:class:`TextConfigView`: ``head_dim`` the head width)."""
        return TextConfigView(self)

    # -- what the fields mean together --------------------------------------------------------
    @property
    def layout(self):
        """What this layout changes (:class:`~fastzoo.models.decoder.layouts.Layout`)."""
        return LAYOUT_TABLE[self.model_type]

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.layout.qkv_bias

    @property
    def attention_scale(self) -> float:
        """What q k^T is multiplied by: Granite's attention_multiplier, Gemma's query_pre_attn_scalar^-0.5,
        else 1/sqrt(head_dim)."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_size) ** -0.5

    @property
    def rope(self) -> dict:
        """``rope_parameters`` with transformers' defaults filled in (rope_type, rope_theta); per layer
        type ({kind: parameters}) where the layout gives each kind its own."""
        if _is_per_type(self.rope_parameters):
            return {kind: self._filled(p) for kind, p in sorted(self.rope_parameters.items())}
        return self._filled(self.rope_parameters or {})

    def _filled(self, given: dict) -> dict:
        rope = {"rope_type": "default", "rope_theta": 10000.0, **given}
        if rope["rope_type"] in ("llama3", "yarn", "longrope"):
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return rope

    def rope_of(self, layer: int) -> dict | None:
        """The rotary parameters of block ``layer`` (None: no rotary embeddings there, smollm3)."""
        if self.no_rope_layers is not None and not self.no_rope_layers[layer]:
            return None
        rope = self.rope
        return rope[self.layer_kind(layer)] if _is_per_type(self.rope_parameters) else rope

    def layer_kind(self, layer: int) -> str:
        """``full_attention`` or ``sliding_attention`` (transformers' layer_types entry)."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "sliding_attention" if self.sliding_window is not None and self.layout.windows != "none" else "full_attention"

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block ``layer`` (None: it attends to every earlier key)."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.layer_kind(layer) == "sliding_attention" else None

    def validate(self):
        layout = self.layout
        if self.layer_types is None and layout.global_every:  # transformers' Gemma configs derive them so
            self.layer_types = tuple("full_attention" if (i + 1) % layout.global_every == 0 else "sliding_attention"
                                     for i in range(self.num_hidden_layers))
        if self.head_size % 2:
            raise ConfigError(f"head_dim={self.head_size}: rotary embeddings rotate pairs, the head width must be even",
                              fields=("head_dim",))
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        own = {name for lay in LAYOUT_TABLE.values() for name in lay.fields}
        for name in sorted(own - set(layout.fields)):
            if getattr(self, name) != defaults[name]:
                having = ", ".join(t for t, lay in LAYOUT_TABLE.items() if name in lay.fields)
                raise ConfigError(f"{name}={getattr(self, name)!r}: the {self.model_type} layout has no such setting "
                                  f"(layouts with {name}: {having})", fields=(name, "model_type"))
        if layout.windows == "none" and self.sliding_window is not None:
            raise ConfigError(f"sliding_window: the {self.model_type} layout attends to every earlier key; layouts with "
                              "sliding windows: " + ", ".join(t for t, lay in LAYOUT_TABLE.items() if lay.windows != "none"),
                              fields=("sliding_window", "model_type"))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ConfigError(f"layer_types={list(self.layer_types)}: one of {', '.join(LAYER_TYPES)} per layer "
                                  f"({self.num_hidden_layers})", fields=("layer_types",))
            if layout.windows != "layer_types":
                raise ConfigError(f"layer_types: the {self.model_type} layout has the same attention on every layer "
                                  "(layouts with per-layer windows: " + ", ".join(
                                      t for t, lay in LAYOUT_TABLE.items() if lay.windows == "layer_types") + ")",
                                  fields=("layer_types", "model_type"))
            sliding = [i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention"]
            if sliding and self.sliding_window is None and not layout.window_required:
                raise ConfigError(f"sliding_window=None with sliding_attention layers ({', '.join(map(str, sliding))} in "
                                  "layer_types): a sliding layer needs its window (transformers refuses such a config "
                                  "at its first forward); set sliding_window, or make those layers full_attention",
                                  fields=("sliding_window", "layer_types"))
        if layout.window_required and self.sliding_window is None:
            raise ConfigError(f"sliding_window=None: transformers' {self.model_type} builds its sliding-window mask on every "
                              "forward and refuses a config without a window, sliding layers or not; set sliding_window "
                              "(layer_types says which layers slide)", fields=("sliding_window", "model_type"))
        if self.no_rope_layers is not None and (len(self.no_rope_layers) != self.num_hidden_layers
                                                or not set(self.no_rope_layers) <= {0, 1}):
            raise ConfigError(f"no_rope_layers={list(self.no_rope_layers)}: 1 (rotary) or 0 (none) per layer "
                              f"({self.num_hidden_layers})", fields=("no_rope_layers",))
        given = self.rope_parameters
        if given is not None and not isinstance(given, dict):
            raise ConfigError(f"rope_parameters={given!r}: a dict (transformers' rope_parameters)", fields=("rope_parameters",))
        if _is_per_type(given):
            if self.model_type != "gemma3_text":
                raise ConfigError(f"rope_parameters per layer type ({', '.join(given)}): the {self.model_type} layout "
                                  "has one rotary schedule for every layer (gemma3_text has one per layer type)",
                                  fields=("rope_parameters",))
            kinds = {self.layer_kind(i) for i in range(self.num_hidden_layers)}
            if not kinds <= set(given):
                raise ConfigError(f"rope_parameters: no parameters for {', '.join(sorted(kinds - set(given)))} layers",
                                  fields=("rope_parameters",))
            for p in given.values():
                self._check_rope(p)
        else:
            self._check_rope(given or {})

    def _check_rope(self, rope: dict):
        kind = rope.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ConfigError(f"rope_parameters: rope_type={kind!r} is not one fastzoo computes ({', '.join(ROPE_TYPES)})",
                              fields=("rope_parameters",))
        if self.model_type == "phi3" and kind not in ("default", "longrope"):  # transformers' Phi3Config refuses the rest
            raise ConfigError(f"rope_parameters: rope_type={kind!r}: the phi3 layout takes 'default' or 'longrope'",
                              fields=("rope_parameters",))
        filled = self._filled(rope)
        missing = [k for k in REQUIRED[kind] if k not in filled]
        if missing:
            raise ConfigError(f"rope_parameters: rope_type={kind!r} needs {', '.join(missing)}", fields=("rope_parameters",))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"rope_parameters: partial_rotary_factor={rope['partial_rotary_factor']}: this layout "
                              "rotates the whole head (1.0)", fields=("rope_parameters",))
        if kind == "longrope" and any(len(filled[k]) != self.head_size // 2 for k in ("short_factor", "long_factor")):
            raise ConfigError(f"rope_parameters: longrope's short_factor and long_factor need head_dim / 2 = "
                              f"{self.head_size // 2} values each", fields=("rope_parameters",))


class TextConfigView:
    """A :class:`LlamaConfig` as transformers' text configs read: ``head_dim`` is the head width, never
    None (what transformers' caches and tests size the key/value cache by: ``getattr(config,
    "head_dim", hidden_size // num_attention_heads)``); every other attribute, read or set, is the
    config's own. The config keeps ``head_dim=None`` for the default, so that a config made with another
    hidden_size or head count never carries a stale head width."""

    __slots__ = ("config",)

    def __init__(self, config: LlamaConfig):
        object.__setattr__(self, "config", config)

    def __getattr__(self, name: str):
        return self.config.head_size if name == "head_dim" else getattr(self.config, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.config, name, value)
