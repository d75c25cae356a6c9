"""RT-DETR's contrastive denoising queries in training (DINO's, as transformers'
``get_contrastive_denoising_training_group`` draws them): each image's ground-truth boxes, padded to the
batch's most, repeated in groups of a positive copy (box jittered inside half its size) and a negative
copy (jittered further), with some labels redrawn. The draws are transformers' calls in transformers'
order on torch's global RNG, so the same seed gives the same groups.

In the decoder's self-attention a group sees itself and the matching queries, and the matching queries
see no group (transformers' ``-inf`` mask). fastzoo runs that as two unmasked attentions through the
backends (:func:`grouped_attention`): the matching queries among themselves, and each group against its own
keys followed by the matching queries' keys; a softmax over the unmasked keys is the masked softmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fastzoo.losses.set_matching import center_to_corners, corners_to_center


@dataclass
class DenoisingGroups:
    """The denoising queries prepended to the matching ones: ``size`` queries per group (twice the
    batch's most boxes), ``groups`` of them; ``meta`` is transformers' ``denoising_meta_values``."""

    size: int
    groups: int
    meta: dict

    @property
    def queries(self) -> int:
        return self.size * self.groups


def _inverse_sigmoid(x: Tensor, eps: float = 1e-5) -> Tensor:
    x = x.clamp(min=0, max=1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def denoising_queries(labels: list[dict], num_classes: int, num_queries: int, class_embed, num_denoising: int,
                      label_noise_ratio: float, box_noise_scale: float) -> tuple[Tensor, Tensor, DenoisingGroups] | None:
    """``(queries [B, N, D], reference boxes (logits) [B, N, 4], groups)``; None without any box or with
    ``num_denoising`` 0 (transformers' ``None``s)."""
    if num_denoising <= 0:
        return None
    counts = [len(t["class_labels"]) for t in labels]
    device = labels[0]["class_labels"].device
    most = max(counts)
    if most == 0:
        return None
    groups = max(num_denoising // most, 1)
    B = len(counts)
    cls_BM = torch.full([B, most], num_classes, dtype=torch.int32, device=device)
    box_BM4 = torch.zeros([B, most, 4], device=device)
    real_BM = torch.zeros([B, most], dtype=torch.bool, device=device)
    for i, n in enumerate(counts):
        if n > 0:  # an id out of range is refused by name with the set loss's read; clamped for the embedding
            cls_BM[i, :n] = labels[i]["class_labels"].clamp(0, num_classes)
            box_BM4[i, :n] = labels[i]["boxes"]
            real_BM[i, :n] = 1
    cls_BN = cls_BM.tile([1, 2 * groups])
    box_BN4 = box_BM4.tile([1, 2 * groups, 1])
    real_BN = real_BM.tile([1, 2 * groups])
    negative_BN1 = torch.zeros([B, most * 2, 1], device=device)
    negative_BN1[:, most:] = 1
    negative_BN1 = negative_BN1.tile([1, groups, 1])
    # the positive copies' query indices per image (transformers' nonzero of the positives), from the counts: no read
    first_G1 = torch.arange(groups, device=device)[:, None] * 2 * most
    positive_idx = tuple((first_G1 + torch.arange(n, device=device)).flatten() for n in counts)
    n_queries = most * 2 * groups
    if label_noise_ratio > 0:  # transformers' draws, in its order
        redraw = torch.rand_like(cls_BN, dtype=torch.float) < (label_noise_ratio * 0.5)
        new = torch.randint_like(redraw, 0, num_classes, dtype=cls_BN.dtype)
        cls_BN = torch.where(redraw & real_BN, new, cls_BN)
    if box_noise_scale > 0:
        corners = center_to_corners(box_BN4)
        half = torch.tile(box_BN4[..., 2:] * 0.5, [1, 1, 2]) * box_noise_scale
        sign = torch.randint_like(box_BN4, 0, 2) * 2.0 - 1.0
        part = torch.rand_like(box_BN4)
        part = (part + 1.0) * negative_BN1 + part * (1 - negative_BN1)
        part *= sign
        corners += part * half
        corners.clip_(min=0.0, max=1.0)
        box_BN4 = _inverse_sigmoid(corners_to_center(corners))
    meta = {"dn_positive_idx": positive_idx, "dn_num_group": groups, "dn_num_split": [n_queries, num_queries]}
    return class_embed(cls_BN), box_BN4, DenoisingGroups(2 * most, groups, meta)


def grouped_attention(attend, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, ctx, dn: DenoisingGroups) -> Tensor:
    """Self-attention of ``dn.queries`` denoising queries (first) and the matching queries under
    transformers' denoising mask, as unmasked attentions: ``attend(q, k, v, ctx)`` is the backend."""
    B, H, S, Dh = q_BHSD.shape
    N, G, M = dn.queries, dn.groups, dn.size
    Q = S - N
    out_match = attend(q_BHSD[:, :, N:], k_BHSD[:, :, N:], v_BHSD[:, :, N:], ctx)

    def by_group(t_BHND):
        return t_BHND.reshape(B, H, G, M, Dh).transpose(1, 2).reshape(B * G, H, M, Dh)

    def with_match(t_BHSD):
        match = t_BHSD[:, :, N:].unsqueeze(1).expand(B, G, H, Q, Dh).reshape(B * G, H, Q, Dh)
        return torch.cat([by_group(t_BHSD[:, :, :N]), match], dim=2)

    out_groups = attend(by_group(q_BHSD[:, :, :N]), with_match(k_BHSD), with_match(v_BHSD), ctx)
    out_dn = out_groups.reshape(B, G, H, M, Dh).transpose(1, 2).reshape(B, H, N, Dh)
    return torch.cat([out_dn, out_match], dim=2)
