"""DETR's convolutional backbone: a ResNet with frozen BatchNorm, as either of the two modules
transformers' ``DetrConvEncoder`` builds, under that module's own parameter names:

- ``use_timm_backbone=True`` (the hub checkpoints; ``backbone`` names it, "resnet50"): timm's ResNet,
  whose names are torchvision's (``conv1``, ``layer1.0.conv1`` ...): fastzoo's ResNet; with
  ``dilation`` (DC5) its last stage dilated, timm's ``output_stride=16``; initialised as timm's
  (``zero_init_last``: each block's last BatchNorm weight 0);
- ``use_timm_backbone=False``: transformers' ``ResNetBackbone`` (``embedder.embedder.convolution``,
  ``encoder.stages.0.layers.0.shortcut`` ...), any stem and stage widths (:class:`HFResNet`),
  initialised as transformers' ``ResNetPreTrainedModel`` (convolutions kaiming-normal, fan out).

Either way every BatchNorm becomes :class:`DetrFrozenBatchNorm2d` (statistics and affine
parameters are buffers), and the C5 feature map comes back with the pixel mask resized to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastzoo.models.detr.config import DetrConfig
from fastzoo.models.resnet import ResNet
from fastzoo.models.resnet.config import ResNetConfig


class DetrFrozenBatchNorm2d(nn.Module):
    """BatchNorm with fixed statistics and affine parameters (buffers), transformers' formula
    (``x * scale + shift``, eps 1e-5 before the rsqrt)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict.pop(prefix + "num_batches_tracked", None)  # a trainable BatchNorm's checkpoint
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, x):
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + 1e-5).rsqrt()
        shift = self.bias.reshape(1, -1, 1, 1) - self.running_mean.reshape(1, -1, 1, 1) * scale
        return x * scale + shift


def freeze_batch_norm(module: nn.Module) -> nn.Module:
    """Every ``nn.BatchNorm2d`` below ``module`` replaced by a frozen one holding its values."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            frozen = DetrFrozenBatchNorm2d(child.num_features)
            with torch.no_grad():
                for k in ("weight", "bias", "running_mean", "running_var"):
                    getattr(frozen, k).copy_(getattr(child, k))
            setattr(module, name, frozen)
        else:
            freeze_batch_norm(child)
    return module


# -- transformers' ResNetBackbone, its names ------------------------------------------------------
class ConvLayer(nn.Module):
    """transformers' ``ResNetConvLayer``: conv (padding k // 2, no bias) -> BN -> ReLU (or none)."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, activation: bool = True):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=kernel_size // 2, bias=False)
        self.normalization = nn.BatchNorm2d(cout)
        self.activation = nn.ReLU() if activation else nn.Identity()

    def forward(self, x):
        return self.activation(self.normalization(self.convolution(x)))


class ShortCut(nn.Module):
    """transformers' ``ResNetShortCut``: 1x1 conv (strided) -> BN."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.convolution = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
        self.normalization = nn.BatchNorm2d(cout)

    def forward(self, x):
        return self.normalization(self.convolution(x))


class Block(nn.Module):
    """transformers' basic (3x3, 3x3) or bottleneck (1x1, 3x3 strided, 1x1; width out // 4) layer."""

    def __init__(self, layer_type: str, cin: int, cout: int, stride: int):
        super().__init__()
        self.shortcut = ShortCut(cin, cout, stride) if cin != cout or stride != 1 else nn.Identity()
        if layer_type == "basic":
            convs = [ConvLayer(cin, cout, stride=stride), ConvLayer(cout, cout, activation=False)]
        else:
            mid = cout // 4
            convs = [ConvLayer(cin, mid, 1), ConvLayer(mid, mid, stride=stride), ConvLayer(mid, cout, 1, activation=False)]
        self.layer = nn.Sequential(*convs)

    def forward(self, x):
        return torch.relu(self.layer(x) + self.shortcut(x))


class Embedder(nn.Module):
    def __init__(self, num_channels: int, embedding_size: int):
        super().__init__()
        self.embedder = ConvLayer(num_channels, embedding_size, 7, stride=2)
        self.pooler = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x):
        return self.pooler(self.embedder(x))


class Stage(nn.Module):
    def __init__(self, layer_type: str, cin: int, cout: int, depth: int, stride: int):
        super().__init__()
        self.layers = nn.Sequential(Block(layer_type, cin, cout, stride),
                                    *(Block(layer_type, cout, cout, 1) for _ in range(depth - 1)))

    def forward(self, x):
        return self.layers(x)


