"""D-FINE's backbone: HGNetV2 (PaddlePaddle's PP-HGNetV2: a stem of two branches, then stages of blocks that
concatenate every convolution's output and aggregate it with two 1x1 convolutions), as transformers'
``HGNetV2Backbone`` computes it, under its module names (``embedder.stem1`` ... ``stem4``,
``encoder.stages.N.{downsample, blocks.M.{layers.K, aggregation.0, aggregation.1}}``); RT-DETR's
``RTDetrConvEncoder`` holds it and freezes its BatchNorms, as transformers' ``DFineConvEncoder``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.models.d_fine.config import DFineConfig
from fastzoo.models.detr.transformer import ACTIVATIONS
from fastzoo.models.rt_detr.backbone import RTDetrResNetBackbone


class HGNetV2LearnableAffineBlock(nn.Module):
    """``scale * x + bias``, one learned scalar each."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.scale * x + self.bias


class HGNetV2ConvLayer(nn.Module):
    """conv (padding (k - 1) // 2, no bias) -> BatchNorm -> activation (or none) -> learned affine (where asked
    and there is an activation)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int = 1, groups: int = 1,
                 activation: str | None = "relu", lab: bool = False):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, kernel_size, stride=stride, groups=groups,
                                     padding=(kernel_size - 1) // 2, bias=False)
        self.normalization = nn.BatchNorm2d(cout)
        self.activation = ACTIVATIONS[activation] if activation is not None else nn.Identity()
        self.lab = HGNetV2LearnableAffineBlock() if activation and lab else nn.Identity()

    def forward(self, x):
        return self.lab(self.activation(self.normalization(self.convolution(x))))


class HGNetV2ConvLayerLight(nn.Module):
    """1x1 (no activation) then a depthwise ``kernel_size`` convolution."""

    def __init__(self, cin: int, cout: int, kernel_size: int, lab: bool):
        super().__init__()
        self.conv1 = HGNetV2ConvLayer(cin, cout, 1, activation=None, lab=lab)
        self.conv2 = HGNetV2ConvLayer(cout, cout, kernel_size, groups=cout, lab=lab)

    def forward(self, x):
        return self.conv2(self.conv1(x))


class HGNetV2Embeddings(nn.Module):
    """The stem: 3x3 stride 2, then a max-pool branch beside two 2x2 convolutions (each input padded right and
    below by one), concatenated, 3x3 stride 2, 1x1."""

    def __init__(self, cfg: DFineConfig):
        super().__init__()
        cin, mid, out = cfg.stem_channels
        act, lab = cfg.hidden_act, cfg.use_learnable_affine_block
        self.stem1 = HGNetV2ConvLayer(cin, mid, 3, stride=2, activation=act, lab=lab)
        self.stem2a = HGNetV2ConvLayer(mid, mid // 2, 2, activation=act, lab=lab)
        self.stem2b = HGNetV2ConvLayer(mid // 2, mid, 2, activation=act, lab=lab)
        self.stem3 = HGNetV2ConvLayer(mid * 2, mid, 3, stride=2, activation=act, lab=lab)
        self.stem4 = HGNetV2ConvLayer(mid, out, 1, activation=act, lab=lab)

    def forward(self, x):
        x = F.pad(self.stem1(x), (0, 1, 0, 1))
        branch = self.stem2b(F.pad(self.stem2a(x), (0, 1, 0, 1)))
        pooled = F.max_pool2d(x, kernel_size=2, stride=1, ceil_mode=True)
        return self.stem4(self.stem3(torch.cat([pooled, branch], dim=1)))


class HGNetV2BasicLayer(nn.Module):
    """``layer_num`` convolutions in a chain, the input and each output concatenated, squeezed to half the
    output width and excited to it (1x1 each, ReLU); a residual after the stage's first block."""

    def __init__(self, cin: int, mid: int, cout: int, layer_num: int, kernel_size: int, residual: bool, light: bool,
                 lab: bool):
        super().__init__()
        self.residual = residual
        self.layers = nn.ModuleList(
            HGNetV2ConvLayerLight(cin if i == 0 else mid, mid, kernel_size, lab) if light
            else HGNetV2ConvLayer(cin if i == 0 else mid, mid, kernel_size, lab=lab) for i in range(layer_num))
        self.aggregation = nn.Sequential(HGNetV2ConvLayer(cin + layer_num * mid, cout // 2, 1, lab=lab),
                                         HGNetV2ConvLayer(cout // 2, cout, 1, lab=lab))

    def forward(self, x):
        outs = [x]
        for layer in self.layers:
            outs.append(layer(outs[-1]))
        y = self.aggregation(torch.cat(outs, dim=1))
        return y + x if self.residual else y


class HGNetV2Stage(nn.Module):
    def __init__(self, cfg: DFineConfig, i: int):
        super().__init__()
        cin, mid, cout = cfg.stage_in_channels[i], cfg.stage_mid_channels[i], cfg.stage_out_channels[i]
        self.downsample = (HGNetV2ConvLayer(cin, cin, 3, stride=2, groups=cin, activation=None)
                           if cfg.stage_downsample[i] else nn.Identity())
        self.blocks = nn.ModuleList(
            HGNetV2BasicLayer(cin if b == 0 else cout, mid, cout, cfg.stage_numb_of_layers[i], cfg.stage_kernel_size[i],
                              residual=b != 0, light=cfg.stage_light_block[i], lab=cfg.use_learnable_affine_block)
            for b in range(cfg.stage_num_blocks[i]))

    def forward(self, x):
        x = self.downsample(x)
        for block in self.blocks:
            x = block(x)
        return x


class HGNetV2Encoder(nn.Module):
    def __init__(self, cfg: DFineConfig):
        super().__init__()
        self.stages = nn.ModuleList(HGNetV2Stage(cfg, i) for i in range(len(cfg.stage_out_channels)))


class HGNetV2Backbone(RTDetrResNetBackbone):
    """transformers' ``HGNetV2Backbone``: the stem and stages; RT-DETR's backbone's forward (the maps of the
    stages ``backbone_out_indices``, 1 = the first)."""

    def __init__(self, cfg: DFineConfig):
        nn.Module.__init__(self)
        self.out_indices = tuple(cfg.backbone_out_indices)
        self.embedder = HGNetV2Embeddings(cfg)
        self.encoder = HGNetV2Encoder(cfg)
