"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners").

Follows Hugging Face's ``GPT2LMHeadModel`` with nanoGPT's module layout: token and learned
position embeddings, pre-LN blocks (``ln_1`` -> attention -> residual, ``ln_2`` -> MLP ->
residual), a tanh-GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
Module names are HF's (``transformer.h.N.attn.c_attn`` ...), so HF weights load by renaming
plus four transposes (HF's ``Conv1D`` stores ``[in, out]``, ``nn.Linear`` ``[out, in]``).

One model, three input forms (see :meth:`GPT2LMHeadModel.forward`):

- padded ``input_ids[B, S]`` (+ ``attention_mask``): each row is one causal sequence;
- packed ``input_ids[1, T]`` + ``cu_seqlens``: sequences attend only inside their span;
- a jagged NestedTensor of ids: run packed, logits returned as a jagged NestedTensor.

Only ``cu_seqlens`` (or a NestedTensor) makes a batch packed: position ids never change
what attends to what, so a padded batch can never turn into cross-sequence attention, and
position ids that restart inside a padded row (packed data without its ``cu_seqlens``) are
refused. Inputs are validated before any kernel sees them: shapes and dtypes for free, and
values (ids, positions, offsets, mask) by one fused device computation read back at once,
one device sync per forward. Under ``torch.compile`` the value checks are skipped (a host
read would split the graph); run a step eagerly to have them. Inputs with no tokens
(``S == 0``) give empty logits ``[B, 0, vocab_size]``.

A padded batch given to a backend that takes packed sequences but no padding mask
(``varlen``, ``nested``, ``fa2``, ``fa3``, ``te``, ``xformers``) is unpadded into a packed one
once per forward, so the MLPs skip the padding too, and the logits are scattered back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.attention import packing
from fastzoo.attention.base import AttnContext
from fastzoo.layers.attention import UsesAttention
from fastzoo.models.base import FastzooModel, ModelConfig

# HF ACT2FN names -> the function. "gelu_new" is OpenAI's tanh approximation.
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass
class GPT2Config(ModelConfig):
    """HF ``GPT2Config`` field names and defaults (the fields that change the function)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    def __post_init__(self):
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"activation_function={self.activation_function!r}: choose one of {', '.join(ACTIVATIONS)}")


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
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = cfg.attn_pdrop
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)
        self.scale = attn_scale(cfg, layer_idx)

    def forward(self, x_BSC: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, S, C = x_BSC.shape
        q_BSC, k_BSC, v_BSC = self.c_attn(x_BSC).split(C, dim=2)
        q_BHSD, k_BHSD, v_BHSD = (t.view(B, S, self.n_head, self.head_dim).transpose(1, 2) for t in (q_BSC, k_BSC, v_BSC))
        o_BHSD = self.attend(q_BHSD, k_BHSD, v_BHSD, ctx, scale=self.scale)
        return self.resid_dropout(self.c_proj(o_BHSD.transpose(1, 2).reshape(B, S, C)))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.act = ACTIVATIONS[cfg.activation_function]
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

    def forward(self, x_BSC, ctx: AttnContext):
        x_BSC = x_BSC + self.attn(self.ln_1(x_BSC), ctx)
        return x_BSC + self.mlp(self.ln_2(x_BSC))


class GPT2LMHeadModel(FastzooModel):
    family = "gpt2"
    config_class = GPT2Config

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),
            drop=nn.Dropout(cfg.embd_pdrop),
            h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in every GPT-2 checkpoint
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
        # is fastzoo's own opt-in form: a backend without varlen is refused per call (check_call).
        return {"head_dim": self.config.n_embd // self.config.n_head, "causal": True, "grid_2d": False,
                "padding_mask": True, "unpads": True}

    # -- forward ---------------------------------------------------------------------------
    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None):
        """Logits ``[B, S, vocab_size]`` (a jagged NestedTensor ``[B, j, vocab_size]`` for nested ids).

        - padded: ``input_ids[B, S]``, ``attention_mask[B, S]`` (1 = token, 0 = padding).
          Without ``position_ids`` the positions are ``0..S-1`` in every row, as HF's forward
          does; for left padding pass ``position_ids`` counting real tokens
          (``fastzoo.data.pad_to_longest(..., side="left")`` returns them).
        - packed: ``input_ids[1, T]``, ``cu_seqlens[N+1]`` (int32 offsets, 0 ... T),
          ``max_seqlen`` (longest sequence; computed if None), ``position_ids[1, T]``
          (restarting at 0 in each sequence; computed if None).
        - nested: a jagged NestedTensor of ids ``[B, j]`` (and optionally position ids in the
          same layout); nothing else.
        """
        if input_ids.is_nested:
            return self._forward_nested(input_ids, attention_mask, position_ids, cu_seqlens, max_seqlen)
        # shapes and dtypes: free
        _check_ids(input_ids)
        B, S = input_ids.shape
        packed = cu_seqlens is not None
        if packed:
            if attention_mask is not None:
                raise ValueError("attention_mask: a packed batch (cu_seqlens given) has no padding; leave attention_mask None")
            _check_cu_seqlens_shape(cu_seqlens, input_ids)
        elif max_seqlen is not None:
            raise ValueError("max_seqlen goes with cu_seqlens (packed batches); a padded batch has no use for it")
        else:
            _check_mask_shape(attention_mask, input_ids)
        if position_ids is not None:
            _check_positions_shape(position_ids, input_ids)
        elif not packed and S > self.config.n_positions:
            raise ValueError(f"input_ids has {S} tokens per row; this model has n_positions={self.config.n_positions}")
        mask = None if attention_mask is None else attention_mask.bool()
        backend = self.attention_backend
        unpad = mask is not None and not backend.capabilities.padding_mask and backend.capabilities.varlen
        # values: one fused device computation, one host read (skipped while compiling)
        read = {}
        if not torch.compiler.is_compiling():
            read = self._check_values(input_ids, attention_mask, mask, position_ids, cu_seqlens, max_seqlen, unpad)
        if input_ids.numel() == 0:  # no tokens: nothing to attend over
            return self.lm_head.weight.new_zeros(B, S, self.config.vocab_size)
        if packed:
            if max_seqlen is None:
                max_seqlen = read.get("longest_sequence")  # else the backend reads it once per forward
            if position_ids is None:
                position_ids = positions_from_cu_seqlens(cu_seqlens, S)[None]
            ctx = AttnContext(causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **self._attn_ctx_args())
            return self.lm_head(self._hidden(input_ids, position_ids, ctx))
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device)[None]
        if unpad:
            sizes = (read["tokens"], read["rows"], read["longest_row"]) if read else None
            return self._forward_unpadded(input_ids, mask, position_ids, sizes)
        ctx = AttnContext(causal=True, key_padding_mask=mask, **self._attn_ctx_args())
        return self.lm_head(self._hidden(input_ids, position_ids, ctx))

    def _attn_ctx_args(self) -> dict:
        """What every layer shares (layers with their own scale derive a copy)."""
        return {"scale": attn_scale(self.config, 0), "dropout_p": self.config.attn_pdrop if self.training else 0.0}

    def _check_values(self, ids, attention_mask, mask, position_ids, cu_seqlens, max_seqlen, unpad) -> dict:
        """Every value check of a forward as one device computation and one host read; raises
        ValueError naming the argument. Returns the numbers read (sizes the forward needs)."""
        stats = {}
        if ids.numel():
            stats["ids_min"], stats["ids_max"] = ids.min(), ids.max()
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            stats["mask_not_01"] = ((attention_mask != 0) & (attention_mask != 1)).any()
        if position_ids is not None and ids.numel():
            p_BS = position_ids.expand(ids.shape).long()
            real_BS = torch.ones_like(p_BS, dtype=torch.bool) if mask is None else mask
            big = torch.iinfo(torch.int64).max  # sentinels: padding never decides the range
            stats["pos_min"] = torch.where(real_BS, p_BS, big).min()
            stats["pos_max"] = torch.where(real_BS, p_BS, -big).max()
            if cu_seqlens is None:
                stats["pos_restart"] = _position_restarts(p_BS, mask).any()
        if cu_seqlens is not None:
            cu = cu_seqlens.to(ids.device)
            lengths = cu[1:] - cu[:-1]
            stats.update(cu_first=cu[0], cu_last=cu[-1], shortest_sequence=lengths.min(), longest_sequence=lengths.max())
        if unpad and mask.numel():
            stats.update(zip(("tokens", "rows", "longest_row"), packing.mask_sizes(mask)))
        if not stats:
            return {}
        read = dict(zip(stats, torch.stack([t.long() for t in stats.values()]).tolist()))  # the one host read

        V, n = self.config.vocab_size, self.config.n_positions
        if "ids_min" in read and (read["ids_min"] < 0 or read["ids_max"] >= V):
            raise ValueError(f"input_ids must lie in [0, {V}) (vocab_size), got values in [{read['ids_min']}, {read['ids_max']}]")
        if read.get("mask_not_01"):
            raise ValueError("attention_mask must hold 0/1 (or bool): 1 = token, 0 = padding")
        if "cu_first" in read:
            if read["cu_first"] != 0:
                raise ValueError(f"cu_seqlens must start at 0, got {read['cu_first']}")
            if read["shortest_sequence"] <= 0:
                raise ValueError(f"cu_seqlens must be strictly increasing, got {cu_seqlens.tolist()}")
            if read["cu_last"] != ids.shape[1]:
                raise ValueError(f"cu_seqlens must end at T={ids.shape[1]} (the number of tokens in input_ids), got {read['cu_last']}")
            if max_seqlen is not None and int(max_seqlen) < read["longest_sequence"]:
                raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest packed sequence ({read['longest_sequence']})")
        has_real = read.get("pos_min", 0) <= read.get("pos_max", -1)
        if has_real and (read["pos_min"] < 0 or read["pos_max"] >= n):
            raise ValueError(
                f"position_ids must lie in [0, {n}) (n_positions={n}), got values in [{read['pos_min']}, {read['pos_max']}]"
            )
        if read.get("pos_restart"):
            row = int(_position_restarts(position_ids.expand(ids.shape).long(), mask).any(1).nonzero()[0])
            raise ValueError(
                f"position_ids restart or go back inside row {row} of a padded batch: several sequences in one row would "
                "attend to each other. For packed sequences pass cu_seqlens (fastzoo.data.pack builds it)."
            )
        return read

    def _hidden(self, ids_BS, pos_BS, ctx: AttnContext) -> torch.Tensor:
        t = self.transformer
        x_BSC = t.drop(t.wte(ids_BS) + t.wpe(pos_BS))
        for block in t.h:
            x_BSC = block(x_BSC, ctx)
        return t.ln_f(x_BSC)

    def _forward_unpadded(self, ids_BS, mask_BS, pos_BS, sizes):
        """A padded batch through a packed-only backend: real tokens are packed (one sequence
        per row, in order), run packed, and scattered back; padding positions get zeros."""
        info, (ids_T, pos_T) = packing.unpad(mask_BS, ids_BS, pos_BS.expand(ids_BS.shape), sizes=sizes)
        if info.indices.numel() == 0:  # every row is padding: no sequence to run
            return self.lm_head.weight.new_zeros(*ids_BS.shape, self.config.vocab_size)
        ctx = AttnContext(causal=True, cu_seqlens=info.cu_seqlens, max_seqlen=info.max_seqlen, **self._attn_ctx_args())
        return packing.repad(self.lm_head(self._hidden(ids_T[None], pos_T[None], ctx))[0], info)

    def _forward_nested(self, ids, attention_mask, position_ids, cu_seqlens, max_seqlen):
        if ids.layout != torch.jagged or ids.dim() != 2:
            raise ValueError("input_ids: a NestedTensor must be jagged (layout=torch.jagged) with shape [B, j]")
        if attention_mask is not None or cu_seqlens is not None or max_seqlen is not None:
            raise ValueError("a NestedTensor input_ids carries its own lengths: leave attention_mask, cu_seqlens, max_seqlen None")
        if ids.lengths() is not None:
            raise ValueError("input_ids: a NestedTensor with holes (lengths) is not supported; build it from whole sequences")
        offsets = ids.offsets()
        pos = None
        if position_ids is not None:
            if not position_ids.is_nested or not torch.equal(position_ids.offsets(), offsets):
                raise ValueError("position_ids: with NestedTensor input_ids, give a NestedTensor of the same lengths")
            pos = position_ids.values()[None]
        logits_1TV = self(ids.values()[None], position_ids=pos, cu_seqlens=offsets.to(torch.int32))
        return torch.nested.nested_tensor_from_jagged(logits_1TV[0], offsets=offsets)



# -- input checks (clear errors before any kernel sees bad indices) ------------------------------
def _check_ids(input_ids: torch.Tensor) -> None:
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, S] (packed: [1, T]), got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")


def _check_positions_shape(position_ids, input_ids) -> None:
    B, S = input_ids.shape
    if position_ids.is_nested or position_ids.dtype.is_floating_point or position_ids.dtype.is_complex \
            or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be an integer tensor like input_ids, got {position_ids.dtype}")
    if position_ids.ndim != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids must be [{B}, {S}] (or [1, {S}]) like input_ids, got {tuple(position_ids.shape)}")


def _position_restarts(p_BS: torch.Tensor, mask) -> torch.Tensor:
    """[B, S] True where a real token's position does not grow along its row. In a padded
    batch a restart means several sequences share a row: without cu_seqlens they would
    attend to each other."""
    if mask is not None:
        p_BS = p_BS.masked_fill(~mask, -1)
    prev_BS = F.pad(p_BS.cummax(dim=1).values[:, :-1], (1, 0), value=-1)
    back = p_BS <= prev_BS
    return back & mask if mask is not None else back


def _check_mask_shape(attention_mask, input_ids) -> None:
    if attention_mask is None:
        return
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(f"attention_mask must hold 0/1 (or bool): 1 = token, 0 = padding; got {attention_mask.dtype}")


def _check_cu_seqlens_shape(cu_seqlens: torch.Tensor, input_ids: torch.Tensor) -> None:
    """Packed-batch metadata that can be checked without reading values."""
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"cu_seqlens: a packed batch is input_ids[1, T], got batch size {input_ids.shape[0]}; "
            "pack all sequences into one row (fastzoo.data.pack) or drop cu_seqlens for a padded batch"
        )
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [N+1], got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] position of each token inside its packed sequence (0, 1, ... restarting per sequence)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths, output_size=total)
