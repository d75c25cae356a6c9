"""Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models") and the
decoders that share its layout: Qwen2 (q/k/v biases, sliding window on the upper layers) and
Mistral (sliding window on every layer).

Pre-norm blocks with RMSNorm (``input_layernorm`` -> attention -> residual,
``post_attention_layernorm`` -> SwiGLU MLP -> residual), rotary position embeddings on q and
k, grouped-query attention (``num_key_value_heads`` key/value heads shared by the query
heads, handed to the kernel unrepeated), a final RMSNorm and an LM head, tied to the token
embedding or not. Module names are transformers' (``model.layers.N.self_attn.q_proj`` ...),
so HF weights load key for key. What a layout changes is read from its config
(:class:`~fastzoo.models.decoder.config.LlamaConfig`): biases, windows, rotary schedule.

The forward, the KV cache, packing, the fused loss and ``generate`` are the decoder family's
(:mod:`fastzoo.models.decoder.causal_lm`), shared with GPT-2.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastzoo.attention.base import AttnContext
from fastzoo.layers.activations import ACTIVATIONS
from fastzoo.layers.attention import UsesAttention
from fastzoo.layers.mlp import GatedMlp
from fastzoo.layers.norm import RMSNorm
from fastzoo.layers.rotary import RotaryEmbedding, apply_rotary
from fastzoo.models.base import write_pretrained
from fastzoo.models.decoder.causal_lm import CausalLM
from fastzoo.models.decoder.config import LlamaConfig
from fastzoo.models.decoder.convert import LLAMA_LAYOUTS, hf_config


class LlamaAttention(UsesAttention):
    """transformers' ``LlamaAttention``: ``q_proj`` to ``num_attention_heads`` heads, ``k_proj`` /
    ``v_proj`` to ``num_key_value_heads``, rotary on q and k, ``o_proj`` back."""

    attn_dropout_field = "attention_dropout"

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.kv_heads, hd
        self.layer_idx = layer_idx
        self.scale = hd ** -0.5
        self.q_proj = nn.Linear(D, self.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, D, bias=cfg.attention_bias)
        self.attn_dropout = nn.Dropout(cfg.attention_dropout)
        self.sliding_window = cfg.window_of(layer_idx)

    def forward(self, x_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: AttnContext, cache=None):
        B, S, _ = x_BSD.shape
        q_BHSD = self.q_proj(x_BSD).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k_BHSD = self.k_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BHSD = self.v_proj(x_BSD).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q_BHSD, k_BHSD = apply_rotary(q_BHSD, *rope), apply_rotary(k_BHSD, *rope)
        if cache is not None:  # keys and values of earlier steps + these
            k_BHSD, v_BHSD = cache.update(k_BHSD, v_BHSD, self.layer_idx)
            ctx = _window_cache_context(ctx, k_BHSD.shape[-2])
        o_BHSD = self.attend(q_BHSD, k_BHSD, v_BHSD, ctx, scale=self.scale)
        return self.o_proj(o_BHSD.transpose(1, 2).reshape(B, S, -1))


def _window_cache_context(ctx: AttnContext, keys: int) -> AttnContext:
    """A sliding-window cache layer (transformers' ``DynamicSlidingWindowLayer``) returns only
    the keys a window can still see, the last of those the mask covers: the padding mask
    follows them (the window, bottom-right aligned, counts from the last key either way)."""
    mask = ctx.key_padding_mask
    if mask is None or mask.shape[-1] == keys:
        return ctx
    return ctx.replace(key_padding_mask=mask[:, -keys:])


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = GatedMlp(cfg.hidden_size, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act], bias=cfg.mlp_bias)

    def forward(self, x_BSD, rope, ctx: AttnContext, cache=None):
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), rope, ctx, cache)
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD))


class LlamaModel(nn.Module):
    """transformers' ``LlamaModel`` (the ``model.`` of the checkpoint): token embedding, blocks,
    final norm; the rotary angles are computed once per forward and shared by every block."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.head_size, cfg.max_position_embeddings)
        self.checkpoint_kwargs = None  # set: recompute blocks in the backward (every checkpoint_every-th)
        self.checkpoint_every = 1

    def forward(self, tokens, pos, ctx: AttnContext, cache=None):
        """Hidden states of every layer: embeddings, each block's output but the last, norm (HF's)."""
        x_BSD = self.embed_tokens(tokens) if not tokens.is_floating_point() else tokens
        rope = self.rotary_emb(pos, x_BSD.dtype)
        hidden = [x_BSD]
        for i, layer in enumerate(self.layers):
            if self.checkpoint_kwargs is not None and i % self.checkpoint_every == 0:
                hidden.append(checkpoint(layer, hidden[-1], rope, ctx, **self.checkpoint_kwargs))
            else:
                hidden.append(layer(hidden[-1], rope, ctx, cache))
        hidden[-1] = self.norm(hidden[-1])
        return hidden


class LlamaForCausalLM(CausalLM):
    """transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``
    (``config.model_type`` says which), with the decoder family's forward."""

    family = "llama"
    config_class = LlamaConfig
    body_name = "model"
    embedding_path = "model.embed_tokens"
    output_class = "CausalLMOutputWithPast"

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()
        self.tie_weights()
        if cfg.gradient_checkpointing:  # transformers' legacy config field, honoured as transformers does
            self.gradient_checkpointing_enable()

    @property
    def tied_head(self) -> bool:
        return self.config.tie_word_embeddings

    @property
    def head_dim(self) -> int:
        return self.config.head_size

    def _init_weights(self):
        """transformers' init: N(0, initializer_range) weights, zero biases, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=self.config.initializer_range)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        cu_seqlens=None,
        max_seqlen=None,
        **kwargs,
    ):
        """transformers' ``LlamaForCausalLM.forward``: returns ``CausalLMOutputWithPast`` (a tuple
        with ``return_dict=False``); the keywords are the decoder family's
        (:meth:`~fastzoo.models.decoder.causal_lm.CausalLM.causal_lm_forward`)."""
        return self.causal_lm_forward(
            input_ids, inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, labels=labels, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=return_dict, logits_to_keep=logits_to_keep,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, kwargs=kwargs)

    # -- conventions ------------------------------------------------------------------------
    def hf_config(self):
        """This architecture as transformers' config of its layout (``LlamaConfig`` ...)."""
        return hf_config(self.config)

    def save_pretrained(self, path, **_hf_options) -> Path:
        """Write a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` and
        fastzoo both read: transformers' ``config.json`` of the layout, ``generation_config.json``
        and ``model.safetensors`` with transformers' keys (a tied head stored once, as HF does).
        Written atomically (:func:`~fastzoo.models.base.write_pretrained`); transformers' own
        options (``safe_serialization``, ``max_shard_size`` ...) are accepted and ignored."""
        cfg = {**self.hf_config().to_dict(), "architectures": [LLAMA_LAYOUTS[self.config.model_type]]}
        path = write_pretrained(path, cfg, self.state_dict(), weights_format="pt")
        self.generation_config.save_pretrained(path)
        return path
