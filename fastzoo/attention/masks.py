"""Masks and score modifications, written once as FlexAttention ``mask_mod``/``score_mod`` functions.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` and a ``score_mod(score, b, h, q_idx, kv_idx)``
use only elementwise tensor ops, so the same function serves FlexAttention (which calls it
on scalars inside its kernel) and the dense reference (:func:`dense_mask`, which calls it
once on broadcast index grids). That is what lets ``eager`` prove ``flex`` on every preset.
"""
from __future__ import annotations

from typing import Callable

import torch

from fastzoo.attention.base import AttnContext

MaskMod = Callable[..., torch.Tensor]
ScoreMod = Callable[..., torch.Tensor]


# -- presets ------------------------------------------------------------------------------
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window_from(window: int, offset: int = 0) -> MaskMod:
    """The sliding window, transformers' ``sliding_window_overlay``: query ``i`` (key position
    ``i + offset``: bottom-right with a KV cache) sees keys ``j`` with ``i + offset - j < window``,
    itself and the ``window - 1`` keys before it once anded with causal. FlashAttention's form
    of the same window is ``window_size=(window - 1, 0)`` (:func:`flash_window_size`)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx > q_idx + offset - window

    return mask_mod


def flash_window_size(window: int | None) -> tuple[int, int]:
    """``ctx.window`` as FlashAttention's ``window_size=(left, right)`` (inclusive bounds, -1 =
    unbounded; used with causal=True): ``window - 1`` keys to the left, none to the right."""
    return (-1, -1) if window is None else (window - 1, 0)


def sliding_window(window: int, is_causal: bool = True) -> MaskMod:
    """The ``mask_mod="sliding_window"`` preset: keys less than ``window`` positions away,
    behind only if ``is_causal`` (then the context's sliding window, :func:`window_from`)."""
    behind = window_from(window)

    def mask_mod(b, h, q_idx, kv_idx):
        near = behind(b, h, q_idx, kv_idx)
        return near & (q_idx >= kv_idx) if is_causal else near & (kv_idx < q_idx + window)

    return mask_mod


def neighborhood(grid_size: tuple[int, int], radius: int, num_prefix_tokens: int = 0) -> MaskMod:
    """2-D neighbourhood attention over a ViT patch grid (Chebyshev distance <= ``radius``).

    Prefix tokens (class/register) attend to and are attended by every token, so pooling
    through the class token keeps a global view.
    """
    cols = grid_size[1]
    p = num_prefix_tokens

    def mask_mod(b, h, q_idx, kv_idx):
        qi, ki = q_idx - p, kv_idx - p
        near = ((qi // cols - ki // cols).abs() <= radius) & ((qi % cols - ki % cols).abs() <= radius)
        return near | (q_idx < p) | (kv_idx < p)

    return mask_mod


def cap_scores(score: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma 2's logit soft-capping, ``cap * tanh(score / cap)``, in transformers' order of ops."""
    return torch.tanh(score / cap) * cap


def softcap(cap: float) -> ScoreMod:
    """Soft-capping as a score_mod (:func:`cap_scores`)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap_scores(score, cap)

    return score_mod


def with_context_softcap(ctx: AttnContext, score_mod: ScoreMod | None) -> ScoreMod | None:
    """The context's soft-capping (``ctx.softcap``: the model's own), then the user's ``score_mod``."""
    if ctx.softcap is None:
        return score_mod
    cap = ctx.softcap
    if score_mod is None:
        return softcap(cap)

    def capped_then_user(score, b, h, q_idx, kv_idx):
        return score_mod(cap_scores(score, cap), b, h, q_idx, kv_idx)

    return capped_then_user


def document(cu_seqlens: torch.Tensor, total: int, device=None) -> MaskMod:
    """Tokens attend only inside their own packed sequence. ``device``: where the mask is
    evaluated (q's); ``cu_seqlens`` may live elsewhere (packed offsets are often on the CPU)."""
    doc_T = document_ids(cu_seqlens if device is None else cu_seqlens.to(device), total)

    def mask_mod(b, h, q_idx, kv_idx):
        return doc_T[q_idx] == doc_T[kv_idx]

    return mask_mod


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] index of the packed sequence each token belongs to (tokens past the end get -1)."""
    # Token t belongs to the sequence whose span [cu[i], cu[i+1]) holds it: i = number of ends
    # cu[1:] <= t. A search, not repeat_interleave: no data-dependent shape (no host read,
    # no torch.compile graph break).
    cu = cu_seqlens.long()
    t = torch.arange(total, device=cu_seqlens.device)
    ids = torch.searchsorted(cu[1:], t, right=True)
    return torch.where(t < cu[-1], ids, -1)


def document_causal(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                    causal: bool, device=None, window: int | None = None) -> MaskMod:
    """Packed queries and keys with their own offsets (a KV cache): a query sees the keys of
    its own sequence only and, if ``causal``, bottom-right aligned per sequence: query ``i`` of
    sequence ``n`` is key position ``i + (cu_k[n+1] - cu_q[n+1])``, the queries being the
    last positions of their sequence; ``window`` (causal only) counts from that position."""
    cu_q, cu_k = (c if device is None else c.to(device) for c in (cu_seqlens_q, cu_seqlens_k))
    doc_q, doc_k = document_ids(cu_q, total_q), document_ids(cu_k, total_k)
    shift_q = (cu_k[1:] - cu_q[1:]).long()[doc_q.clamp(min=0)]  # the key index of query q is q + shift_q[q]

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_q[q_idx] == doc_k[kv_idx]
        return same & causal_window(shift_q[q_idx], window)(b, h, q_idx, kv_idx) if causal else same

    return mask_mod


def causal_from(offset) -> MaskMod:
    """Causal, bottom-right aligned: query ``i`` is position ``i + offset`` among the keys
    (``offset = Sk - Sq``: the keys a KV cache holds before the queries; a tensor broadcast
    against the index grids gives each sequence its own). The one bottom-right rule."""
    if isinstance(offset, int) and offset == 0:
        return causal

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    return mask_mod


def causal_window(offset=0, window: int | None = None) -> MaskMod:
    """Causal from ``offset`` (:func:`causal_from`), within a sliding ``window`` if one is given."""
    return and_masks(causal_from(offset), window_from(window, offset) if window is not None else None)


def padding(key_padding_mask: torch.Tensor, offset: int = 0, causal: bool = True) -> MaskMod:
    """Every query sees real keys only, as in transformers (a padding query after a real
    token gets HF's value, e.g. a right-padded row's last position). Causal: a padding query
    with no real token at or before it (left padding) sees every key: this keeps its softmax
    row non-empty (no NaN leaking into gradients); its output is never used. Query ``i`` is key
    position ``i + offset`` (KV cache). Not causal (an encoder, a cross-attention whose queries
    are no key positions): every query sees the real keys; only a row without any sees all."""
    valid_BS = key_padding_mask
    if not causal:
        empty_B = ~valid_BS.any(1)

        def mask_mod(b, h, q_idx, kv_idx):
            return valid_BS[b, kv_idx] | empty_B[b]

        return mask_mod
    first_real_B = torch.where(valid_BS.any(1), valid_BS.int().argmax(1), valid_BS.shape[1])

    def mask_mod(b, h, q_idx, kv_idx):
        return valid_BS[b, kv_idx] | (q_idx + offset < first_real_B[b])

    return mask_mod


def and_masks(*mods: MaskMod | None) -> MaskMod | None:
    mods = [m for m in mods if m is not None]
    if not mods:
        return None
    if len(mods) == 1:
        return mods[0]

    def mask_mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return mask_mod


# -- resolving user options -------------------------------------------------------------
SCORE_PRESETS = ("softcap",)
MASK_PRESETS = ("causal", "sliding_window", "neighborhood")


def resolve_score_mod(score_mod, *, softcap_value: float) -> ScoreMod | None:
    if score_mod is None or callable(score_mod):
        return score_mod
    if score_mod == "softcap":
        return softcap(softcap_value)
    raise ValueError(f"score_mod={score_mod!r} is not a preset ({', '.join(SCORE_PRESETS)}) nor a callable")


def resolve_mask_mod(mask_mod, ctx: AttnContext, *, window: int, radius: int) -> MaskMod | None:
    """A preset name becomes a mask_mod; presets needing the ViT grid read it from ``ctx``."""
    if mask_mod is None or callable(mask_mod):
        return mask_mod
    if mask_mod == "causal":
        return causal
    if mask_mod == "sliding_window":
        return sliding_window(window, is_causal=ctx.causal)
    if mask_mod == "neighborhood":
        if ctx.grid_size is None:
            raise ValueError("mask_mod='neighborhood' needs a 2-D token grid: only models of image patches provide one")
        return neighborhood(ctx.grid_size, radius, ctx.num_prefix_tokens)
    raise ValueError(f"mask_mod={mask_mod!r} is not a preset ({', '.join(MASK_PRESETS)}) nor a callable")


def request_problems(mask_mod, req) -> list[str]:
    """What a ``mask_mod`` option cannot do for the model described by ``req`` (an AttnRequest)."""
    if mask_mod == "neighborhood" and req.grid_2d is False:
        return ["mask_mod='neighborhood' needs a 2-D token grid (ctx.grid_size), and this model has none: "
                "only models of image patches give one"]
    return []


def check_mod_option(name: str, value, presets) -> None:
    if value is not None and not callable(value) and value not in presets:
        raise ValueError(f"{name}={value!r} is not a preset ({', '.join(presets)}) nor a callable")


def context_mask_mod(ctx: AttnContext, total_q: int, extra: MaskMod | None = None, total_k: int | None = None,
                     device=None) -> MaskMod | None:
    """The one mask the context implies: causal, sliding window, padding, packed documents,
    plus ``extra``; evaluated on ``device`` (q's device: the offsets and the padding mask are
    moved there).

    With fewer queries than keys (``total_k``, a KV cache) the queries are the last
    ``total_q`` positions: causal is bottom-right aligned (see ``fastzoo.attention.base``),
    per packed sequence when the keys have their own offsets (``ctx.cu_seqlens_k``).
    """
    offset = 0 if total_k is None else total_k - total_q
    if ctx.cu_seqlens_k is not None:  # packed with a KV cache: the keys have their own offsets
        if ctx.key_padding_mask is not None:
            raise ValueError("cu_seqlens_k: packed sequences take no key-padding mask")
        return and_masks(document_causal(ctx.cu_seqlens, ctx.cu_seqlens_k, total_q, total_k, ctx.causal, device,
                                         ctx.window), extra)
    if ctx.cu_seqlens is not None and offset:  # this order: under FX tracing offset is a Proxy, not a bool
        raise ValueError("cu_seqlens: fewer packed queries than keys (a KV cache) needs the keys' offsets, cu_seqlens_k")
    kpm = ctx.key_padding_mask
    return and_masks(
        causal_window(offset, ctx.window) if ctx.causal else None,
        padding(kpm if device is None else kpm.to(device), offset, ctx.causal) if kpm is not None else None,
        document(ctx.cu_seqlens, total_q, device) if ctx.cu_seqlens is not None else None,
        extra,
    )


# -- dense evaluation (reference path) -----------------------------------------------------
def _index_grids(B: int, H: int, Sq: int, Sk: int, device):
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(Sq, device=device).view(1, 1, Sq, 1)
    kv = torch.arange(Sk, device=device).view(1, 1, 1, Sk)
    return b, h, q, kv


def dense_mask(mask_mod: MaskMod, B: int, H: int, Sq: int, Sk: int, device) -> torch.Tensor:
    """``mask_mod`` evaluated on every (b, h, q, kv): a bool tensor broadcastable to [B, H, Sq, Sk]."""
    return mask_mod(*_index_grids(B, H, Sq, Sk, device))


def apply_score_mod(score_mod: ScoreMod, scores_BHSS: torch.Tensor) -> torch.Tensor:
    B, H, Sq, Sk = scores_BHSS.shape
    return score_mod(scores_BHSS, *_index_grids(B, H, Sq, Sk, scores_BHSS.device))
