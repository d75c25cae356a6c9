"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Follows Hugging Face's ``GPT2LMHeadModel`` with nanoGPT's module layout: token and learned
position embeddings, pre-LN blocks (``ln_1`` -> attention -> residual, ``ln_2`` -> MLP ->
residual), a tanh-GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
Module names are HF's (``transformer.h.N.attn.c_attn`` ...), so HF weights load by renaming
plus four transposes (HF's ``Conv1D`` stores ``[in, out]``, ``nn.Linear`` ``[out, in]``).

The forward takes HF's keywords and returns HF's ``CausalLMOutputWithCrossAttentions``;
input forms (padded, packed ``cu_seqlens``, HF-flattened ``position_ids``, NestedTensor)
are read by :mod:`fastzoo.layers.sequence`, and ``generate`` & co. come from
:mod:`fastzoo.models.decoder.generation` (transformers' ``GenerationMixin``).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastzoo.attention.base import AttnContext
from fastzoo.layers.attention import UsesAttention
from fastzoo.layers.sequence import IGNORE_INDEX, read_sequences
from fastzoo.losses.linear_ce import linear_cross_entropy
from fastzoo.models.base import FastzooModel, write_pretrained
from fastzoo.models.decoder.config import ACTIVATIONS, GPT2Config
from fastzoo.models.decoder.generation import CausalLMConventions, layer_cache


def attn_scale(cfg: GPT2Config, layer_idx: int) -> float:
    scale = (cfg.n_embd // cfg.n_head) ** -0.5 if cfg.scale_attn_weights else 1.0
    if cfg.scale_attn_by_inverse_layer_idx:  # HF: keeps deep stacks stable in fp16
        scale /= layer_idx + 1
    return scale


class CausalSelfAttention(UsesAttention):
    """HF ``GPT2Attention``: one ``c_attn`` projection to q, k, v; ``c_proj`` back."""

    attn_dropout_field = "attn_pdrop"

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
        self.checkpoint_kwargs = None  # set: recompute each block in the backward

    def forward(self, tokens, pos, ctx: AttnContext, cache=None, token_type_ids=None):
        """Hidden states of every layer: embeddings, each block's output but the last, ln_f (HF's)."""
        x_BSD = self.wte(tokens) if not tokens.is_floating_point() else tokens
        x_BSD = x_BSD + self.wpe(pos)
        if token_type_ids is not None:  # HF: token types are looked up in the token embedding
            x_BSD = x_BSD + self.wte(token_type_ids)
        hidden = [self.drop(x_BSD)]
        for block in self.h:
            if self.checkpoint_kwargs is not None:
                hidden.append(checkpoint(block, hidden[-1], ctx, **self.checkpoint_kwargs))
            else:
                hidden.append(block(hidden[-1], ctx, cache))
        hidden[-1] = self.ln_f(hidden[-1])
        return hidden


class GPT2LMHeadModel(CausalLMConventions, FastzooModel):
    family = "gpt2"
    config_class = GPT2Config
    eval_after_pretrained = True  # like transformers' from_pretrained

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        # imported here, not inside forward: transformers registers its output classes as
        # pytree nodes on import, which it skips while compiling (torch.export would then fail)
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions  # noqa: F401

        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in every GPT-2 checkpoint
        # the tied head is stored once (as HF's save_pretrained does): a state dict with two keys
        # for one tensor is refused by safetensors, which is how transformers.Trainer saves
        # checkpoints of a model that is not a PreTrainedModel
        self.register_state_dict_post_hook(_drop_tied_head)
        self.register_load_state_dict_pre_hook(_fill_tied_head)
        self._init_weights()

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

    def attention_needs(self) -> dict:
        # HF callers pass attention_mask (a tokenizer's output has one): a backend must serve it,
        # with a mask or by the model unpadding into packed sequences. Packed input (cu_seqlens)
        # and the KV cache are checked per call (check_call; generate checks kv_cache first).
        return {"head_dim": self.config.n_embd // self.config.n_head, "causal": True, "grid_2d": False,
                "padding_mask": True, "unpads": True}

    # -- forward ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        cu_seqlens=None,
        max_seqlen=None,
        **kwargs,
    ):
        """transformers' ``GPT2LMHeadModel.forward``: returns ``CausalLMOutputWithCrossAttentions``
        (a tuple with ``return_dict=False``).

        - padded ``input_ids[B, S]`` (+ ``attention_mask``, 1 = token); positions default to
          ``past..past+S-1`` like HF (``generate`` passes them from the mask for left padding).
        - packed ``input_ids[1, T]`` + ``cu_seqlens`` (int32) [+ ``max_seqlen``], or HF's
          ``cu_seq_lens_q``/``max_length_q``, or ``position_ids`` restarting per sequence with no
          mask (``DataCollatorWithFlattening``); a jagged NestedTensor of ids. No attention
          crosses a sequence boundary and neither does the ``labels`` shift.
        - ``labels``: shifted inside, -100 ignored (``shift_labels``: already shifted, used as given); loss averaged over the scored tokens, or
          summed and divided by ``num_items_in_batch`` when given (transformers' Trainer).
          In train mode the loss is computed from the hidden states without materialising the
          logits (``fastzoo.losses.linear_cross_entropy``) and ``logits`` is ``None``; in eval
          mode the logits are returned with the loss, as HF does.
        - ``past_key_values`` (a transformers ``Cache``) / ``use_cache``: KV cache of a padded
          batch (kept in HF's padded layout, also for packed-only backends, which unpad the new
          tokens and read the cached keys with their own offsets), on a backend with the
          ``kv_cache`` capability. ``use_cache`` defaults to
          ``config.use_cache`` in eval mode and to False in train mode and under
          ``torch.compile`` / ``torch.export`` (pass it to have a cache there).
        - ``output_attentions=True`` is refused: the attention kernels return no weights.
        """
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        cu_seqlens, max_seqlen = _flash_kwargs(kwargs, cu_seqlens, max_seqlen)
        for name, value in (("output_attentions", output_attentions), ("encoder_hidden_states", kwargs.pop("encoder_hidden_states", None))):
            if value:
                raise ValueError(f"{name}: fastzoo's GPT-2 does not provide it (attention kernels return no weights; "
                                 "no cross-attention); use transformers' model for that")
        kwargs.pop("encoder_attention_mask", None)
        if kwargs:
            raise TypeError(f"GPT2LMHeadModel.forward() got unexpected keyword argument(s): {', '.join(sorted(kwargs))}")
        if output_hidden_states is None:  # HF: the config's default
            output_hidden_states = self.config.output_hidden_states
        cache = self._cache(past_key_values, use_cache, labels)
        seqs = read_sequences(
            input_ids, inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, past_length=0 if cache is None else cache.get_seq_length(),
            n_positions=self.config.n_positions, vocab_size=self.config.vocab_size,
            backend=self.attention_backend.capabilities, attn=self._attn_ctx_args(),
        )
        if cache is not None and seqs.form not in ("padded", "unpadded") and use_cache is None and past_key_values is None:
            cache = None  # the default, not a request: packed forms return no cache
        types = None if token_type_ids is None else seqs.to_layers(token_type_ids)
        hidden = self.transformer(seqs.tokens, seqs.positions, seqs.ctx, layer_cache(cache, seqs), types)
        loss = logits = None
        if labels is not None or shift_labels is not None:
            loss, logits = self._loss(hidden[-1], seqs, labels, num_items_in_batch, logits_to_keep, shift_labels)
        else:
            logits = self._logits(hidden[-1], seqs, logits_to_keep)
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        out = CausalLMOutputWithCrossAttentions(
            loss=loss, logits=logits, past_key_values=cache,
            hidden_states=tuple(seqs.restore(h) for h in hidden) if output_hidden_states else None,
        )
        return out if return_dict is not False else out.to_tuple()

    def _cache(self, past_key_values, use_cache, labels):
        """The KV cache this call fills (None: no cache)."""
        if use_cache is None:  # HF's default in eval mode; none in training and while compiling / exporting
            use_cache = past_key_values is not None or (
                self.config.use_cache and not self.training and not torch.compiler.is_compiling())
            if use_cache and past_key_values is None and not self.attention_backend.capabilities.kv_cache:
                use_cache = False  # a default, not a request: a backend without a cache just returns none
        if not use_cache:
            return None
        if self.training and self.transformer.checkpoint_kwargs is not None:
            warnings.warn("use_cache=True is incompatible with gradient checkpointing: no KV cache returned (as transformers)")
            return None
        self.check_kv_cache()
        from transformers.cache_utils import Cache, DynamicCache

        if past_key_values is None:
            return DynamicCache()
        if not isinstance(past_key_values, Cache):
            raise ValueError(
                f"past_key_values must be a transformers Cache (e.g. the DynamicCache a previous call returned), "
                f"got {type(past_key_values).__name__}"
            )
        return past_key_values

    def check_kv_cache(self):
        """Refuse a KV cache on a backend that cannot attend with one, before running."""
        # the model's own request (its device and dtype: sdpa's flash kernel takes a KV cache on CPU, not on CUDA)
        self.attention_backend.check(dataclasses.replace(self.attention_request(), kv_cache=True))

    def _logits(self, h, seqs, logits_to_keep):
        if not logits_to_keep:
            return seqs.restore(self.lm_head(h))
        if seqs.form == "nested":
            raise ValueError("logits_to_keep: not supported with NestedTensor input")
        h = seqs.restore(h)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return self.lm_head(h[:, keep])

    def _loss(self, h, seqs, labels, num_items_in_batch, logits_to_keep, shift_labels=None):
        """Next-token loss over the layers' layout (never across a sequence boundary).
        ``shift_labels``: targets already aligned with the positions (transformers' loss keyword;
        context-parallel training shifts before sharding), used as given instead of ``labels``."""
        if logits_to_keep:
            raise ValueError("logits_to_keep: the loss needs the logits of every position; leave it 0 with labels")
        if shift_labels is not None:
            targets_N = seqs.to_layers(shift_labels).reshape(-1).long()
        else:
            targets_N = seqs.next_token_targets(labels)
        reduction = "mean" if num_items_in_batch is None else "sum"
        h_ND = h.reshape(-1, h.shape[-1])
        logits = None
        if self.training:  # no logits: the loss is fused with the LM head
            loss = linear_cross_entropy(h_ND, self.lm_head.weight, targets_N, ignore_index=IGNORE_INDEX, reduction=reduction)
        else:
            logits_NV = self.lm_head(h_ND)
            loss = F.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE_INDEX, reduction=reduction)
            logits = seqs.restore(logits_NV.view(*h.shape[:-1], -1))
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return loss, logits

    def _attn_ctx_args(self) -> dict:
        """What every layer shares (layers with their own scale or dropout derive a copy)."""
        drop = self.transformer.h[0].attn.attn_dropout_p if self.training and len(self.transformer.h) else 0.0
        return {"scale": attn_scale(self.config, 0), "dropout_p": drop}

    # -- conventions ------------------------------------------------------------------------
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None):
        super().gradient_checkpointing_enable(gradient_checkpointing_kwargs)
        self.transformer.checkpoint_kwargs = self._checkpoint_kwargs

    def gradient_checkpointing_disable(self):
        super().gradient_checkpointing_disable()
        self.transformer.checkpoint_kwargs = None

    def hf_config(self):
        """This architecture as a ``transformers.GPT2Config``."""
        import transformers

        return transformers.GPT2Config(**self.config.to_dict())

    def save_pretrained(self, path, **_hf_options) -> Path:
        """Write a directory that ``transformers.GPT2LMHeadModel.from_pretrained`` and fastzoo
        both read: HF's ``config.json``, ``generation_config.json`` and ``model.safetensors``
        with HF's keys and layout (``Conv1D`` weights ``[in, out]``; the tied head stored once,
        as HF does). Written atomically (:func:`~fastzoo.models.base.write_pretrained`).
        transformers' own options (``safe_serialization``, ``max_shard_size`` ...) are accepted
        and ignored: the weights are always one safetensors file."""
        from fastzoo.models.decoder.convert import GPT2 as HF

        cfg = {**self.hf_config().to_dict(), "architectures": ["GPT2LMHeadModel"]}
        state = {k: v for k, v in self.state_dict().items() if k != "lm_head.weight"}
        path = write_pretrained(path, cfg, HF.from_fastzoo(state, self.config), weights_format="pt")
        self.generation_config.save_pretrained(path)
        return path


