"""MLP activations by name, as timm's ``act_layer`` names them."""
import torch
from torch import nn


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``: the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


# timm ``act_layer`` name -> module class (exact GELU is timm's default)
ACTIVATIONS = {"gelu": nn.GELU, "quick_gelu": QuickGELU}
