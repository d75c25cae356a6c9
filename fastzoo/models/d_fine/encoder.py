"""D-FINE's hybrid encoder: RT-DETR's (``RTDetrHybridEncoder``'s forward: AIFI on the chosen maps, a top-down
FPN, a bottom-up PAN) with transformers' ``DFineHybridEncoder`` differences, under its module names: the
lateral convolutions without activation, each FPN / PAN block a RepNCSPELAN4 (GELAN, YOLOv9's: a split, two CSP
branches in a chain, everything concatenated), each downsampling an SCDown (1x1 then a depthwise 3x3 stride 2),
and the AIFI layers' MLP named ``mlp.layers.N`` without dropout.
"""
from __future__ import annotations

import torch
from torch import nn

from fastzoo.models.d_fine.config import DFineConfig
from fastzoo.models.detr.transformer import ACTIVATIONS
from fastzoo.models.rt_detr.encoder import (
    RTDetrAIFILayer,
    RTDetrConvNormLayer,
    RTDetrCSPRepLayer,
    RTDetrEncoderLayer,
    RTDetrHybridEncoder,
)


class DFineMLP(nn.Module):
    """``num_layers`` linear layers (``layers.N``), ``act`` between."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int, act: str = "relu"):
        super().__init__()
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))
        self.act = ACTIVATIONS[act]

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = self.act(layer(x)) if i < len(self.layers) - 1 else layer(x)
        return x


class DFineEncoderLayer(RTDetrEncoderLayer):
    """RT-DETR's AIFI layer with D-FINE's MLP."""

    def __init__(self, cfg: DFineConfig):
        super().__init__(cfg)
        d = cfg.encoder_hidden_dim
        self.mlp = DFineMLP(d, cfg.encoder_ffn_dim, d, 2, cfg.encoder_activation_function)


class DFineRepNCSPELAN4(nn.Module):
    """1x1 to twice the width, split in two; the second half through a CSP layer and a 3x3, that through another
    CSP layer and a 3x3; the two halves and both branches concatenated, 1x1 back to the width (SiLU throughout,
    as transformers' default)."""

    def __init__(self, cfg: DFineConfig, blocks: int, act: str = "silu"):
        super().__init__()
        d, w = cfg.encoder_hidden_dim, cfg.elan_width
        self.conv_dim = d
        self.conv1 = RTDetrConvNormLayer(cfg, 2 * d, 2 * d, 1, 1, activation=act)
        self.csp_rep1 = RTDetrCSPRepLayer(cfg, d, w, w, blocks)
        self.conv2 = RTDetrConvNormLayer(cfg, w, w, 3, 1, activation=act)
        self.csp_rep2 = RTDetrCSPRepLayer(cfg, w, w, w, blocks)
        self.conv3 = RTDetrConvNormLayer(cfg, w, w, 3, 1, activation=act)
        self.conv4 = RTDetrConvNormLayer(cfg, 2 * d + 2 * w, d, 1, 1, activation=act)

    def forward(self, x):
        halves = list(self.conv1(x).split((self.conv_dim, self.conv_dim), 1))
        b1 = self.conv2(self.csp_rep1(halves[-1]))
        b2 = self.conv3(self.csp_rep2(b1))
        return self.conv4(torch.cat([*halves, b1, b2], 1))


class DFineSCDown(nn.Module):
    """1x1 then a depthwise 3x3 stride 2, neither with an activation."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        d = cfg.encoder_hidden_dim
        self.conv1 = RTDetrConvNormLayer(cfg, d, d, 1, 1)
        self.conv2 = RTDetrConvNormLayer(cfg, d, d, 3, 2, groups=d)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class DFineHybridEncoder(RTDetrHybridEncoder):
    def __init__(self, cfg: DFineConfig):
        nn.Module.__init__(self)
        self.config = cfg
        d, n, blocks = cfg.encoder_hidden_dim, len(cfg.encoder_in_channels) - 1, round(3 * cfg.depth_mult)
        self.aifi = nn.ModuleList(RTDetrAIFILayer(cfg, DFineEncoderLayer) for _ in cfg.encode_proj_layers)
        self.lateral_convs = nn.ModuleList(RTDetrConvNormLayer(cfg, d, d, 1, 1) for _ in range(n))
        self.fpn_blocks = nn.ModuleList(DFineRepNCSPELAN4(cfg, blocks) for _ in range(n))
        self.downsample_convs = nn.ModuleList(DFineSCDown(cfg) for _ in range(n))
        self.pan_blocks = nn.ModuleList(DFineRepNCSPELAN4(cfg, blocks) for _ in range(n))
