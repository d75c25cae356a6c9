"""Llama (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models") and the
decoders that share its layout, each a few declared differences
(:mod:`fastzoo.models.decoder.layouts`): Qwen2, Mistral, Qwen3, OLMo 2, Granite, SmolLM3,
Phi-3, Gemma 2 and Gemma 3 (text).

Llama's block: pre-norm with RMSNorm (``input_layernorm`` -> attention -> residual,
``post_attention_layernorm`` -> SwiGLU MLP -> residual), rotary position embeddings on q and
k, grouped-query attention (``num_key_value_heads`` key/value heads shared by the query
heads, handed to the kernel unrepeated), a final RMSNorm and an LM head, tied to the token
embedding or not. What a layout changes is read from its config
(:class:`~fastzoo.models.decoder.config.LlamaConfig`, ``config.layout``): biases, fused
projections, QK-norm, where the norms sit, multipliers, soft-capping, windows and rotary per
layer. Module names are transformers' (``model.layers.N.self_attn.q_proj``, Phi-3's
``qkv_proj``, Gemma's ``pre_feedforward_layernorm`` ...), so HF weights load key for key.

The forward, the KV cache, packing, the fused loss and ``generate`` are the decoder family's
(:mod:`fastzoo.models.decoder.causal_lm`), shared with GPT-2.
"""
from __future__ import annotations


import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastzoo.attention.base import AttnContext
from fastzoo.layers.activations import ACTIVATIONS
from fastzoo.layers.attention import UsesAttention
from fastzoo.layers.mlp import FusedGatedMlp, GatedMlp
from fastzoo.layers.norm import RMSNorm
from fastzoo.layers.rotary import RotaryEmbedding, apply_rotary
from fastzoo.models.decoder.causal_lm import CausalLM
from fastzoo.models.decoder.config import LlamaConfig
from fastzoo.models.decoder.convert import hf_config


def _norm(cfg: LlamaConfig, dim: int) -> RMSNorm:
    """The layout's RMSNorm (Gemma's scales by 1 + weight; OLMo 2's and Gemma's weight in fp32)."""
    layout = cfg.layout
    return RMSNorm(dim, eps=cfg.rms_norm_eps, offset=1.0 if layout.gemma_norm else 0.0,
                   weight_in_fp32=layout.weight_in_fp32)


class LlamaAttention(UsesAttention):
    """transformers' ``LlamaAttention``: ``q_proj`` to ``num_attention_heads`` heads, ``k_proj`` /
    ``v_proj`` to ``num_key_value_heads`` (Phi-3: one ``qkv_proj``), QK-norm where the layout has
    it (per head: ``q_norm``/``k_norm`` over head_dim; OLMo 2: over all heads), rotary on q and k
    (not on smollm3's no-rope layers), ``o_proj`` back."""

    attn_dropout_field = "attention_dropout"
    scale_scores = True  # transformers' eager attention scales q k^T

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        layout = cfg.layout
        D, hd = cfg.hidden_size, cfg.head_size
        H, Hkv = cfg.num_attention_heads, cfg.kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, hd
        self.layer_idx = layer_idx
        self.scale = cfg.attention_scale
        if layout.fused:
            self.qkv_proj = nn.Linear(D, (H + 2 * Hkv) * hd, bias=False)
        else:
            self.q_proj = nn.Linear(D, H * hd, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(D, Hkv * hd, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(D, Hkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=cfg.attention_bias)
        self.qk_norm = layout.qk_norm
        if layout.qk_norm is not None:
            per_head = layout.qk_norm == "head"
            self.q_norm = _norm(cfg, hd if per_head else H * hd)
            self.k_norm = _norm(cfg, hd if per_head else Hkv * hd)
        self.attn_dropout = nn.Dropout(cfg.attention_dropout)
        self.sliding_window = cfg.window_of(layer_idx)
        self.softcap = cfg.attn_logit_softcapping

    def _qkv(self, x_BSD):
        if hasattr(self, "qkv_proj"):
            hd = self.head_dim
            return self.qkv_proj(x_BSD).split([self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], -1)
        return self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)

    def forward(self, x_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, ctx: AttnContext, cache=None):
        B, S, _ = x_BSD.shape
        q_BSD, k_BSD, v_BSD = self._qkv(x_BSD)
        if self.qk_norm == "all":
            q_BSD, k_BSD = self.q_norm(q_BSD), self.k_norm(k_BSD)
        q_BSHD = q_BSD.view(B, S, self.num_heads, self.head_dim)
        k_BSHD = k_BSD.view(B, S, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BSHD, k_BSHD = self.q_norm(q_BSHD), self.k_norm(k_BSHD)
        q_BHSD, k_BHSD = q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2)
        v_BHSD = v_BSD.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
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
    """A block, with the norms where the layout puts them:

    - ``pre`` (Llama): ``x + attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``
      (Granite: each branch times ``residual_multiplier``);
    - ``post`` (OLMo 2): ``x + post_attention_layernorm(attn(x))``, then ``x + post_feedforward_layernorm(mlp(x))``;
    - ``sandwich`` (Gemma): ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
      ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``.
    """

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        layout, D = cfg.layout, cfg.hidden_size
        self.norms = layout.norms
        if layout.norms != "post":
            self.input_layernorm = _norm(cfg, D)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = _norm(cfg, D)
        if layout.norms == "sandwich":
            self.pre_feedforward_layernorm = _norm(cfg, D)
        if layout.norms != "pre":
            self.post_feedforward_layernorm = _norm(cfg, D)
        mlp = FusedGatedMlp if layout.fused else GatedMlp
        self.mlp = mlp(D, cfg.intermediate_size, ACTIVATIONS[cfg.hidden_act], bias=cfg.mlp_bias)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x_BSD, rope, ctx: AttnContext, cache=None):
        if self.norms == "pre":
            x_BSD = x_BSD + self._scaled(self.self_attn(self.input_layernorm(x_BSD), rope, ctx, cache))
            return x_BSD + self._scaled(self.mlp(self.post_attention_layernorm(x_BSD)))
        h_BSD = x_BSD if self.norms == "post" else self.input_layernorm(x_BSD)
        x_BSD = x_BSD + self.post_attention_layernorm(self.self_attn(h_BSD, rope, ctx, cache))
        h_BSD = x_BSD if self.norms == "post" else self.pre_feedforward_layernorm(x_BSD)
        return x_BSD + self.post_feedforward_layernorm(self.mlp(h_BSD))

    def _scaled(self, branch_BSD):
        return branch_BSD if self.residual_multiplier == 1.0 else branch_BSD * self.residual_multiplier


