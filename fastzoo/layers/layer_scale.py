"""LayerScale (CaiT, Touvron et al. 2021): a learned per-channel gain on a residual branch."""
import torch
from torch import nn


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        return x * self.gamma
