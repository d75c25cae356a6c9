"""Token-sequence inputs of a decoder, in every form a user has them, read into one layout.

A decoder's forward gets token ids (or embeddings) in one of these forms:

- **padded**: ``[B, S]`` rows, optional ``attention_mask[B, S]`` (1 = token, 0 = padding);
  each row is one causal sequence. With a KV cache the mask covers ``past + S`` keys.
- **packed**: one row ``[1, T]`` plus ``cu_seqlens[N+1]`` (int32 offsets) and optionally
  ``max_seqlen``; or the same under FlashAttention's names from transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: ``cu_seq_lens_q/k``,
  ``max_length_q/k``. Sequences attend only inside their span.
- **HF-flattened**: ``position_ids`` that restart (each step other than +1 starts a new
  sequence, transformers' rule) with no ``attention_mask``: packed, boundaries read from the
  positions; a ``[B, S]`` batch of such rows is flattened to one row. With an
  ``attention_mask`` a restart is refused: a padded batch never turns into cross-sequence
  attention.
- **nested**: a jagged NestedTensor of ids ``[B, j]``: run packed, returned jagged.

:func:`read_sequences` checks the inputs (shapes for free; values by one fused device
computation read back once: one device sync per forward, skipped while compiling) and
returns :class:`Sequences`: what the layers run on (tokens, positions, the
:class:`~fastzoo.attention.base.AttnContext`) and how results go back to the input's layout
(:meth:`Sequences.restore`). A padded batch for a backend that takes packed sequences but
no padding mask is unpadded here, once per forward, so everything between the attention
layers skips the padding too. :meth:`Sequences.next_token_targets` shifts ``labels`` the
same way, never across a sequence boundary.

With a KV cache the cache keeps transformers' padded layout (``[B, H, past + S, D]``, what
``DynamicCache``, beam search's reordering and HF's tools expect). For a packed-only
backend the new tokens are unpadded as above, and the keys are the real tokens of the
cached + new mask (:attr:`Sequences.keys`): the context then carries the keys' own offsets
(``cu_seqlens_k``), each sequence's new tokens being the last of its keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastzoo.attention import packing
from fastzoo.attention.base import AttnContext, Capabilities, check_offsets
from fastzoo.losses.lm import IGNORE_INDEX, next_token_targets
from fastzoo.tracing import tracing


@dataclass
class Sequences:
    """What the layers run on, and how to give results back in the input's layout."""

    tokens: torch.Tensor  # ids [b, s] or embeddings [b, s, D] in the layers' layout
    positions: torch.Tensor  # [b or 1, s]
    ctx: AttnContext
    shape: tuple[int, int]  # (B, S) of the input (nested: (B, T))
    form: str  # "padded" | "packed" | "unpadded" | "flattened" | "nested"
    boundaries: torch.Tensor | None = None  # int32 offsets of the sequences over the flattened input tokens
    unpadded: packing.Unpadded | None = None
    keys: packing.Unpadded | None = None  # "unpadded" with a KV cache: where the real keys are in [B, past + S]
    offsets: torch.Tensor | None = None  # nested input: its offsets

    def to_layers(self, t_BS: torch.Tensor) -> torch.Tensor:
        """A per-token input tensor (``token_type_ids``) moved to the layers' layout."""
        if self.form == "nested":
            return t_BS.values()[None]
        if self.form == "flattened":
            return t_BS.reshape(1, -1)
        if self.form == "unpadded":
            return t_BS.reshape(-1, *t_BS.shape[2:]).index_select(0, self.unpadded.indices)[None]
        return t_BS

    def restore(self, x_bsX: torch.Tensor) -> torch.Tensor:
        """Per-token results of the layers (hidden states, logits) in the input's layout."""
        if self.form == "nested":
            return torch.nested.nested_tensor_from_jagged(x_bsX[0], offsets=self.offsets)
        if self.form == "flattened":
            return x_bsX.reshape(*self.shape, *x_bsX.shape[2:])
        if self.form == "unpadded":
            return packing.repad(x_bsX[0], self.unpadded)
        return x_bsX

    def next_token_targets(self, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """``[N]`` target of each token the layers see: the label of the next token of the
        same sequence (:func:`fastzoo.losses.lm.next_token_targets`), ``ignore_index`` at each
        sequence's end and at padding (which predicts nothing, whatever its label's neighbour)."""
        if self.form == "nested":
            if not labels.is_nested or not torch.equal(labels.offsets(), self.offsets):
                raise ValueError("labels: with NestedTensor input_ids, give NestedTensor labels of the same lengths")
            labels = labels.values()[None]
        elif labels.shape != torch.Size(self.shape):
            raise ValueError(f"labels must have the shape of input_ids {tuple(self.shape)}, got {tuple(labels.shape)}")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise ValueError(f"labels must be an integer tensor (token ids, {ignore_index} = ignored), got {labels.dtype}")
        labels = labels.long()
        if self.boundaries is not None:  # packed forms: shift along the flattened tokens, cut at the ends
            return next_token_targets(labels.reshape(1, -1), cu_seqlens=self.boundaries, ignore_index=ignore_index)[0]
        targets_BS = next_token_targets(labels, ignore_index=ignore_index)
        if self.form == "padded" and self.ctx.key_padding_mask is not None:
            # a padding position predicts nothing, as in the unpadded form (where it is not run at all):
            # its output is a fully masked attention row (left padding), whose value each kernel defines its own way
            queries_BS = self.ctx.key_padding_mask[:, -targets_BS.shape[1]:]
            targets_BS = targets_BS.masked_fill(~queries_BS, ignore_index)
        if self.form == "unpadded":
            return targets_BS.reshape(-1).index_select(0, self.unpadded.indices)
        return targets_BS.reshape(-1)


def read_sequences(
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    past_length: int = 0,
    n_positions: int | None,
    vocab_size: int,
    backend: Capabilities,
    attn: dict,
) -> Sequences:
    """Check a decoder's inputs and read them into :class:`Sequences`.

    ``past_length``: tokens already in a KV cache (padded forms only; positions continue
    from there and the mask covers them too). ``n_positions``: the longest position a
    learned position table holds (None: positions are not bounded, rotary). ``backend``: the attention backend's
    capabilities (a padded batch is unpadded for packed-only backends). ``attn``: what
    every layer's context shares (``scale``, ``dropout_p``).
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    x = input_ids if input_ids is not None else inputs_embeds
    if x.is_nested:
        if input_ids is None:
            raise ValueError("inputs_embeds: NestedTensor embeddings are not supported; pass NestedTensor input_ids")
        return _read_nested(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen, past_length,
                            n_positions=n_positions, vocab_size=vocab_size, backend=backend, attn=attn)
    if input_ids is not None:
        _check_ids(input_ids)
    elif inputs_embeds.ndim != 3 or not inputs_embeds.dtype.is_floating_point:
        raise ValueError(f"inputs_embeds must be a float tensor [B, S, D], got {inputs_embeds.dtype} {tuple(inputs_embeds.shape)}")
    B, S = x.shape[:2]
    packed = cu_seqlens is not None
    if packed:
        if attention_mask is not None:
            raise ValueError("attention_mask: a packed batch (cu_seqlens given) has no padding; leave attention_mask None")
        if past_length:
            raise ValueError("past_key_values: a packed batch (cu_seqlens) takes no KV cache")
        _check_cu_seqlens_shape(cu_seqlens, B)
    elif max_seqlen is not None:
        raise ValueError("max_seqlen goes with cu_seqlens (packed batches); a padded batch has no use for it")
    else:
        _check_mask_shape(attention_mask, B, S + past_length)
    if position_ids is not None:
        _check_positions_shape(position_ids, B, S)
    elif not packed and n_positions is not None:
        _check_length(S + past_length, n_positions, past_length)
    mask_BK = None if attention_mask is None else attention_mask.bool()
    mask_BS = None if mask_BK is None else mask_BK[:, past_length:]
    unpad = mask_BS is not None and not backend.padding_mask and backend.varlen
    # with a KV cache, the keys of the rows that have new tokens (a row with none has no query)
    keys_BK = None
    if unpad and past_length:
        keys_BK = mask_BK & mask_BS.any(dim=1, keepdim=True)
    # HF-flattened rows: positions restarting with no mask (and no cache) are packed sequences
    maybe_flat = not packed and mask_BK is None and position_ids is not None and not past_length and S > 1
    read = {}
    if not tracing():  # values: one fused device computation, one host read
        read = _check_values(input_ids, mask_BS, attention_mask, position_ids, cu_seqlens, max_seqlen, unpad,
                             maybe_flat, B, S, n_positions=n_positions, vocab_size=vocab_size, keys_BK=keys_BK)
    if x.numel() == 0 or B * S == 0:  # no tokens: nothing to attend over
        pos = torch.zeros(1, S, dtype=torch.long, device=x.device)
        return Sequences(x, pos, AttnContext(causal=True, **attn), (B, S), "padded")
    if packed:
        if max_seqlen is None:
            max_seqlen = read.get("longest_sequence")  # else the backend reads it once per forward
        if position_ids is None:
            position_ids = positions_from_cu_seqlens(cu_seqlens, S)[None]
        ctx = AttnContext(causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **attn)
        return Sequences(x, position_ids, ctx, (B, S), "packed", boundaries=cu_seqlens)
    if maybe_flat and (read.get("sequence_starts", 0) > B or tracing() and B == 1):
        return _read_flattened(x, position_ids, read, B, S, attn)
    if position_ids is None:
        position_ids = torch.arange(past_length, past_length + S, device=x.device)[None]
    if unpad:
        sizes = (read["tokens"], read["rows"], read["longest_row"]) if read else None
        info, (tokens, pos) = packing.unpad(mask_BS, x, position_ids.expand(B, S), sizes=sizes)
        keys = None
        if keys_BK is not None:
            key_sizes = (read["key_tokens"], read["rows"], read["longest_key_row"]) if read else None
            keys, _ = packing.unpad(keys_BK, sizes=key_sizes)
            attn = {**attn, "cu_seqlens_k": keys.cu_seqlens, "max_seqlen_k": keys.max_seqlen}
        ctx = AttnContext(causal=True, cu_seqlens=info.cu_seqlens, max_seqlen=info.max_seqlen, **attn)
        return Sequences(tokens[None], pos[None], ctx, (B, S), "unpadded", unpadded=info, keys=keys)
    ctx = AttnContext(causal=True, key_padding_mask=mask_BK, **attn)
    return Sequences(x, position_ids, ctx, (B, S), "padded")


def _read_flattened(x, position_ids, read, B, S, attn) -> Sequences:
    """Rows whose positions restart hold several sequences: one packed row, boundaries
    where the position does not step by +1 (transformers' ``find_packed_sequence_indices``)
    and at every row start."""
    p_T = position_ids.expand(B, S).reshape(-1).long()
    starts_T = _sequence_starts(position_ids.expand(B, S)).reshape(-1)
    n = read.get("sequence_starts")
    starts = torch.nonzero_static(starts_T, size=n).squeeze(1) if n is not None else starts_T.nonzero().squeeze(1)
    cu = F.pad(starts.to(torch.int32), (0, 1), value=B * S)
    longest = read.get("longest_flat")
    ctx = AttnContext(causal=True, cu_seqlens=cu, max_seqlen=longest, **attn)
    tokens = x.reshape(1, B * S, *x.shape[2:])
    return Sequences(tokens, p_T[None], ctx, (B, S), "flattened" if B > 1 else "packed", boundaries=cu)


def _read_nested(ids, attention_mask, position_ids, cu_seqlens, max_seqlen, past_length, **kw) -> Sequences:
    if ids.layout != torch.jagged or ids.dim() != 2:
        raise ValueError("input_ids: a NestedTensor must be jagged (layout=torch.jagged) with shape [B, j]")
    if attention_mask is not None or cu_seqlens is not None or max_seqlen is not None:
        raise ValueError("a NestedTensor input_ids carries its own lengths: leave attention_mask, cu_seqlens, max_seqlen None")
    if past_length:
        raise ValueError("past_key_values: NestedTensor input takes no KV cache")
    if ids.lengths() is not None:
        raise ValueError("input_ids: a NestedTensor with holes (lengths) is not supported; build it from whole sequences")
    offsets = ids.offsets()
    pos = None
    if position_ids is not None:
        if not position_ids.is_nested or not torch.equal(position_ids.offsets(), offsets):
            raise ValueError("position_ids: with NestedTensor input_ids, give a NestedTensor of the same lengths")
        pos = position_ids.values()[None]
    seqs = read_sequences(ids.values()[None], position_ids=pos, cu_seqlens=offsets.to(torch.int32), **kw)
    seqs.form, seqs.offsets, seqs.shape = "nested", offsets, (ids.size(0), ids.values().shape[0])
    return seqs


# -- checks (clear errors before any kernel sees bad indices) ----------------------------------
def _check_values(ids, mask_BS, attention_mask, position_ids, cu_seqlens, max_seqlen, unpad, maybe_flat, B, S,
                  *, n_positions, vocab_size, keys_BK=None) -> dict:
    """Every value check of a forward as one device computation and one host read; raises
    ValueError naming the argument. Returns the numbers read (sizes the forward needs)."""
    stats = {}
    if ids is not None and ids.numel():
        stats["ids_min"], stats["ids_max"] = ids.min(), ids.max()
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.numel():
        stats["mask_not_01"] = ((attention_mask != 0) & (attention_mask != 1)).any()
    if position_ids is not None and B * S:
        p_BS = position_ids.expand(B, S).long()
        real_BS = torch.ones_like(p_BS, dtype=torch.bool) if mask_BS is None else mask_BS
        big = torch.iinfo(torch.int64).max  # sentinels: padding never decides the range
        stats["pos_min"] = torch.where(real_BS, p_BS, big).min()
        stats["pos_max"] = torch.where(real_BS, p_BS, -big).max()
        if maybe_flat:
            starts = _sequence_starts(p_BS)
            stats["sequence_starts"] = starts.sum()
            stats["longest_flat"] = _longest_run(starts.reshape(-1))
        elif cu_seqlens is None and mask_BS is not None:
            stats["pos_restart"] = _position_restarts(p_BS, mask_BS).any()
    if cu_seqlens is not None:
        cu = cu_seqlens.to(position_ids.device if ids is None and position_ids is not None else cu_seqlens.device)
        lengths = cu[1:] - cu[:-1]
        stats.update(cu_first=cu[0], cu_last=cu[-1], shortest_sequence=lengths.min(), longest_sequence=lengths.max())
    if unpad and mask_BS.numel():
        stats.update(zip(("tokens", "rows", "longest_row"), packing.mask_sizes(mask_BS)))
        if keys_BK is not None:  # the same rows: a row with a new token has that key
            stats.update(zip(("key_tokens", "key_rows", "longest_key_row"), packing.mask_sizes(keys_BK)))
    if not stats:
        return {}
    device = next(iter(stats.values())).device
    read = dict(zip(stats, torch.stack([t.long().to(device) for t in stats.values()]).tolist()))  # the one host read

    V, n = vocab_size, n_positions
    if "ids_min" in read and (read["ids_min"] < 0 or read["ids_max"] >= V):
        raise ValueError(f"input_ids must lie in [0, {V}) (vocab_size), got values in [{read['ids_min']}, {read['ids_max']}]")
    if read.get("mask_not_01"):
        raise ValueError("attention_mask must hold 0/1 (or bool): 1 = token, 0 = padding")
    if "cu_first" in read:
        check_offsets("cu_seqlens", read["cu_first"], read["shortest_sequence"], read["cu_last"], S,
                              "tokens in input_ids: T")
        if max_seqlen is not None and int(max_seqlen) < read["longest_sequence"]:
            raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest packed sequence ({read['longest_sequence']})")
        if position_ids is None and n is not None and read["longest_sequence"] > n:
            raise ValueError(
                f"cu_seqlens holds a sequence of {read['longest_sequence']} tokens; this model has n_positions={n}: "
                f"split longer sequences (positions would run past the position table)"
            )
    has_real = read.get("pos_min", 0) <= read.get("pos_max", -1)
    if has_real and (read["pos_min"] < 0 or n is not None and read["pos_max"] >= n):
        where = f"lie in [0, {n}) (n_positions={n})" if n is not None else "be >= 0"
        raise ValueError(f"position_ids must {where}, got values in [{read['pos_min']}, {read['pos_max']}]")
    if read.get("pos_restart"):
        row = int(_position_restarts(position_ids.expand(B, S).long(), mask_BS).any(1).nonzero()[0])
        raise ValueError(
            f"position_ids restart or go back inside row {row} of a padded batch (attention_mask given): several "
            "sequences in one row would attend to each other. For packed sequences pass cu_seqlens "
            "(fastzoo.data.pack builds it), or leave attention_mask None (transformers' flattened packing)."
        )
    return read


def _sequence_starts(p_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] True where a sequence starts: each row's first token, and wherever the
    position does not step by +1 from the previous token (transformers' packing rule)."""
    p_BS = p_BS.long()
    starts = torch.ones_like(p_BS, dtype=torch.bool)
    starts[:, 1:] = (p_BS[:, 1:] - p_BS[:, :-1]) != 1
    return starts


def _longest_run(starts_T: torch.Tensor) -> torch.Tensor:
    """Length of the longest sequence, given the [T] start flags (the first is True)."""
    T = starts_T.numel()
    idx = torch.arange(T, device=starts_T.device)
    last_start = torch.where(starts_T, idx, 0).cummax(0).values
    return (idx - last_start + 1).max()


def _position_restarts(p_BS: torch.Tensor, mask) -> torch.Tensor:
    """[B, S] True where a real token's position does not grow along its row. In a padded
    batch a restart means several sequences share a row: they would attend to each other."""
    if mask is not None:
        p_BS = p_BS.masked_fill(~mask, -1)
    prev_BS = F.pad(p_BS.cummax(dim=1).values[:, :-1], (1, 0), value=-1)
    back = p_BS <= prev_BS
    return back & mask if mask is not None else back


def _check_ids(input_ids: torch.Tensor) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor [B, S], got {type(input_ids).__name__}")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, S] (packed: [1, T]), got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")


def _check_length(total: int, n_positions: int, past_length: int) -> None:
    if tracing():
        torch._check(total <= n_positions, lambda: f"input_ids: {total} positions; n_positions={n_positions}")
    elif total > n_positions:
        cached = f" ({past_length} in the KV cache)" if past_length else ""
        raise ValueError(f"input_ids reach position {total - 1}{cached}; this model has n_positions={n_positions}")


def _check_positions_shape(position_ids, B: int, S: int) -> None:
    if not isinstance(position_ids, torch.Tensor):
        raise ValueError(f"position_ids must be a torch.Tensor [B, S], got {type(position_ids).__name__}")
    if position_ids.is_nested or position_ids.dtype.is_floating_point or position_ids.dtype.is_complex \
            or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be an integer tensor like input_ids, got {position_ids.dtype}")
    if position_ids.ndim != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids must be [{B}, {S}] (or [1, {S}]) like input_ids, got {tuple(position_ids.shape)}")


def _check_mask_shape(attention_mask, B: int, K: int) -> None:
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a torch.Tensor [B, S], got {type(attention_mask).__name__}")
    if attention_mask.ndim == 4:
        raise ValueError(
            "attention_mask: a 4-D mask (a custom attention pattern, e.g. a shared prefix) is not supported; fastzoo's "
            "decoders take the 2-D padding mask [B, S] (1 = token), packed sequences (cu_seqlens, or position_ids "
            "restarting per sequence), and flex's mask_mod for other patterns")
    if tuple(attention_mask.shape) != (B, K):
        raise ValueError(f"attention_mask must be [{B}, {K}] (batch, cached + new tokens), got {tuple(attention_mask.shape)}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(f"attention_mask must hold 0/1 (or bool): 1 = token, 0 = padding; got {attention_mask.dtype}")


def _check_cu_seqlens_shape(cu_seqlens, batch: int) -> None:
    """Packed-batch metadata that can be checked without reading values."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor [N+1], got a {type(cu_seqlens).__name__}: "
            "pass torch.tensor(cu_seqlens, dtype=torch.int32)"
        )
    if batch != 1:
        raise ValueError(
            f"cu_seqlens: a packed batch is input_ids[1, T], got batch size {batch}; "
            "pack all sequences into one row (fastzoo.data.pack) or drop cu_seqlens for a padded batch"
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [N+1], got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] position of each token inside its packed sequence (0, 1, ... restarting per sequence)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths, output_size=total)
