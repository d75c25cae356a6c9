"""``eager``: softmax(q k^T * scale + mask) v written out with matmuls — the reference (the scale on q or on
q k^T as the model's original rounds it: ``AttnContext.scale_scores``).

It serves every feature of the contract (causal, padding, packed sequences, windows,
soft-capping, score_mod, mask_mod) by materialising the [B, H, S, S] scores, so every faster backend is compared
against it. Memory grows with S^2: use it to check, not to train at length.
"""
from __future__ import annotations

import torch.nn.functional as F

from fastzoo.attention import masks
from fastzoo.attention.base import FLOATS, AttentionBackend, Capabilities, KernelProfile


class EagerBackend(AttentionBackend):
    name = "eager"
    description = "plain matmul-softmax-matmul (the reference)"
    capabilities = Capabilities(
        devices={"cpu": FLOATS, "cuda": FLOATS},
        varlen=True,
        score_mod=True,
        kv_cache=True,
        window=True,
        softcap=True,
        verified="reference (CPU fp32)",
    )
    options = {"score_mod": None, "mask_mod": None, "softcap": 50.0, "window": 128, "radius": 3}

    def __init__(self, **options):
        super().__init__(**options)
        masks.check_mod_option("score_mod", self.opts["score_mod"], masks.SCORE_PRESETS)
        masks.check_mod_option("mask_mod", self.opts["mask_mod"], masks.MASK_PRESETS)

    def problems(self, req):
        return super().problems(req) + masks.request_problems(self.opts["mask_mod"], req)

    def kernel_profile(self, q, k, ctx):
        return KernelProfile(f"{self.label()}: matmul-softmax-matmul", None, missing="a fused kernel ran instead")

    def _allowed(self, ctx, B, H, Sq, Sk, device):
        """This call's bool mask, broadcastable to [B, H, Sq, Sk] (None: no mask); built once per forward."""
        user_mask = masks.resolve_mask_mod(self.opts["mask_mod"], ctx, window=self.opts["window"], radius=self.opts["radius"])
        mask_mod = masks.context_mask_mod(ctx, Sq, user_mask, total_k=Sk, device=device)
        return None if mask_mod is None else masks.dense_mask(mask_mod, B, H, Sq, Sk, device)

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        B, H, Sq, D = q_BHSD.shape
        Sk = k_BHSD.shape[-2]
        scale = ctx.scale if ctx.scale is not None else D**-0.5
        if ctx.scale_scores:  # the original's order of rounding (AttnContext.scale_scores)
            scores_BHSS = (q_BHSD @ k_BHSD.transpose(-2, -1)) * scale
        else:
            scores_BHSS = (q_BHSD * scale) @ k_BHSD.transpose(-2, -1)
        if ctx.softcap is not None:  # the model's own capping, before any score_mod of the user's
            scores_BHSS = masks.cap_scores(scores_BHSS, ctx.softcap)
        score_mod = masks.resolve_score_mod(self.opts["score_mod"], softcap_value=self.opts["softcap"])
        if score_mod is not None:
            scores_BHSS = masks.apply_score_mod(score_mod, scores_BHSS)
        allowed = ctx.cached((self.uid, "dense_mask", B, H, Sq, Sk, ctx.window),
                             lambda: self._allowed(ctx, B, H, Sq, Sk, q_BHSD.device))
        if allowed is not None:
            scores_BHSS = scores_BHSS.masked_fill(~allowed, float("-inf"))
        probs_BHSS = scores_BHSS.softmax(dim=-1)
        if allowed is not None:  # a row with no allowed key outputs zeros, as flex does
            probs_BHSS = probs_BHSS.nan_to_num(0.0)
        probs_BHSS = F.dropout(probs_BHSS, p=ctx.dropout_p) if ctx.dropout_p > 0 else probs_BHSS
        return probs_BHSS @ v_BHSD
