"""ResNet (He et al. 2016, "Deep Residual Learning for Image Recognition"), as torchvision's
``ResNet``: basic blocks (ResNet-18/34) or bottlenecks v1.5 (ResNet-50/101/152), with the
bottleneck's 3x3 conv grouped (ResNeXt, Xie et al. 2017) or widened (Wide ResNet, Zagoruyko &
Komodakis 2016).

v1.5 puts the stride of a downsampling bottleneck on the 3x3 conv (``conv2``), not on
the first 1x1 -- what torchvision's and timm's ResNets do. Module names are torchvision's
(``conv1``, ``bn1``, ``layer1..4.N.{conv1,bn1,conv2,bn2[,conv3,bn3]}``, ``downsample.0/1``,
``fc``); timm's ResNets use the same parameter names, so checkpoints of both load key for key
(``convert.py``).

``output_stride=16`` / ``8`` (timm's; Yu & Koltun 2016, as DeepLab and DETR-DC5 use it) keeps the
last stage / the last two at stride 1 and dilates their 3x3 convs by 2 / 2 and 4 instead, the
first block of each such stage keeping the previous dilation (timm's ``make_blocks``; torchvision's
``replace_stride_with_dilation=[False, False, True]`` / ``[False, True, True]`` build the same).

What the weights cannot say. The dilation, the activation, anti-aliasing, drop-block / drop-path and
BatchNorm's eps / momentum change the function but not the keys or shapes. A *live*
torchvision / timm module is checked for all of them and refused (``CheckpointError``)
where it is not this network (its ``output_stride`` is read from its strides); a state dict or
file cannot be checked, so it is read as the network of the given ``output_stride`` (default 32:
stride 2 in each later stage's first 3x3, no dilation), ReLU.

``frozen_bn=True`` makes every BatchNorm use its running statistics in train mode too and
leaves its affine parameters untrained -- torchvision's ``FrozenBatchNorm2d``, as DETR's
backbone uses; a live module built with it loads as ``frozen_bn=True``.

There is no attention in a ResNet: ``set_attention`` accepts any backend name and
changes nothing.
"""
from __future__ import annotations


import torch
from torch import nn

from fastzoo.models import hf_outputs
from fastzoo.models.base import FastzooModel
from fastzoo.models.resnet.config import EXPANSION, ResNetConfig, bottleneck_width
from fastzoo.models.timm_api import TimmModelAPI, check_images, take_indices

torch.fx.wrap("check_images")  # symbolic tracing records the input check as one call (see timm_api)


class BasicBlock(nn.Module):
    """3x3 (stride here) -> 3x3, plus the shortcut, then ReLU (ResNet-18/34). In a dilated stage
    the first 3x3 of its first block keeps the previous stage's dilation (``first_dilation``), as timm's."""

    expansion = EXPANSION["basic"]

    def __init__(self, inplanes: int, planes: int, stride: int = 1, dilation: int = 1, first_dilation: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=first_dilation, dilation=first_dilation,
                               bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(inplanes, planes, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x):
        # torchvision's op order, so FX graph node names (create_feature_extractor) are its too
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.downsample is None else self.downsample(x)  # in place, as torchvision: one tensor fewer a block
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 in ``groups`` groups (stride here: v1.5) -> 1x1 expand, plus the shortcut,
    then ReLU. ResNeXt (Xie et al. 2017) groups the 3x3; Wide ResNet (Zagoruyko & Komodakis 2016)
    widens it (``width_per_group``). In a dilated stage the 3x3 of its first block keeps the previous
    stage's dilation, as timm's and torchvision's."""

    expansion = EXPANSION["bottleneck"]

    def __init__(self, inplanes: int, planes: int, stride: int = 1, groups: int = 1, width_per_group: int = 64,
                 out: int | None = None, dilation: int = 1):
        super().__init__()
        width, out = bottleneck_width(planes, groups, width_per_group), out or planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=dilation, dilation=dilation, groups=groups,
                               bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inplanes, out, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x):
        # torchvision's op order, so FX graph node names (create_feature_extractor) are its too
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x if self.downsample is None else self.downsample(x)  # in place, as torchvision: one tensor fewer a block
        return self.relu(out)


def _shortcut(inplanes: int, out: int, stride: int) -> nn.Sequential | None:
    """The projection shortcut (1x1 conv with the block's stride, BN) where the shape changes, else None."""
    if stride == 1 and inplanes == out:
        return None
    return nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))


