"""Stochastic depth (Huang et al. 2016): drop a whole residual branch per sample while training."""
from torch import nn


class DropPath(nn.Module):
    """timm's ``DropPath``, draw for draw: the same RNG stream gives the same mask."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop path rate p={p} must be in [0, 1]")
        self.p = p

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        keep_prob = 1.0 - self.p
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
        if keep_prob > 0.0:  # p=1 drops every sample: the mask is all zeros, nothing to rescale
            keep.div_(keep_prob)
        return x * keep
