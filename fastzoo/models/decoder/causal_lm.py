"""What every fastzoo causal LM does around its layers: transformers' forward conventions.

A decoder (GPT-2, the Llama layouts) subclasses :class:`CausalLM` and provides its body of
layers (``body``: a module called as ``body(tokens, positions, ctx, cache) -> hidden states``),
its LM head and its own ``forward`` signature (transformers' positional order for that
model), which hands everything to :meth:`CausalLM.causal_lm_forward`. Shared here, once:

- every input form (padded, packed ``cu_seqlens``, HF-flattened ``position_ids``,
  NestedTensor), read by :mod:`fastzoo.layers.sequence`;
- the KV cache (transformers' ``Cache`` in HF's padded layout, and the packed view of it for
  packed-only backends, :mod:`fastzoo.models.decoder.generation`);
- ``labels`` -> ``.loss``: next-token cross-entropy that never crosses a sequence boundary,
  fused with the LM head in training (``fastzoo.losses.linear_cross_entropy``);
- ``logits_to_keep``, ``output_hidden_states``, ``return_dict``, transformers' flash-attention
  packing keywords and ``num_items_in_batch`` (Trainer's exact gradient accumulation);
- the tied head stored once in the state dict (as HF's files), gradient checkpointing.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from fastzoo.layers.sequence import IGNORE_INDEX, read_sequences
from fastzoo.losses.linear_ce import linear_cross_entropy, softcap_logits
from fastzoo.models.base import FastzooModel, refuse_inputs, write_pretrained
from fastzoo.models.decoder.generation import CausalLMConventions, layer_cache
from fastzoo.tracing import tracing



class CausalLM(CausalLMConventions, FastzooModel):
    """Base of fastzoo's decoders (see the module docstring). A subclass sets ``body_name``
    (the attribute holding its layers: ``transformer`` / ``model``), ``output_class`` (the name
    of its transformers output class), ``hf_class`` and ``n_positions`` (its longest position, None:
    no limit)."""

    body_name: str = "model"
    output_class: str = "CausalLMOutputWithPast"
    hf_class: str  # the transformers class whose from_pretrained reads save_pretrained's directory
    logits_divisor: float = 1.0  # logits are lm_head(h) / logits_divisor (Granite's logits_scaling)
    logits_softcap: float | None = None  # then cap * tanh(logits / cap) (Gemma's final_logit_softcapping)
    cross_attention_keywords: bool = False  # transformers' forward has encoder_hidden_states / _mask (GPT-2)

    def __init__(self):
        super().__init__()
        # imported here, not inside forward: transformers registers its output classes as
        # pytree nodes on import, which it skips while compiling (torch.export would then fail)
        import transformers.modeling_outputs  # noqa: F401

        # a tied head is stored once (as HF's save_pretrained does): a state dict with two keys
        # for one tensor is refused by safetensors, which is how transformers.Trainer saves
        # checkpoints of a model that is not a PreTrainedModel
        self.register_state_dict_post_hook(_drop_tied_head)
        self.register_load_state_dict_pre_hook(_fill_tied_head)

    @property
    def body(self):
        return getattr(self, self.body_name)

    @property
    def n_positions(self) -> int | None:
        return None

    def attention_needs(self) -> dict:
        # HF callers pass attention_mask (a tokenizer's output has one): a backend must serve it,
        # with a mask or by the model unpadding into packed sequences. Packed input (cu_seqlens)
        # and the KV cache are checked per call (check_call; generate checks kv_cache first).
        return {"head_dim": self.head_dim, "causal": True, "grid_2d": False, "padding_mask": True, "unpads": True}

    # -- forward ---------------------------------------------------------------------------
    def causal_lm_forward(self, input_ids=None, inputs_embeds=None, *, attention_mask=None, position_ids=None,
                          past_key_values=None, labels=None, use_cache=None, output_attentions=None,
                          output_hidden_states=None, return_dict=None, logits_to_keep=0, cu_seqlens=None,
                          max_seqlen=None, kwargs: dict, **body_inputs):
        """The forward every decoder shares; ``kwargs``: the rest of the caller's keywords,
        ``body_inputs``: per-token inputs of the family's own (GPT-2's ``token_type_ids``).

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
        cross = {k: kwargs.pop(k) for k in ("encoder_hidden_states", "encoder_attention_mask") if k in kwargs
                 and self.cross_attention_keywords}
        refuse_inputs(type(self).__name__, {"output_attentions": output_attentions, **cross}, kwargs,
                      why="attention kernels return no weights, and there is no cross-attention; use transformers' "
                          "model for that")
        if output_hidden_states is None:  # HF: the config's default
            output_hidden_states = self.config.output_hidden_states
        cache = self._cache(past_key_values, use_cache)
        past_length = 0 if cache is None else cache.get_seq_length()
        if isinstance(past_length, torch.Tensor):  # a static cache counts its tokens in a tensor
            past_length = int(past_length)
        seqs = read_sequences(
            input_ids, inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, past_length=past_length,
            n_positions=self.n_positions, vocab_size=self.config.vocab_size,
            backend=self.attention_backend.capabilities, attn=self._attn_ctx_args(),
        )
        if cache is not None and seqs.form not in ("padded", "unpadded") and use_cache is None and past_key_values is None:
            cache = None  # the default, not a request: packed forms return no cache
        extra = {k: None if v is None else seqs.to_layers(v) for k, v in body_inputs.items()}
        hidden = self.body(seqs.tokens, seqs.positions, seqs.ctx, layer_cache(cache, seqs, past_length), **extra)
        loss = logits = None
        if labels is not None or shift_labels is not None:
            loss, logits = self._loss(hidden[-1], seqs, labels, num_items_in_batch, logits_to_keep, shift_labels)
        else:
            logits = self._logits(hidden[-1], seqs, logits_to_keep)
        import transformers.modeling_outputs as outputs

        out = getattr(outputs, self.output_class)(
            loss=loss, logits=logits, past_key_values=cache,
            hidden_states=tuple(seqs.restore(h) for h in hidden) if output_hidden_states else None,
        )
        return out if return_dict is not False else out.to_tuple()

    def _cache(self, past_key_values, use_cache):
        """The KV cache this call fills (None: no cache)."""
        if use_cache is None:  # HF's default in eval mode; none in training and while compiling / exporting
            use_cache = past_key_values is not None or (
                self.config.use_cache and not self.training and not tracing())
            if use_cache and past_key_values is None and not self.attention_backend.capabilities.kv_cache:
                use_cache = False  # a default, not a request: a backend without a cache just returns none
        if not use_cache:
            return None
        if self.training and self.body.checkpoint_kwargs is not None:
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
        # the model's own request, with its device and dtype (sdpa's flash kernel takes a KV cache on CPU, not on CUDA)
        self.attention_backend.check(dataclasses.replace(self.attention_request(), kv_cache=True))

    def head(self, h):
        """The logits of hidden states ``h``: the LM head, then the family's scaling and soft-capping."""
        logits = self.lm_head(h)
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        return logits if self.logits_softcap is None else softcap_logits(logits, self.logits_softcap)

    def _logits(self, h, seqs, logits_to_keep):
        if not logits_to_keep:
            return seqs.restore(self.head(h))
        if seqs.form == "nested":
            raise ValueError("logits_to_keep: not supported with NestedTensor input")
        h = seqs.restore(h)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return self.head(h[:, keep])

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
        _check_targets(targets_N, self.config.vocab_size, "shift_labels" if shift_labels is not None else "labels")
        reduction = "mean" if num_items_in_batch is None else "sum"
        h_ND = h.reshape(-1, h.shape[-1])
        logits = None
        if self.training:  # no logits: the loss is fused with the LM head (scaling and soft-capping inside)
            h_ND = h_ND if self.logits_divisor == 1.0 else h_ND / self.logits_divisor
            loss = linear_cross_entropy(h_ND, self.lm_head.weight, targets_N, ignore_index=IGNORE_INDEX, reduction=reduction,
                                        softcap=self.logits_softcap)
        else:
            logits_NV = self.head(h_ND)
            loss = F.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE_INDEX, reduction=reduction)
            logits = seqs.restore(logits_NV.view(*h.shape[:-1], -1))
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return loss, logits

    def _attn_ctx_args(self) -> dict:
        """What every layer shares (layers with their own scale, dropout or window derive a copy)."""
        from fastzoo.layers.attention import UsesAttention

        first = next((m for m in self.modules() if isinstance(m, UsesAttention)), None)
        if first is None:
            return {}
        return {"scale": first.scale, "dropout_p": first.attn_dropout_p if self.training else 0.0}

    # -- conventions ------------------------------------------------------------------------
    def hf_state_dict(self) -> dict:
        """The weights under transformers' keys and layouts (the tied head stored once, as HF's files)."""
        return self.state_dict()

    def save_pretrained(self, path, **_hf_options) -> Path:
        """Write a directory that transformers' ``from_pretrained`` (of :attr:`hf_class`) and fastzoo both
        read: transformers' ``config.json``, ``generation_config.json`` and ``model.safetensors`` with
        transformers' keys and layouts (:meth:`hf_state_dict`). Written atomically
        (:func:`~fastzoo.models.base.write_pretrained`); transformers' own options (``safe_serialization``,
        ``max_shard_size`` ...) are accepted and ignored: the weights are always one safetensors file."""
        cfg = {**self.hf_config().to_dict(), "architectures": [self.hf_class]}
        path = write_pretrained(path, cfg, self.hf_state_dict(), weights_format="pt")
        self.generation_config.save_pretrained(path)
        return path

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1,
                                      offload: bool = False):
        super().gradient_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)
        self.body.checkpoint_kwargs, self.body.checkpoint_every = self._checkpoint_kwargs, every_n_layers

    def gradient_checkpointing_disable(self):
        super().gradient_checkpointing_disable()
        self.body.checkpoint_kwargs = None


