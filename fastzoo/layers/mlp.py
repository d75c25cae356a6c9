"""MLPs: the two-layer MLP named as timm's (``fc1`` -> activation -> ``fc2``), its gated form with
the gate and the value packed in ``fc1`` (timm's ``SwiGLUPacked``: DINOv2-giant), and the gated MLP
of the Llama layouts, named as transformers' (separate ``gate_proj`` / ``up_proj``, or Phi-3's
fused ``gate_up_proj``)."""
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


class PackedGluMlp(nn.Module):
    """``fc2(act(a) * b)`` with ``a, b = fc1(x).chunk(2)``: the gated MLP with one input projection
    of ``hidden_dim`` outputs (``hidden_dim / 2`` gated units), timm's ``SwiGLUPacked`` names."""

    def __init__(self, dim: int, hidden_dim: int, act_layer=nn.SiLU, drop: float = 0.0):
        super().__init__()
        if hidden_dim % 2:
            raise ValueError(f"a packed gated MLP's hidden width {hidden_dim} must be even (gate and value halves)")
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim // 2, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        gate, value = self.fc1(x).chunk(2, dim=-1)
        return self.drop2(self.fc2(self.drop1(self.act(gate) * value)))


class GatedMlp(nn.Module):
    """Gated MLP (Shazeer 2020, "GLU Variants Improve Transformer"): ``down(act(gate(x)) * up(x))``,
    SwiGLU with SiLU; named as transformers' Llama (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, dim: int, hidden_dim: int, act_layer=nn.SiLU, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.act_fn = act_layer()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMlp(nn.Module):
    """The gated MLP with gate and up projections in one matmul, named as transformers' Phi-3
    (``gate_up_proj``: the gate's rows, then the up projection's; ``down_proj``)."""

    def __init__(self, dim: int, hidden_dim: int, act_layer=nn.SiLU, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.act_fn = act_layer()

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act_fn(gate))
