"""GPT-2 config: Hugging Face ``GPT2Config``'s field names and defaults."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import nn

from fastzoo.errors import ConfigError
from fastzoo.models.config import MAX_BLOCKS, ModelConfig, changes_function, free, weights_decide


# HF ACT2FN names -> the activation module. "gelu_new" is OpenAI's tanh approximation.
ACTIVATIONS = {
    "gelu_new": partial(nn.GELU, approximate="tanh"),
    "gelu_pytorch_tanh": partial(nn.GELU, approximate="tanh"),
    "gelu": nn.GELU,
    "relu": nn.ReLU,
}


@dataclass
class GPT2Config(ModelConfig):
    """HF ``GPT2Config`` field names and defaults: the fields that change the function, then
    the token ids and cache default that ``generate`` reads (they change no weight); each
    field's kind, meaning and constraint is declared with it."""

    vocab_size: int = weights_decide(50257, "tokens in the vocabulary", ge=1)
    n_positions: int = weights_decide(1024, "longest sequence (learned position embeddings)", ge=1)
    n_embd: int = weights_decide(768, "width D", ge=1)
    n_layer: int = weights_decide(12, "transformer blocks", ge=1, le=MAX_BLOCKS)
    n_head: int = changes_function(12, "attention heads; n_embd must divide by it", ge=1)
    n_inner: int | None = weights_decide(None, "MLP hidden width; None: 4 * n_embd", ge=1,
                                         compare=lambda c: c.n_inner or 4 * c.n_embd)
    activation_function: str = changes_function("gelu_new", "MLP activation (HF ACT2FN name)", choices=tuple(ACTIVATIONS))
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

    # what code written for transformers reads of any model's config (not fields: fixed here)
    is_encoder_decoder = False

    def get_text_config(self, decoder=None, encoder=None) -> "GPT2Config":
        """transformers' ``PretrainedConfig.get_text_config``: a text-only model's is itself."""
        return self

    def validate(self):
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}", fields=("n_embd", "n_head"))