class LlamaModel(nn.Module):
    """transformers' ``LlamaModel`` (the ``model.`` of the checkpoint): token embedding (Gemma:
    times sqrt(hidden_size); Granite: times ``embedding_multiplier``), blocks, final norm; the
    rotary angles are computed once per forward per schedule (Gemma 3: one for sliding layers,
    one for global ones) and shared by the blocks."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # transformers' padding_idx: the padding token's row gets no gradient
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and cfg.pad_token_id < cfg.vocab_size else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = _norm(cfg, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.layout.embed_scale else None
        self.embedding_multiplier = cfg.embedding_multiplier
        # layer -> its schedule's key (None: no rotary there); one RotaryEmbedding per distinct schedule
        ropes = [cfg.rope_of(i) for i in range(cfg.num_hidden_layers)]
        schedules = []
        for rope in ropes:
            if rope is not None and rope not in schedules:
                schedules.append(rope)
        self.rope_index = [None if rope is None else schedules.index(rope) for rope in ropes]
        rotary = [RotaryEmbedding(rope, cfg.head_size, cfg.max_position_embeddings) for rope in schedules]
        self.rotary_emb = rotary[0] if len(rotary) == 1 else nn.ModuleList(rotary)
        self.checkpoint_kwargs = None  # set: recompute blocks in the backward (every checkpoint_every-th)
        self.checkpoint_every = 1

    def embed(self, tokens):
        """Token embeddings of ids (input embeddings given as floats are taken as they are, as HF's)."""
        if tokens.is_floating_point():
            return tokens
        x_BSD = self.embed_tokens(tokens)
        if self.embed_scale is not None:  # transformers rounds the scale to the weights' dtype
            x_BSD = x_BSD * torch.tensor(self.embed_scale, dtype=x_BSD.dtype)
        return x_BSD if self.embedding_multiplier == 1.0 else x_BSD * self.embedding_multiplier

    def forward(self, tokens, pos, ctx: AttnContext, cache=None):
        """Hidden states of every layer: embeddings, each block's output but the last, norm (HF's)."""
        x_BSD = self.embed(tokens)
        rotary = self.rotary_emb if isinstance(self.rotary_emb, nn.ModuleList) else [self.rotary_emb]
        ropes = [r(pos, x_BSD.dtype) for r in rotary]
        hidden = [x_BSD]
        for i, layer in enumerate(self.layers):
            rope = None if self.rope_index[i] is None else ropes[self.rope_index[i]]
            if self.checkpoint_kwargs is not None and i % self.checkpoint_every == 0:
                hidden.append(checkpoint(layer, hidden[-1], rope, ctx, **self.checkpoint_kwargs))
            else:
                hidden.append(layer(hidden[-1], rope, ctx, cache))
        hidden[-1] = self.norm(hidden[-1])
        return hidden


class LlamaForCausalLM(CausalLM):
    """transformers' ``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM`` ... (``config.model_type``
    says which), with the decoder family's forward. The logits are Granite's divided by
    ``logits_scaling`` and Gemma's soft-capped (``final_logit_softcapping``), in the fused loss too."""

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

    @property
    def logits_divisor(self) -> float:
        return self.config.logits_scaling

    @property
    def logits_softcap(self) -> float | None:
        return self.config.final_logit_softcapping

    def _init_weights(self):
        """transformers' init: N(0, initializer_range) weights, zero biases, norms at 1 (Gemma's: 1 + 0)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith("norm.weight"):
                (nn.init.zeros_ if self.config.layout.gemma_norm else nn.init.ones_)(p)
            else:
                nn.init.normal_(p, std=self.config.initializer_range)
        pad = self.model.embed_tokens.padding_idx
        if pad is not None:  # the padding token's embedding starts at 0, as transformers'
            with torch.no_grad():
                self.model.embed_tokens.weight[pad].zero_()

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

    @property
    def hf_class(self) -> str:
        return self.config.layout.hf_class
