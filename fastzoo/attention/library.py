"""Shared base of the backends whose kernel lives in a third-party CUDA library.

Such a backend needs the library *and* a suitable GPU; :func:`fastzoo.attention.base.unavailable`
names every missing piece, and imports the library only on a machine that can use it.

:meth:`LibraryBackend.forward` maps the contract onto the two entry points these libraries
share: an equal-length ``[B, S, H, D]`` call (:meth:`dense`), and a packed ``[T, H, D]`` call
with ``cu_seqlens`` (:meth:`varlen`) for packed batches. The kernels take no key-padding
mask: a model unpads a padded batch into a packed one once per forward
(:mod:`fastzoo.attention.packing`), so the backends declare ``padding_mask=False``.

Causal attention with fewer queries than keys (a KV cache) is bottom-right aligned in the
contract; each library's dense call is given its bottom-right form (flash-attn's ``causal``
from 2.1, TE's ``causal_bottom_right``, xFormers' ``LowerTriangularFromBottomRightMask``), so
these backends declare ``kv_cache``. A backend declaring ``window`` gets ``window=`` in both calls
(FlashAttention's ``window_size=(window - 1, 0)``, :func:`fastzoo.attention.masks.flash_window_size`);
one declaring ``gqa`` gets k/v with fewer heads than q as they are. A packed call with a KV cache gives the keys their own
offsets (``ctx.cu_seqlens_k``), passed to each library's varlen entry point (flash-attn's
``cu_seqlens_k``, TE's ``cu_seqlens_kv`` with ``padding_causal_bottom_right``, xFormers'
``BlockDiagonalCausalFromBottomRightMask``).
"""
from __future__ import annotations

from fastzoo.attention import packing
from fastzoo.attention.base import AttentionBackend


class LibraryBackend(AttentionBackend):
    """A CUDA-only backend backed by the packages in ``capabilities.packages``."""

    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal: bool, scale: float | None, dropout_p: float):
        """Equal-length batch in the ``[B, S, H, D]`` layout these libraries share."""
        raise NotImplementedError

    def varlen(self, q_THD, k_THD, v_THD, cu_seqlens, max_seqlen: int, *, causal, scale, dropout_p, ctx=None,
               cu_seqlens_k=None, max_seqlen_k=None):
        """Packed sequences: ``[T, H, D]`` tokens, ``cu_seqlens`` [N+1] int32 offsets (the keys' own
        ``cu_seqlens_k`` / ``max_seqlen_k`` with a KV cache, else None). ``ctx`` is the call's
        context: metadata built from the offsets goes in ``ctx.cached``, once per forward."""
        raise NotImplementedError

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        kw = dict(causal=ctx.causal, scale=ctx.scale, dropout_p=ctx.dropout_p)
        if ctx.window is not None:  # only a backend declaring window is called with one: its dense/varlen take window=
            kw["window"] = ctx.window
        if ctx.softcap is not None:  # likewise softcap=
            kw["softcap"] = ctx.softcap
        if ctx.cu_seqlens is None:
            q_BSHD, k_BSHD, v_BSHD = (x.transpose(1, 2) for x in (q_BHSD, k_BHSD, v_BHSD))
            return self.dense(q_BSHD, k_BSHD, v_BSHD, **kw).transpose(1, 2)
        q_THD, k_THD, v_THD = (packing.to_THD(x) for x in (q_BHSD, k_BHSD, v_BHSD))
        seqlens = packing.seqlens(ctx, q_BHSD, k_BHSD).kwargs()
        return packing.from_THD(self.varlen(q_THD, k_THD, v_THD, **seqlens, **kw, ctx=ctx), 1)
