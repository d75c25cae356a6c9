"""MLP activations by name: one table for the names timm's ``act_layer`` and transformers'
``ACT2FN`` use (where both use a name, it means the same function)."""
import math
from functools import partial

import torch
from torch import nn


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class NewGELU(nn.Module):
    """OpenAI's tanh approximation of GELU written out step by step, as transformers' ``gelu_new`` computes it
    (GPT-2): each step rounds in the input's dtype, where ``nn.GELU(approximate="tanh")`` rounds once. In bf16
    the two orders differ: on a drawn 3-wide GPT-2 a LayerNorm bias's bf16 gradient was 3.6x further from fp32
    than transformers' own, and written out it is transformers' to the bit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# name -> module class. "gelu" is exact GELU (timm's default, HF's "gelu"); "gelu_new" and
# "gelu_pytorch_tanh" are transformers' names for OpenAI's tanh approximation (written out and fused).
ACTIVATIONS = {
    "gelu": nn.GELU,
    "quick_gelu": QuickGELU,
    "gelu_tanh": partial(nn.GELU, approximate="tanh"),  # timm's name (SigLIP)
    "gelu_new": NewGELU,
    "gelu_pytorch_tanh": partial(nn.GELU, approximate="tanh"),
    "relu": nn.ReLU,
    "silu": nn.SiLU,
}