class Encoder(nn.Module):
    def __init__(self, cfg: DetrConfig):
        super().__init__()
        widths = (cfg.embedding_size, *cfg.hidden_sizes)
        self.stages = nn.ModuleList(Stage(cfg.layer_type, widths[i], widths[i + 1], d, 1 if i == 0 else 2)
                                    for i, d in enumerate(cfg.depths))


class HFResNet(nn.Module):
    """transformers' ``ResNetBackbone`` (stride in the 3x3, the first stage not downsampling), C5 out."""

    def __init__(self, cfg: DetrConfig):
        super().__init__()
        self.embedder = Embedder(cfg.num_channels, cfg.embedding_size)
        self.encoder = Encoder(cfg)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward_features(self, x):
        x = self.embedder(x)
        for stage in self.encoder.stages:
            x = stage(x)
        return x

    def forward_intermediates(self, x, indices, intermediates_only: bool = True):
        """The outputs of stages ``indices`` (1: the first stage), as ``ResNetBackbone``'s ``out_features``."""
        x, out = self.embedder(x), []
        for i, stage in enumerate(self.encoder.stages[:max(indices)]):
            x = stage(x)
            if i + 1 in indices:
                out.append(x)
        return out


def stage_of(name: str, timm: bool) -> int:
    """The stage (0: the stem, 1..: layer1.. / stages.0..) a backbone parameter belongs to."""
    if timm:
        return int(name[len("layer")]) if name.startswith("layer") else 0
    return int(name.split(".")[2]) + 1 if name.startswith("encoder.stages.") else 0


def trains(name: str, cfg: DetrConfig) -> bool:
    """Whether backbone parameter ``name`` trains under ``cfg.freeze_backbone``."""
    rule = cfg.freeze_backbone
    if rule == "transformers":
        rule = "none" if cfg.use_timm_backbone else "all"
    if rule in ("all", "none"):
        return rule == "none"
    return stage_of(name, cfg.use_timm_backbone) >= 2


class DetrConvEncoder(nn.Module):
    """The backbone as transformers' ``DetrConvEncoder``: ``model`` is the ResNet."""

    def __init__(self, cfg: DetrConfig):
        super().__init__()
        if cfg.use_timm_backbone:
            mult = 4 if cfg.layer_type == "bottleneck" else 1
            rcfg = ResNetConfig(num_classes=0, global_pool="", block=cfg.layer_type, layers=cfg.depths,
                                channels=tuple(h // mult for h in cfg.hidden_sizes), in_chans=cfg.num_channels,
                                output_stride=16 if cfg.dilation else 32, channels_last=cfg.channels_last,
                                zero_init_residual=True)
            model = ResNet(rcfg)
        else:
            model = HFResNet(cfg)
            if cfg.channels_last:
                model.to(memory_format=torch.channels_last)
        self.model = freeze_batch_norm(model)
        self.channels_last = cfg.channels_last
        for name, p in self.model.named_parameters():
            p.requires_grad_(trains(name, cfg))

    def forward(self, pixel_values_BCHW: torch.Tensor, pixel_mask_BHW: torch.Tensor | None):
        """C5 ``[B, C, h, w]`` (stride 32, 16 with ``dilation``) and the pixel mask resized to it (nearest,
        as transformers) ``[B, h, w]`` bool, True = a real pixel (None when no pixel mask is given)."""
        if self.channels_last:
            pixel_values_BCHW = pixel_values_BCHW.contiguous(memory_format=torch.channels_last)
        f_BCHW = self.model.forward_features(pixel_values_BCHW)
        if pixel_mask_BHW is None:
            return f_BCHW, None
        return f_BCHW, resize_mask(pixel_mask_BHW, f_BCHW.shape[-2:])

    def feature_maps(self, pixel_values_BCHW: torch.Tensor, pixel_mask_BHW: torch.Tensor, indices) -> list:
        """The feature maps of stages ``indices`` (1: the first stage; timm's ``out_indices``), each with
        the pixel mask resized to it: ``[(f [B, C, h, w], mask [B, h, w] bool)]`` (the multi-scale
        detectors' input; ``pixel_mask`` given, all ones for an unpadded batch, as transformers does)."""
        if self.channels_last:
            pixel_values_BCHW = pixel_values_BCHW.contiguous(memory_format=torch.channels_last)
        maps = self.model.forward_intermediates(pixel_values_BCHW, list(indices), intermediates_only=True)
        return [(f, resize_mask(pixel_mask_BHW, f.shape[-2:])) for f in maps]


def resize_mask(pixel_mask_BHW: torch.Tensor, size) -> torch.Tensor:
    """The pixel mask resized to a feature map (nearest, as transformers), bool: True = a real pixel."""
    return F.interpolate(pixel_mask_BHW[None].float(), size=tuple(size)).to(torch.bool)[0]
