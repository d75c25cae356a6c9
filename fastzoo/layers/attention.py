"""Multi-head self-attention whose inner product runs through a swappable backend."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.attention.base import AttentionBackend, AttnContext


class AttentionSlot:
    """The backend (and its name) that every attention layer of one model calls, held as
    one value: ``set_attention`` swaps it with a single assignment, so a thread never sees
    some layers switched and others not, nor a name that disagrees with the layers. A forward
    runs :meth:`pinned`: its thread keeps the backend it started with for all its layers while
    other threads switch (a forward whose input was read for one backend never meets another)."""

    __slots__ = ("current", "_local")

    def __init__(self, name: str | None, backend: AttentionBackend | None):
        self.current = (name, backend)
        self._local = threading.local()

    def __getstate__(self):  # pickle / deepcopy: the backend, not a running forward's pin (a thread's state)
        return self.current

    def __setstate__(self, current):
        self.current, self._local = current, threading.local()

    @property
    def active(self) -> tuple:
        """The (name, backend) this thread's running forward started with, else the current one."""
        return getattr(self._local, "pinned", None) or self.current

    @contextmanager
    def pinned(self):
        """This thread's forward (and any forward it nests) on the backend current at its start."""
        if getattr(self._local, "pinned", None) is not None:
            yield
            return
        self._local.pinned = self.current
        try:
            yield
        finally:
            self._local.pinned = None


class UsesAttention(nn.Module):
    """A module that calls an attention backend; ``FastzooModel.set_attention`` sets it.

    The backend is not a submodule: it holds no weights, so switching kernels never
    touches the state dict. The layers of a model share one :class:`AttentionSlot`.
    Attention dropout is an ``nn.Dropout`` submodule named as in the original model
    (``attn_dropout_module``: HF's ``attn_dropout``, timm's ``attn_drop``), so the usual
    idioms (``model.eval()``, setting every ``nn.Dropout``'s ``p``) reach it; the kernel gets
    its ``p`` in train mode. ``attn_dropout_field`` is the config field that sets it:
    backends without dropout refuse such a model at create, naming it.

    Decoders beyond GPT-2: a layer with grouped-query attention passes k/v with their own
    (fewer) heads to :meth:`attend`, never repeated (the contract repeats them for backends
    without native GQA); one with a sliding window sets ``sliding_window`` (an int: the query
    and the ``sliding_window - 1`` keys before it), which :meth:`attend` puts on the context
    and ``attention_request`` reports, so that backends without it are refused at create; the
    same for ``softcap`` (scores capped to ``softcap * tanh(score / softcap)``).
    """

    slot: AttentionSlot | None = None
    sliding_window: int | None = None  # a layer attending through a window sets it (Mistral's / Qwen2's sliding_window)
    softcap: float | None = None  # a layer soft-capping its scores sets it (Gemma 2's attn_logit_softcapping)
    scale_scores: bool = False  # a layer whose original scales q k^T rather than q sets it (AttnContext.scale_scores)
    attn_dropout_module: ClassVar[str] = "attn_dropout"
    attn_dropout_field: ClassVar[str] = "attention dropout"

    @property
    def attn_dropout_p(self) -> float:
        """The attention dropout probability the layer is configured with (its module's ``p``)."""
        drop = getattr(self, self.attn_dropout_module, None)
        return float(drop.p) if isinstance(drop, nn.Dropout) else 0.0

    @property
    def backend(self) -> AttentionBackend | None:
        return None if self.slot is None else self.slot.active[1]

    @backend.setter
    def backend(self, backend: AttentionBackend) -> None:  # this layer alone (the model's set_attention sets all)
        self.slot = AttentionSlot(getattr(backend, "name", None), backend)

    def attend(self, q_BHSD, k_BHSD, v_BHSD, ctx: AttnContext, scale: float | None = None) -> torch.Tensor:
        """The backend on the model's shared ``ctx``, with this layer's scale, dropout, window and softcap.

        The shared context is never written to: a layer whose values differ from it gets a
        copy (``ctx.replace``) that keeps the forward's mask cache.
        """
        dropout_p = self.attn_dropout_p if self.training else 0.0
        if (scale != ctx.scale or dropout_p != ctx.dropout_p or self.sliding_window != ctx.window
                or self.softcap != ctx.softcap or self.scale_scores != ctx.scale_scores):
            ctx = ctx.replace(scale=scale, dropout_p=dropout_p, window=self.sliding_window, softcap=self.softcap,
                              scale_scores=self.scale_scores)
        return self.backend(q_BHSD, k_BHSD, v_BHSD, ctx)


class Attention(UsesAttention):
    """ViT self-attention, named as timm's (``qkv``, ``proj``) so its weights load key for key."""

    attn_dropout_module = "attn_drop"  # timm's name
    attn_dropout_field = "attn_drop_rate"  # timm's VisionTransformer argument
    # q, k and v as three products with their thirds of ``qkv`` (transformers' DINOv2: query, key, value), where
    # the original rounds so; False: timm's one product. The same function: the input's gradient sums otherwise
    split_qkv: bool = False

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = nn.Dropout(attn_drop)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x_BSD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, S, D = x_BSD.shape
        if self.split_qkv:
            biases = self.qkv.bias.chunk(3) if self.qkv.bias is not None else (None,) * 3
            q_BHSD, k_BHSD, v_BHSD = (F.linear(x_BSD, w, b).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
                                      for w, b in zip(self.qkv.weight.chunk(3), biases))
        else:
            qkv_3BHSD = self.qkv(x_BSD).reshape(B, S, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q_BHSD, k_BHSD, v_BHSD = qkv_3BHSD.unbind(0)
        o_BHSD = self.attend(q_BHSD, k_BHSD, v_BHSD, ctx)
        x_BSD = o_BHSD.transpose(1, 2).reshape(B, S, D)
        return self.proj_drop(self.proj(x_BSD))