def _block(cfg: ResNetConfig, inplanes: int, planes: int, out: int, stride: int, dilation: int,
           first_dilation: int) -> nn.Module:
    if cfg.block == "basic":
        return BasicBlock(inplanes, planes, stride, dilation, first_dilation)
    return Bottleneck(inplanes, planes, stride, cfg.groups, cfg.width_per_group, out, first_dilation)


def _timm_block(architecture: str | None) -> str | None:
    """The block kind timm's ``architecture`` builds: its entrypoint fixes it, and timm's
    ``model_args`` cannot name a class. Asked of timm itself, on the meta device (nothing allocated)."""
    if not architecture:
        return None
    import timm

    try:
        with torch.device("meta"):
            first = timm.create_model(architecture, pretrained=False, layers=(1, 1, 1, 1)).layer1[0]
    except (RuntimeError, TypeError, AttributeError):  # not one of timm's ResNets
        return None
    return {"BasicBlock": "basic", "Bottleneck": "bottleneck"}.get(type(first).__name__)


class ResNet(hf_outputs.TransformersCall, TimmModelAPI, FastzooModel):
    family = "resnet"
    config_class = ResNetConfig
    timm_architecture = "resnet50"
    timm_feature_cls = "list"  # timm's features_only for ResNet: FeatureListNet over the children
    default_out_indices = (0, 1, 2, 3, 4)

    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.config = cfg
        stem = cfg.stem
        self.conv1 = nn.Conv2d(cfg.in_chans, stem, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        # timm's feature_info: its channels and reductions, and module names of this model (timm's
        # stem activation is act1, here torchvision's relu): timm's hook / fx feature wrappers and
        # any code that hooks model.get_submodule(info.module_name()) find the module computing it
        self.feature_info = [dict(num_chs=stem, reduction=2, module="relu")]
        inplanes, reduction = stem, 4
        for i, (n, planes, (stride, dilation, previous)) in enumerate(zip(cfg.layers, cfg.channels, cfg.stage_geometry())):
            out = cfg.stage_out(i)
            blocks = [_block(cfg, inplanes, planes, out, stride, dilation, previous)]
            blocks += [_block(cfg, out, planes, out, 1, dilation, dilation) for _ in range(n - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
            inplanes, reduction = out, reduction * stride
            self.feature_info.append(dict(num_chs=inplanes, reduction=reduction, module=f"layer{i + 1}"))
        self.num_stages = len(cfg.layers)
        self.inplanes = inplanes  # torchvision's attribute: its FPN helper (_resnet_fpn_extractor) sizes from it
        self.avgpool = nn.AdaptiveAvgPool2d(1) if cfg.global_pool else nn.Identity()
        self.fc = nn.Linear(cfg.num_features, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self._init_weights()
        if cfg.frozen_bn:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.requires_grad_(False)
        if cfg.channels_last:
            self.to(memory_format=torch.channels_last)
        self.train()  # puts frozen BatchNorms in eval mode

    def train(self, mode: bool = True) -> "ResNet":
        super().train(mode)
        if self.config.frozen_bn:  # the statistics stay the pretrained ones, whatever the mode
            for m in self.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self

    def _init_weights(self):
        # torchvision's init; nn.Linear keeps its default, as in torchvision.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if self.config.zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def _stem(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        images_BCHW = check_images(images_BCHW, self.config.in_chans, weight=self.conv1.weight)
        if self.config.channels_last:
            images_BCHW = images_BCHW.contiguous(memory_format=torch.channels_last)
        return self.relu(self.bn1(self.conv1(images_BCHW)))

    def _stage(self, i: int, x: torch.Tensor) -> torch.Tensor:
        stage = getattr(self, f"layer{i + 1}")
        if not self.grad_checkpointing or not isinstance(stage, nn.Sequential):  # an Identity: pruned
            return stage(x)
        for block in stage:  # timm's checkpoint_seq(flatten=True): one block at a time
            x = self._run_block(block, x)
        return x

    def forward_features(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """The last stage's feature map (C5: [B, num_features, H/output_stride, W/output_stride]; 2048
        channels for ResNet-50)."""
        x = self.maxpool(self._stem(images_BCHW))
        for i in range(self.num_stages):
            x = self._stage(i, x)
        return x

    def forward_intermediates(
        self,
        images_BCHW: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ):
        """timm's ``forward_intermediates``: feature maps ``indices`` of the stem activation (0) and
        each stage (1..), as ``feature_info`` lists them (None: all, an int: the last n, negative
        from the end). Returns ``(final feature map, intermediates)`` or only the intermediates.
        ``norm`` is accepted and does nothing, as in timm (a ResNet has no final norm)."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt={output_fmt!r}: a ResNet's feature maps are 'NCHW'")
        taken, last = take_indices(self.num_stages + 1, indices)
        x = self._stem(images_BCHW)
        out = [x] if 0 in taken else []
        x = self.maxpool(x)
        for i in range(last if stop_early else self.num_stages):
            x = self._stage(i, x)
            if i + 1 in taken:
                out.append(x)
        return out if intermediates_only else (x, out)

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """timm's: the stages after the last of ``indices`` (as :meth:`forward_intermediates` reads
        them) become identities, and with ``prune_head`` the pooling and ``fc`` too. Returns the
        kept indices. ``prune_norm`` does nothing: a ResNet has no final norm."""
        taken, last = take_indices(self.num_stages + 1, indices)
        for i in range(last, self.num_stages):
            setattr(self, f"layer{i + 1}", nn.Identity())
        if prune_head:
            self.reset_classifier(0, "")
        return taken

    def forward_head(self, x_BCHW: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.avgpool(x_BCHW)
        if self.config.global_pool:
            x = torch.flatten(x, 1)
        return x if pre_logits else self.fc(x)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        """timm's and torchvision's call: ``model(images)`` -> logits (pooled features without a head).
        transformers' call (``model(pixel_values=, labels=, ...)``) -> its output class: :meth:`hf_forward`."""
        return self.forward_head(self.forward_features(images_BCHW))

    def hf_forward(self, pixel_values, labels=None, **kwargs):
        return hf_outputs.resnet_forward(self, pixel_values, labels, **kwargs)

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm's parameter groups (layer decay): the stem, then one group per block (per stage if ``coarse``)."""
        return dict(stem=r"^conv1|bn1|maxpool", blocks=r"^layer(\d+)" if coarse else r"^layer(\d+)\.(\d+)")

    def get_classifier(self, name_only: bool = False):
        return "fc" if name_only else self.fc

    def timm_model_args(self) -> dict | None:
        c = self.config
        if c.frozen_bn or not c.torchvision_shaped:  # timm's ResNet has no frozen BatchNorm, nor other widths
            return None
        if _timm_block(self.pretrained_cfg.get("architecture")) != c.block:  # e.g. resnet50's cfg on basic blocks
            return None
        # timm's names: cardinality = groups, base_width = width_per_group; the block comes with the architecture
        return {"layers": list(c.layers), "channels": list(c.channels), "cardinality": c.groups,
                "base_width": c.width_per_group, "in_chans": c.in_chans, "num_classes": c.num_classes,
                "global_pool": c.global_pool, "output_stride": c.output_stride}

    def hf_pretrained(self) -> tuple[dict, dict]:
        from fastzoo.models.resnet import hf, hf_config

        return hf_config.hf_config_dict(self.config), hf.from_fastzoo(self.state_dict(), self.config)

    def reset_classifier(self, num_classes: int, global_pool: str = "avg") -> None:
        """A fresh ``fc`` for ``num_classes`` (0: none) and pooling ``global_pool`` ('avg', or ''
        for none with num_classes=0), on the model's device and dtype, as timm's."""
        if num_classes < 0:
            raise ValueError(f"num_classes={num_classes} must be >= 0 (0: no classifier)")
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool={global_pool!r}: fastzoo's ResNet pools with 'avg' or '' (none)")
        if global_pool == "" and num_classes:
            raise ValueError(f"global_pool='' (no pooling) needs num_classes=0, got num_classes={num_classes}")
        self.config.num_classes, self.config.global_pool = num_classes, global_pool
        w = self.conv1.weight
        self.avgpool = (nn.AdaptiveAvgPool2d(1) if global_pool else nn.Identity()).train(self.training)
        fc = nn.Linear(self.config.num_features, num_classes) if num_classes else nn.Identity()
        self.fc = fc.to(device=w.device, dtype=w.dtype).train(self.training)

    def adapt_checkpoint(self, state, changed):
        if "num_classes" not in changed:
            return state, [], []
        old = state.pop("fc.weight", None)
        state.pop("fc.bias", None)
        fresh = [k for k in self.state_dict() if k.startswith("fc.")]
        had = old.shape[0] if old is not None else 0
        return state, fresh, [f"num_classes={self.config.num_classes}: fresh fc (the checkpoint has {had} classes)"]
