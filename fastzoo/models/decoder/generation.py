"""What code written for a transformers causal LM calls on the model, besides its forward.

:class:`CausalLMConventions` gives a fastzoo decoder transformers' ``PreTrainedModel`` API
where HF users reach for it: ``generate`` (transformers' own ``GenerationMixin``: its
sampler, logits processors, stopping criteria and ``DynamicCache``), ``generation_config``,
``gradient_checkpointing_enable`` / ``disable`` / ``is_gradient_checkpointing``,
``get_input_embeddings`` / ``set_input_embeddings`` / ``get_output_embeddings``,
``enable_input_require_grads`` / ``disable_input_require_grads``, ``prepare_inputs_for_generation``,
``resize_token_embeddings`` (head kept tied), ``num_parameters``, and the attributes
``transformers.Trainer`` reads.

Why not subclass ``PreTrainedModel``: a fastzoo model keeps its own config (a dataclass
whose fields are checked where configs are made) and its own loading (any checkpoint
format, all or nothing), and ``PreTrainedModel`` would bring a second of each. What
``GenerationMixin`` needs from a model is narrow: a transformers config, a forward with
HF's keywords returning HF's output, ``device``/``dtype``. :class:`_Generator` supplies
exactly that around the fastzoo model, so ``model.generate`` *is* transformers' generate
(same tokens, same sampling for the same seed), not a second sampler.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fastzoo.attention import packing


# transformers' ``attn_implementation`` names -> fastzoo's backends (``set_attn_implementation``,
# ``from_pretrained(attn_implementation=)``); ``config._attn_implementation`` reads it back
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flex_attention": "flex", "flash_attention_2": "fa2",
                "flash_attention_3": "fa3", "flash_attention_4": "fa4"}


def fastzoo_attention(attn_implementation: str) -> str:
    """fastzoo's backend for transformers' ``attn_implementation`` (fastzoo's own names pass)."""
    from fastzoo.attention import list_attention

    if attn_implementation in HF_ATTENTION:
        return HF_ATTENTION[attn_implementation]
    if attn_implementation in list_attention():
        return attn_implementation
    raise ValueError(  # transformers' own words (its tests match them), then fastzoo's
        f'Specified `attn_implementation="{attn_implementation}"` is not supported. fastzoo\'s decoders take '
        f"{', '.join(HF_ATTENTION)} (transformers' names) or a fastzoo backend: {', '.join(list_attention())}")


def layer_cache(cache, seqs, past_length: int = 0):
    """What the attention layers update: ``cache`` itself for a padded batch, else a view that
    keeps it in transformers' padded layout for the unpadded (packed) tokens (:class:`UnpaddedCache`).
    A static cache (``StaticCache``: fixed-size layers) is read through :class:`FilledCache`."""
    if cache is not None and cache.is_compileable:
        cache = FilledCache(cache, past_length + seqs.shape[1])
    if cache is None or seqs.form == "padded":
        return cache
    if seqs.form != "unpadded":
        raise ValueError(f"past_key_values / use_cache: a {seqs.form} batch takes no KV cache (sequences have no rows "
                         "to cache); pass use_cache=False, or give a padded batch with attention_mask")
    return UnpaddedCache(cache, seqs.unpadded, seqs.keys)


class FilledCache:
    """A transformers static cache (``StaticCache``: each layer a fixed ``[B, H, max_cache_len, hd]``
    buffer) seen by the attention layers: :meth:`update` writes the new keys and values into the
    buffer and returns the ``length`` slots written so far (earlier steps + these), so the
    causal alignment and the key padding mask cover exactly the real keys, as with a
    ``DynamicCache``. The unwritten slots are never read. A sliding-window layer
    (``StaticSlidingWindowLayer``) returns at most its window's keys, the newest last, as
    ``DynamicSlidingWindowLayer`` does (the slice leaves them as they are)."""

    def __init__(self, cache, length: int):
        self.cache, self.length = cache, length

    def update(self, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, layer_idx: int):
        k_BHKD, v_BHKD = self.cache.update(k_BHSD, v_BHSD, layer_idx)
        return k_BHKD[:, :, :self.length], v_BHKD[:, :, :self.length]


class UnpaddedCache:
    """A transformers ``Cache`` seen from layers that run on unpadded tokens (a packed-only
    backend, ``varlen`` / ``nested``, given a padded batch).

    The cache keeps transformers' padded layout ``[B, H, past + S, hd]``, so ``DynamicCache``,
    beam search's ``reorder_cache`` and anything else written for HF's cache work unchanged:
    :meth:`update` scatters the new tokens' keys and values into their rows (zeros at padding,
    which the mask hides), appends them, and gathers the real keys of every row back into
    the packed layout the kernel reads with ``ctx.cu_seqlens_k`` (transformers' FlashAttention
    path gathers from its padded cache the same way). Prefill (nothing cached before) returns
    the new keys as they are: they are already every key.
    """

    def __init__(self, cache, queries, keys):
        self.cache, self.queries, self.keys = cache, queries, keys  # keys: packing.Unpadded or None (prefill)

    def update(self, k_1HTD: torch.Tensor, v_1HTD: torch.Tensor, layer_idx: int):
        padded = [packing.repad(x[0].transpose(0, 1), self.queries).transpose(1, 2) for x in (k_1HTD, v_1HTD)]
        k_BHKD, v_BHKD = self.cache.update(*padded, layer_idx)
        if self.keys is None:
            return k_1HTD, v_1HTD
        if k_BHKD.shape[2] != self.keys.seqlen:
            raise ValueError(
                f"past_key_values: layer {layer_idx} of the cache returned {k_BHKD.shape[2]} keys per row, not all "
                "of them (a sliding-window layer: DynamicCache(config=...) or a StaticCache of a windowed model); a "
                "packed-only backend reads every key: pass DynamicCache() without a config, or use a backend with a "
                "padding mask")
        B, H, K, D = k_BHKD.shape
        return [x.transpose(1, 2).reshape(B * K, H, D).index_select(0, self.keys.indices).transpose(0, 1)[None]
                for x in (k_BHKD, v_BHKD)]


class _Generator(nn.Module):
    """transformers' ``GenerationMixin`` bound to a fastzoo model (built on each ``generate``).

    The model is held in a list so that it is not registered as a submodule (nothing here
    owns weights); ``config`` is a ``transformers`` config built from the fastzoo one.
    """

    main_input_name = "input_ids"
    _is_stateful = False
    _supports_cache_class = True

    def __init__(self, model, hf_config, generation_config):
        super().__init__()
        self._model = [model]
        self.config = hf_config
        self.generation_config = generation_config

    @property
    def forward(self):  # GenerationMixin inspects this signature (attention_mask, position_ids, logits_to_keep)
        return self._model[0].forward

    def __call__(self, *args, **kwargs):
        return self._model[0](*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return self._model[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self._model[0].dtype

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @classmethod
    def is_remote_code(cls) -> bool:  # PreTrainedModel's: code from the hub (this is not)
        return False

    def get_experts_implementation(self) -> dict:  # PreTrainedModel's: mixture-of-experts kernels (none here)
        return {}

    def create_masks_for_generate(self, *, attention_mask, **_):
        """What ``generate`` calls to turn the 2-D mask into transformers' 4-D one for a static
        cache: fastzoo's decoders read the 2-D key padding mask (the static cache is read up to
        its written keys, :class:`FilledCache`), so it stays as it is."""
        return attention_mask

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config) -> bool:
        """transformers compiles the forward inside ``generate`` for a static cache with a
        ``compile_config`` (or on an accelerator): refused by name where asked for, never on its own."""
        if generation_config.compile_config is not None and not generation_config.disable_compile:
            raise ValueError(
                "compile_config: generate does not compile fastzoo's forward (its static-cache path reads the keys "
                "written so far, a shape that changes every step); compile the model yourself "
                "(torch.compile(model)) and generate with the default DynamicCache, or leave compile_config None")
        return False


def _generator_class():
    """``_Generator`` with ``GenerationMixin`` mixed in (transformers imported on first use)."""
    global _GENERATOR
    if _GENERATOR is None:
        from transformers.generation import GenerationMixin

        _GENERATOR = type("FastzooGenerator", (_Generator, GenerationMixin), {})
    return _GENERATOR


_GENERATOR = None


def _output_requires_grad(module, args, output):  # a module-level function: the model stays picklable
    output.requires_grad_(True)


class CausalLMConventions:
    """transformers' model API for a fastzoo decoder (mixed into the model class).

    The model provides ``hf_config()`` (a ``transformers`` config of the same
    architecture), ``embedding_path`` (where its token embedding is: ``transformer.wte``),
    ``lm_head``, ``tied_head`` (whether the head is the embedding) and a forward with HF's
    keywords.
    """

    embedding_path: str = "transformer.wte"
    tied_head: bool = True

    supports_gradient_checkpointing = True
    accepts_loss_kwargs = True  # transformers.Trainer passes num_items_in_batch (exact gradient accumulation)
    main_input_name = "input_ids"
    # what transformers' code (and its model tests) reads of a model class to decide what to run on it
    _supports_sdpa = True  # attn_implementation="sdpa": fastzoo's sdpa backend
    _supports_flash_attn = True  # "flash_attention_2/3/4": fastzoo's fa2 / fa3 / fa4 (their devices)
    _supports_flex_attn = True  # "flex_attention": fastzoo's flex (on CPU: inference, refused for a backward)
    _supports_attention_backend = True  # packing read from position_ids / flash kwargs on every backend
    _can_compile_fullgraph = True  # the forward compiles without graph breaks (value checks skipped while compiling)
    _is_stateful = False
    _gradient_checkpointing = False
    _generation_config = None

    # -- attention by transformers' names ---------------------------------------------------
    def set_attention(self, name: str | None, **options):
        out = super().set_attention(name, **options)
        name = self.attn_name  # None asked for the default: the one picked
        # transformers' code reads the backend from the config (HF's name where it has one)
        self.config._attn_implementation = next((hf for hf, fz in HF_ATTENTION.items() if fz == name), name)
        return out

    def set_attn_implementation(self, attn_implementation: str | dict):
        """transformers' switch (``"eager"``, ``"sdpa"``, ``"flex_attention"``, ``"flash_attention_2"`` ...,
        or ``{"": name}``): :meth:`set_attention` with fastzoo's backend of that name, checked first."""
        if isinstance(attn_implementation, dict):
            if set(attn_implementation) != {""}:
                raise ValueError(f"attn_implementation={attn_implementation!r}: a text-only decoder has no "
                                 "sub-models; give a name or {'': name}")
            attn_implementation = attn_implementation[""]
        self.set_attention(fastzoo_attention(attn_implementation))

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    # -- generation ------------------------------------------------------------------------
    @property
    def generation_config(self):
        """transformers ``GenerationConfig``: defaults from the model config (eos/bos/pad ids)."""
        if self._generation_config is None:
            from transformers import GenerationConfig

            self._generation_config = GenerationConfig.from_model_config(self.hf_config())
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value):
        self._generation_config = value

    def generate(self, *args, **kwargs):
        """transformers' ``GenerationMixin.generate`` on this model (greedy, sampling, beam
        search, top-k/top-p, eos/pad, left padding; see transformers' docs). Decoding uses
        the KV cache when the attention backend serves it (``kv_cache`` capability), which
        is checked before the first token: pass ``use_cache=False`` to decode without it."""
        if kwargs.get("use_cache", self.generation_config.use_cache):
            self.check_kv_cache()
            asked = kwargs.get("cache_implementation", self.generation_config.cache_implementation)
            if kwargs.get("past_key_values") is None and asked is None and not self.attention_backend.capabilities.padding_mask:
                from transformers.cache_utils import DynamicCache

                # a packed-only backend reads the cache through UnpaddedCache, which needs every key:
                # no sliding-window layers (transformers' default cache for a windowed config)
                kwargs["past_key_values"] = DynamicCache()
        return self._generator().generate(*args, **kwargs)

    @property
    def prepare_inputs_for_generation(self):
        """transformers' ``GenerationMixin.prepare_inputs_for_generation`` for this model (what
        ``generate`` feeds the forward at each step; its signature is transformers')."""
        return self._generator().prepare_inputs_for_generation

    def _generator(self):
        return _generator_class()(self, self.hf_config(), self.generation_config)

    @classmethod
    def can_generate(cls) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return self.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.get_input_embeddings().weight.dtype

    # -- training plumbing -----------------------------------------------------------------
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, every_n_layers: int = 1,
                                      offload: bool = False):
        """Recompute blocks' activations in the backward (``torch.utils.checkpoint``, non-reentrant
        unless ``gradient_checkpointing_kwargs`` says otherwise): every block, or every
        ``every_n_layers``-th (transformers' Trainer passes it). As in transformers, the KV cache is
        off while training with it. ``offload=True`` (activations kept in CPU memory) is refused."""
        if offload:
            raise ValueError("offload=True: fastzoo's decoders do not offload checkpointed activations; leave it False")
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive int, got {every_n_layers!r}")
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        self.check_checkpointing(non_reentrant=not kwargs["use_reentrant"])
        self._checkpoint_kwargs, self._checkpoint_every = kwargs, every_n_layers
        self._gradient_checkpointing = True

    def gradient_checkpointing_disable(self):
        self._gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self._gradient_checkpointing

    def attention_checkpointed(self) -> bool:
        return self._gradient_checkpointing and not self._checkpoint_kwargs["use_reentrant"]

    def enable_input_require_grads(self):
        """transformers' (PEFT calls it with gradient checkpointing): the token embeddings'
        output requires grad, so frozen embeddings still give the blocks a gradient path."""
        self.disable_input_require_grads()
        self._require_grads_hook = self.get_input_embeddings().register_forward_hook(_output_requires_grad)

    def disable_input_require_grads(self):
        hook = self.__dict__.pop("_require_grads_hook", None)
        if hook is not None:
            hook.remove()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.get_submodule(self.embedding_path)

    def set_input_embeddings(self, value: nn.Embedding):
        parent, _, name = self.embedding_path.rpartition(".")
        setattr(self.get_submodule(parent), name, value)
        self.tie_weights()  # a tied head stays tied
        self.config.vocab_size = value.num_embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def tie_weights(self) -> None:
        """A tied LM head is the token embedding again (transformers' name)."""
        if self.tied_head:
            self.lm_head.weight = self.get_input_embeddings().weight

    def _apply(self, fn, recurse=True):
        # torch converts a parameter it cannot swap in place (meta -> a device: ``to_empty``, the
        # big-model init) into a new Parameter per module, which unties the head: tie it again
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """Grow or shrink the vocabulary, keeping a tied LM head tied (an untied one is resized
        alike). New rows start at the mean of the old ones (``mean_resizing``, transformers'
        default spirit: a new token starts as an average one), else from N(0, initializer_range)."""
        old = self.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return old
        if new_num_tokens is not None and (isinstance(new_num_tokens, bool) or not isinstance(new_num_tokens, int)):
            raise ValueError(f"new_num_tokens must be an int, got {new_num_tokens!r}")
        n = old.num_embeddings if new_num_tokens is None else new_num_tokens
        if n <= 0:
            raise ValueError(f"new_num_tokens must be positive, got {new_num_tokens}")
        if pad_to_multiple_of is not None:
            if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int):
                raise ValueError(  # transformers' own words (code written for it may match them)
                    f"pad_to_multiple_of: Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, "
                    "which is not and integer. Please make sure to pass an integer")
            if pad_to_multiple_of <= 0:
                raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of}")
            n = math.ceil(n / pad_to_multiple_of) * pad_to_multiple_of
        new = nn.Embedding(n, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype)
        new.weight = self._resized(old.weight, n, mean_resizing)
        if not self.tied_head:
            self.lm_head.weight = self._resized(self.lm_head.weight, n, mean_resizing)
            self.lm_head.out_features = n
        self.set_input_embeddings(new)
        return new

    def _resized(self, old: nn.Parameter, n: int, mean_resizing: bool) -> nn.Parameter:
        """``old`` ([vocab, D]) with ``n`` rows: the first kept, new ones as resize_token_embeddings says."""
        new = torch.empty(n, old.shape[1], device=old.device, dtype=old.dtype)
        keep = min(n, old.shape[0])
        with torch.no_grad():
            if n > keep:
                if mean_resizing:
                    new[keep:] = old.mean(0)
                else:
                    new[keep:].normal_(std=self.config.initializer_range)
            new[:keep] = old[:keep]
        return nn.Parameter(new, requires_grad=old.requires_grad)

    @property
    def vocab_size(self) -> int:
        """The vocabulary's size (transformers sets ``model.vocab_size`` when it resizes)."""
        return self.config.vocab_size

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (a tied head is the embedding), as transformers counts;
        ``exclude_embeddings`` leaves out every ``nn.Embedding`` (token and position tables)."""
        params = {id(p): p for p in self.parameters() if p.requires_grad or not only_trainable}
        if exclude_embeddings:
            for emb in self.modules():
                if isinstance(emb, nn.Embedding):
                    params.pop(id(emb.weight), None)
        return sum(p.numel() for p in params.values())
