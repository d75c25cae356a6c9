"""Two-layer MLP (``fc1`` -> activation -> ``fc2``), named as timm's."""
from torch import nn


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act_layer=nn.GELU, drop: float = 0.0, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))
