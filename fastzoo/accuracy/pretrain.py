"""A backbone trained here, on the run's own training digits, before the arms start: what an
ImageNet checkpoint is to a user fine-tuning a detector on their data (the held-out digits are
never seen). The backbone classifies single digits on small canvases through a global average
pool and a linear head (both dropped afterwards), with trainable BatchNorm; its weights and
BatchNorm statistics are then written into the detector's own (frozen-BatchNorm) backbone, so
every arm starts from them."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def _feature_map(backbone: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The last feature map: transformers' backbones return ``.feature_maps``, timm's a list."""
    out = backbone(images)
    maps = out.feature_maps if hasattr(out, "feature_maps") else out
    return maps[-1]


def _is_frozen_batch_norm(m: nn.Module) -> bool:
    """transformers' and fastzoo's ``DetrFrozenBatchNorm2d`` (and torchvision's): statistics and affine as buffers."""
    return type(m).__name__.endswith("FrozenBatchNorm2d")


def _with_trainable_batch_norm(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose frozen BatchNorms are ``nn.BatchNorm2d`` holding their values."""
    module = copy.deepcopy(module)
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if _is_frozen_batch_norm(child):
                bn = nn.BatchNorm2d(child.weight.numel())
                with torch.no_grad():
                    for k in ("weight", "bias", "running_mean", "running_var"):
                        getattr(bn, k).copy_(getattr(child, k))
                setattr(parent, name, bn)
    return module


def pretrain_backbone(backbone: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, num_classes: int,
                      steps: int, lr: float, batch_size: int, seed: int) -> float:
    """Train ``backbone`` (in place: its parameters and BatchNorm buffers) to classify ``images``
    ``[N, C, H, W]`` as ``labels`` ``[N]`` for ``steps`` AdamW steps on seeded random batches;
    returns the accuracy on the last batch. ``requires_grad`` flags are left as they were."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"pretrain_backbone: steps and batch_size must be >= 1, got {steps} and {batch_size}")
    net = _with_trainable_batch_norm(backbone).train()
    for p in net.parameters():
        p.requires_grad_(True)
    with torch.no_grad():
        width = _feature_map(net, images[:2]).shape[1]
    head = nn.Linear(width, num_classes)
    opt = torch.optim.AdamW([*net.parameters(), *head.parameters()], lr=lr, weight_decay=1e-4)
    g = torch.Generator().manual_seed(seed)
    accuracy = 0.0
    for _ in range(steps):
        idx = torch.randint(0, len(labels), (batch_size,), generator=g)
        logits = head(_feature_map(net, images[idx]).mean((2, 3)))
        loss = F.cross_entropy(logits, labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        accuracy = (logits.argmax(1) == labels[idx]).float().mean().item()
    state = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    backbone.load_state_dict(state, strict=True)
    return accuracy
