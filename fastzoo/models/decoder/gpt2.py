"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Follows Hugging Face's ``GPT2LMHeadModel`` with nanoGPT's module layout: token and learned
position embeddings, pre-LN blocks (``ln_1`` -> attention -> residual, ``ln_2`` -> MLP ->
residual), a tanh-GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
Module names are HF's (``transformer.h.N.attn.c_attn`` ...), so HF weights load by renaming
plus four transposes (HF's ``Conv1D`` stores ``[in, out]``, ``nn.Linear`` ``[out, in]``).

The forward takes HF's keywords and returns HF's ``CausalLMOutputWithCrossAttentions``;
input forms, the KV cache, the fused loss and ``generate`` are the decoder family's
(:mod:`fastzoo.models.decoder.causal_lm`), shared with the Llama layouts.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastzoo.attention.base import AttnContext
from fastzoo.layers.activations import ACTIVATIONS
from fastzoo.layers.attention import UsesAttention
from fastzoo.models.decoder.config import GPT2Config
from fastzoo.models.decoder.causal_lm import CausalLM


def attn_scale(cfg: GPT2Config, layer_idx: int) -> float:
    scale = (cfg.n_embd // cfg.n_head) ** -0.5 if cfg.scale_attn_weights else 1.0
    if cfg.scale_attn_by_inverse_layer_idx:  # HF: keeps deep stacks stable in fp16
        scale /= layer_idx + 1
    return scale


class CausalSelfAttention(UsesAttention):
    """HF ``GPT2Attention``: one ``c_attn`` projection to q, k, v; ``c_proj`` back."""

    attn_dropout_field = "attn_pdrop"
    scale_scores = True  # transformers' eager attention scales q k^T

    def __init__(self, cfg: GPT2Config, layer_idx: int):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.attn_pdrop)
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)
        self.scale = attn_scale(cfg, layer_idx)

    def forward(self, x_BSD: torch.Tensor, ctx: AttnContext, cache=None) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q_BSD, k_BSD, v_BSD = self.c_attn(x_BSD).split(D, dim=2)
        q_BHSD, k_BHSD, v_BHSD = (t.view(B, S, self.n_head, self.head_dim).transpose(1, 2) for t in (q_BSD, k_BSD, v_BSD))
        if cache is not None:  # keys and values of earlier steps + these: [B, H, past + S, hd]
            k_BHSD, v_BHSD = cache.update(k_BHSD, v_BHSD, self.layer_idx)
        o_BHSD = self.attend(q_BHSD, k_BHSD, v_BHSD, ctx, scale=self.scale)
        return self.resid_dropout(self.c_proj(o_BHSD.transpose(1, 2).reshape(B, S, D)))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.act = ACTIVATIONS[cfg.activation_function]()
        self.c_proj = nn.Linear(inner, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x_BSD, ctx: AttnContext, cache=None):
        x_BSD = x_BSD + self.attn(self.ln_1(x_BSD), ctx, cache)
        return x_BSD + self.mlp(self.ln_2(x_BSD))


class GPT2Model(nn.Module):
    """HF ``GPT2Model``: embeddings, blocks, final norm (the ``transformer.`` of the checkpoint)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.checkpoint_kwargs = None  # set: recompute blocks in the backward (every checkpoint_every-th)
        self.checkpoint_every = 1

    def forward(self, tokens, pos, ctx: AttnContext, cache=None, token_type_ids=None):
        """Hidden states of every layer: embeddings, each block's output but the last, ln_f (HF's)."""
        x_BSD = self.wte(tokens) if not tokens.is_floating_point() else tokens
        x_BSD = x_BSD + self.wpe(pos)
        if token_type_ids is not None:  # HF: token types are looked up in the token embedding
            x_BSD = x_BSD + self.wte(token_type_ids)
        hidden = [self.drop(x_BSD)]
        for i, block in enumerate(self.h):
            if self.checkpoint_kwargs is not None and i % self.checkpoint_every == 0:
                hidden.append(checkpoint(block, hidden[-1], ctx, **self.checkpoint_kwargs))
            else:
                hidden.append(block(hidden[-1], ctx, cache))
        hidden[-1] = self.ln_f(hidden[-1])
        return hidden


class GPT2LMHeadModel(CausalLM):
    family = "gpt2"
    config_class = GPT2Config
    body_name = "transformer"
    embedding_path = "transformer.wte"
    output_class = "CausalLMOutputWithCrossAttentions"
    hf_class = "GPT2LMHeadModel"
    cross_attention_keywords = True

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in every GPT-2 checkpoint
        self._init_weights()
        if cfg.gradient_checkpointing:  # transformers' legacy config field, honoured as transformers does
            self.gradient_checkpointing_enable()

    def _init_weights(self):
        """HF's init: N(0, initializer_range), residual projections scaled by 1/sqrt(2 * n_layer)."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name:
                nn.init.ones_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=std)

    @property
    def head_dim(self) -> int:
        return self.config.n_embd // self.config.n_head

    @property
    def n_positions(self) -> int:
        return self.config.n_positions

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
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
        """transformers' ``GPT2LMHeadModel.forward``, its keywords in its order: returns
        ``CausalLMOutputWithCrossAttentions`` (a tuple with ``return_dict=False``); the keywords are the
        decoder family's (:meth:`~fastzoo.models.decoder.causal_lm.CausalLM.causal_lm_forward`), plus
        ``token_type_ids`` (looked up in the token embedding, as HF); ``encoder_hidden_states`` /
        ``encoder_attention_mask`` (cross-attention, which GPT-2 has only with ``add_cross_attention``)
        are refused by name when given."""
        return self.causal_lm_forward(
            input_ids, inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, labels=labels, use_cache=use_cache, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, return_dict=return_dict, logits_to_keep=logits_to_keep,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, token_type_ids=token_type_ids,
            kwargs={"encoder_hidden_states": encoder_hidden_states, "encoder_attention_mask": encoder_attention_mask,
                    **kwargs})

    # -- conventions ------------------------------------------------------------------------
    def hf_config(self):
        """This architecture as a ``transformers.GPT2Config``."""
        import transformers

        return transformers.GPT2Config(**self.config.to_dict())

    def hf_state_dict(self) -> dict:
        """HF's keys and layout: ``Conv1D`` weights ``[in, out]``, the tied head stored once."""
        from fastzoo.models.decoder.convert import GPT2 as HF

        return HF.from_fastzoo(self.state_dict(), self.config)
