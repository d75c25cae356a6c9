"""``flex``: FlexAttention (``torch.nn.attention.flex_attention``) with score_mod / block_mask.

Options: ``score_mod`` (callable or ``"softcap"``), ``mask_mod`` (callable or one of
``"causal"``, ``"sliding_window"``, ``"neighborhood"``), or a ready ``block_mask``;
preset parameters ``softcap``, ``window``, ``radius``; ``compile`` (default: on CUDA only).
The context's own masks (causal, padding, packed documents) are always added, so a packed
batch can never attend across sequences whatever the user's mask says.

On CPU PyTorch runs flex without a backward: a training forward fails before it runs.
"""
from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from fastzoo.attention import masks
from fastzoo.attention.base import FLOATS, AttentionBackend, Capabilities

_compiled_flex = None


def _flex_fn(compile_: bool):
    global _compiled_flex
    if not compile_:
        # uncompiled is a deliberate choice here (CPU default, or compile=False): say it once in the docs, not per call
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


class FlexBackend(AttentionBackend):
    name = "flex"
    description = "FlexAttention: score_mod/mask_mod presets softcap, causal, sliding_window, neighborhood"
    capabilities = Capabilities(
        devices={"cpu": FLOATS, "cuda": FLOATS},
        varlen=True,
        score_mod=True,
        backward=("cuda",),
        verified="CPU fp32 inference (torch 2.14.1)",
    )
    options = {
        "score_mod": None, "mask_mod": None, "block_mask": None,
        "softcap": 50.0, "window": 128, "radius": 3, "compile": None,
    }

    def __init__(self, **options):
        super().__init__(**options)
        masks.check_mod_option("score_mod", self.opts["score_mod"], masks.SCORE_PRESETS)
        masks.check_mod_option("mask_mod", self.opts["mask_mod"], masks.MASK_PRESETS)
        bm = self.opts["block_mask"]
        if bm is not None and not isinstance(bm, BlockMask):
            raise TypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got {type(bm).__name__}")
        if bm is not None and self.opts["mask_mod"] is not None:
            raise ValueError("give either block_mask or mask_mod, not both: a block_mask already holds its mask_mod")
        self._block_masks = {}  # (Sq, Sk, device) -> BlockMask for masks that do not depend on the batch

    def _block_mask(self, ctx, B, Sq, Sk, device):
        user = self.opts["block_mask"]
        context_masks = ctx.causal or ctx.key_padding_mask is not None or ctx.cu_seqlens is not None
        if user is not None and not context_masks:
            if tuple(user.seq_lengths) != (Sq, Sk):
                raise ValueError(f"block_mask was built for {tuple(user.seq_lengths)} tokens, the input has ({Sq}, {Sk})")
            return user
        if user is not None:
            extra = user.mask_mod
        else:
            extra = masks.resolve_mask_mod(self.opts["mask_mod"], ctx, window=self.opts["window"], radius=self.opts["radius"])
        mask_mod = masks.context_mask_mod(ctx, Sq, extra)
        if mask_mod is None:
            return None
        if ctx.key_padding_mask is not None or ctx.cu_seqlens is not None:  # depends on this batch: rebuild
            batch = B if ctx.key_padding_mask is not None else None
            return create_block_mask(mask_mod, batch, None, Sq, Sk, device=device)
        key = (Sq, Sk, str(device), ctx.causal, ctx.grid_size, ctx.num_prefix_tokens)
        if key not in self._block_masks:
            self._block_masks[key] = create_block_mask(mask_mod, None, None, Sq, Sk, device=device)
        return self._block_masks[key]

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        if ctx.dropout_p > 0:
            raise ValueError("flex attention has no attention dropout: set the model's attention dropout to 0 or use eager/sdpa")
        B, _, Sq, _ = q_BHSD.shape
        block_mask = self._block_mask(ctx, B, Sq, k_BHSD.shape[-2], q_BHSD.device)
        score_mod = masks.resolve_score_mod(self.opts["score_mod"], softcap_value=self.opts["softcap"])
        compile_ = self.opts["compile"]
        compile_ = q_BHSD.is_cuda if compile_ is None else compile_
        return _flex_fn(compile_)(q_BHSD, k_BHSD, v_BHSD, score_mod=score_mod, block_mask=block_mask, scale=ctx.scale)