def _drop_tied_head(module, state_dict, prefix, local_metadata) -> None:
    if module.lm_head.weight is module.transformer.wte.weight:
        state_dict.pop(prefix + "lm_head.weight", None)


def _fill_tied_head(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Accept a state dict with the tied head stored once. Where both names are given, the token
    embedding defines the one tensor (torch's distributed state-dict loader adds the model's
    current head beside a new embedding); ``fastzoo.load_pretrained`` refuses a checkpoint whose
    two values differ before anything is loaded."""
    if prefix + "transformer.wte.weight" in state_dict:
        state_dict[prefix + "lm_head.weight"] = state_dict[prefix + "transformer.wte.weight"]


def _flash_kwargs(kwargs: dict, cu_seqlens, max_seqlen):
    """transformers' flash-attention packing keywords (``DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)``) as fastzoo's ``cu_seqlens`` / ``max_seqlen``."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    max_q, max_k = kwargs.pop("max_length_q", None), kwargs.pop("max_length_k", None)
    kwargs.pop("seq_idx", None)  # DataCollatorWithFlattening(return_seq_idx=True): the same boundaries again
    if cu_q is None and cu_k is None:
        return cu_seqlens, max_seqlen
    if cu_seqlens is not None:
        raise ValueError("give cu_seqlens or cu_seq_lens_q/cu_seq_lens_k, not both")
    if cu_q is None or cu_k is None or (cu_q is not cu_k and not torch.equal(cu_q, cu_k)):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must both be given and equal (self-attention over packed sequences)")
    return cu_q, max_q if max_q is not None else max_k