def _check_targets(targets_N: torch.Tensor, vocab_size: int, name: str) -> None:
    """A ValueError naming ``name`` for a target that is neither a token id nor IGNORE_INDEX (free on
    the CPU in eager; on a GPU it would be a host sync, so there the kernels' own checks stand)."""
    if targets_N.device.type != "cpu" or not targets_N.numel() or tracing():
        return
    bad = (targets_N != IGNORE_INDEX) & ((targets_N < 0) | (targets_N >= vocab_size))
    if bool(bad.any()):
        value = int(targets_N[bad.nonzero()[0, 0]])
        raise ValueError(f"{name} must be token ids in [0, {vocab_size}) (vocab_size) or {IGNORE_INDEX} (ignored), "
                         f"got {value}")


def _drop_tied_head(module, state_dict, prefix, local_metadata) -> None:
    if module.lm_head.weight is module.get_input_embeddings().weight:
        state_dict.pop(prefix + "lm_head.weight", None)


def _fill_tied_head(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Accept a state dict with the tied head stored once. Where both names are given, the token
    embedding defines the one tensor (torch's distributed state-dict loader adds the model's
    current head beside a new embedding); ``fastzoo.load_pretrained`` refuses a checkpoint whose
    two values differ before anything is loaded."""
    embedding = prefix + module.embedding_path + ".weight"
    if module.tied_head and embedding in state_dict:
        state_dict[prefix + "lm_head.weight"] = state_dict[embedding]


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
