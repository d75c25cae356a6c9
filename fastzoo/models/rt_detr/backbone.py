"""RT-DETR's backbone: ResNet-vd (He et al. 2019, "Bag of Tricks": a deep 3x3 stem, strided shortcuts
through a 2x2 average pool), as transformers' ``RTDetrResNetBackbone`` computes it, under its module names
(``embedder.embedder.N``, ``encoder.stages.N.layers.M.{layer, shortcut}``), every BatchNorm frozen as
transformers' ``RTDetrConvEncoder`` makes it (``freeze_backbone_batch_norms``).

fastzoo's ResNet (torchvision's) has neither the deep stem nor the pooled shortcut, and DETR's
transformers-ResNet backbone has the plain ones: the vd blocks are written here, small, beside them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.models.detr.backbone import freeze_batch_norm
from fastzoo.models.detr.transformer import ACTIVATIONS
from fastzoo.models.rt_detr.config import RTDetrConfig


class RTDetrResNetConvLayer(nn.Module):
    """conv (padding k // 2, no bias) -> BatchNorm -> activation (or none)."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, activation: str | None = "relu"):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)
        self.normalization = nn.BatchNorm2d(cout)
        self.act = ACTIVATIONS[activation] if activation is not None else None

    def forward(self, x):
        x = self.normalization(self.convolution(x))
        return x if self.act is None else self.act(x)


class RTDetrResNetShortCut(nn.Module):
    """1x1 conv -> BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)
        self.normalization = nn.BatchNorm2d(cout)

    def forward(self, x):
        return self.normalization(self.convolution(x))


def _pooled(shortcut: nn.Module) -> nn.Sequential:
    """The vd shortcut: a 2x2 average pool (ceil mode), then ``shortcut`` unstrided."""
    return nn.Sequential(nn.AvgPool2d(2, 2, 0, ceil_mode=True), shortcut)


class RTDetrResNetBasicLayer(nn.Module):
    """Two 3x3 convolutions; the first layer of a stage always has a projecting shortcut (pooled where
    the width changes), as transformers' ``RTDetrResNetBasicLayer``."""

    def __init__(self, cfg: RTDetrConfig, cin: int, cout: int, stride: int = 1, first: bool = False):
        super().__init__()
        if not first:
            self.shortcut = nn.Identity()
        elif cin != cout:
            self.shortcut = _pooled(RTDetrResNetShortCut(cin, cout))
        else:
            self.shortcut = RTDetrResNetShortCut(cin, cout, stride=stride)
        self.layer = nn.Sequential(RTDetrResNetConvLayer(cin, cout, stride=stride),  # ReLU whatever hidden_act
                                   RTDetrResNetConvLayer(cout, cout, activation=None))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.act(self.layer(x) + self.shortcut(x))


class RTDetrResNetBottleNeckLayer(nn.Module):
    """1x1 -> 3x3 -> 1x1 (width / 4 inside), the stride in the 3x3 (or the first 1x1:
    ``downsample_in_bottleneck``); a strided shortcut is pooled."""

    def __init__(self, cfg: RTDetrConfig, cin: int, cout: int, stride: int = 1):
        super().__init__()
        project = cin != cout or stride != 1
        if stride == 2:
            self.shortcut = _pooled(RTDetrResNetShortCut(cin, cout) if project else nn.Identity())
        else:
            self.shortcut = RTDetrResNetShortCut(cin, cout, stride=stride) if project else nn.Identity()
        mid = cout // 4
        first_stride, mid_stride = (stride, 1) if cfg.downsample_in_bottleneck else (1, stride)
        # the inner convolutions' activation is ReLU whatever hidden_act (transformers' default argument)
        self.layer = nn.Sequential(RTDetrResNetConvLayer(cin, mid, kernel_size=1, stride=first_stride),
                                   RTDetrResNetConvLayer(mid, mid, stride=mid_stride),
                                   RTDetrResNetConvLayer(mid, cout, kernel_size=1, activation=None))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.act(self.layer(x) + self.shortcut(x))


class RTDetrResNetStage(nn.Module):
    def __init__(self, cfg: RTDetrConfig, cin: int, cout: int, stride: int, depth: int):
        super().__init__()
        if cfg.layer_type == "bottleneck":
            first = RTDetrResNetBottleNeckLayer(cfg, cin, cout, stride=stride)
            rest = [RTDetrResNetBottleNeckLayer(cfg, cout, cout) for _ in range(depth - 1)]
        else:
            first = RTDetrResNetBasicLayer(cfg, cin, cout, stride=stride, first=True)
            rest = [RTDetrResNetBasicLayer(cfg, cout, cout) for _ in range(depth - 1)]
        self.layers = nn.Sequential(first, *rest)

    def forward(self, x):
        return self.layers(x)


class RTDetrResNetEmbeddings(nn.Module):
    """The deep stem: 3x3 stride 2 to half the width, 3x3, 3x3 to the full width, then a 3x3 max pool."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        half, act = cfg.embedding_size // 2, cfg.hidden_act
        self.embedder = nn.Sequential(RTDetrResNetConvLayer(cfg.num_channels, half, stride=2, activation=act),
                                      RTDetrResNetConvLayer(half, half, activation=act),
                                      RTDetrResNetConvLayer(half, cfg.embedding_size, activation=act))

    def forward(self, x):
        return F.max_pool2d(self.embedder(x), kernel_size=3, stride=2, padding=1)


class RTDetrResNetEncoder(nn.Module):
    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        widths = (cfg.embedding_size, *cfg.hidden_sizes)
        self.stages = nn.ModuleList(
            RTDetrResNetStage(cfg, widths[i], widths[i + 1], 2 if i > 0 or cfg.downsample_in_first_stage else 1, d)
            for i, d in enumerate(cfg.depths))


class RTDetrResNetBackbone(nn.Module):
    """transformers' ``RTDetrResNetBackbone``: the stem and stages; the feature maps of the stages
    ``backbone_out_indices`` (1 = the first stage). Another family's backbone with the same parts
    (``embedder``, ``encoder.stages``, ``out_indices``) keeps this forward."""

    def __init__(self, cfg: RTDetrConfig):
        super().__init__()
        self.out_indices = tuple(cfg.backbone_out_indices)
        self.embedder = RTDetrResNetEmbeddings(cfg)
        self.encoder = RTDetrResNetEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        x, maps = self.embedder(pixel_values), []
        for i, stage in enumerate(self.encoder.stages, start=1):
            x = stage(x)
            if i in self.out_indices:
                maps.append(x)
            if i == self.out_indices[-1]:
                break
        return maps


class RTDetrConvEncoder(nn.Module):
    """transformers' ``RTDetrConvEncoder`` (D-FINE's ``DFineConvEncoder``): the ``backbone`` (``model``),
    BatchNorms frozen unless ``freeze_backbone_batch_norms`` is False."""

    def __init__(self, cfg, backbone: type[nn.Module] = RTDetrResNetBackbone):
        super().__init__()
        self.model = backbone(cfg)
        if cfg.freeze_backbone_batch_norms:
            freeze_batch_norm(self.model)

    def forward(self, pixel_values):
        return self.model(pixel_values)
