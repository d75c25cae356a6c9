"""MLP activations by name: one table for the names timm's ``act_layer`` and transformers'
``ACT2FN`` use (where both use a name, it means the same function)."""
from functools import partial

import torch
from torch import nn


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# name -> module class. "gelu" is exact GELU (timm's default, HF's "gelu"); "gelu_new" and
# "gelu_pytorch_tanh" are transformers' names for OpenAI's tanh approximation.
ACTIVATIONS = {
    "gelu": nn.GELU,
    "quick_gelu": QuickGELU,
    "gelu_tanh": partial(nn.GELU, approximate="tanh"),  # timm's name (SigLIP)
    "gelu_new": partial(nn.GELU, approximate="tanh"),
    "gelu_pytorch_tanh": partial(nn.GELU, approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
}
