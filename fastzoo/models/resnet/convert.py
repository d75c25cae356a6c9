"""torchvision checkpoints. fastzoo's ResNet uses torchvision's module names, so
conversion is a check that the keys are a ResNet's, plus reading from the weights what they
fix of the architecture (block, depth, widths, groups).

BatchNorm buffers: fastzoo's BatchNorm2d layers keep ``num_batches_tracked`` as
torchvision and timm do, and it goes out on export. Old checkpoints saved without it
(torchvision's first ImageNet files) get it as 0, which is what ``nn.BatchNorm2d`` itself
does when loading them; it only matters with ``momentum=None``, which no ResNet uses.

Live modules. Dilation, the activation, anti-aliasing, drop-block / drop-path and BN's
eps / momentum change the function but not the keys, so a live torchvision / timm ResNet
is checked module by module (:func:`check_resnet_module`): its ``output_stride`` is read from
its strides, and it is refused where it differs from fastzoo's ResNet of that output stride
(torchvision's ``replace_stride_with_dilation`` patterns that no output stride gives among them). A
state dict cannot be checked: it is read as the network of the ``output_stride`` given (32 by default).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from fastzoo.errors import CheckpointError
from fastzoo.models.resnet.config import EXPANSION, stage_geometry
from fastzoo.models.spec import SameKeys

_BLOCK = re.compile(r"^layer(\d+)\.(\d+)\.conv1\.weight$")
_CONV = re.compile(r"^(layer\d+\.\d+)\.(conv1|conv2|conv3|downsample\.0)$")
# Module types whose function is fixed by their weights and the hyper-parameters checked below.
_ROOTS = {"torchvision.models.resnet.ResNet", "timm.models.resnet.ResNet"}
_BLOCKS = {f"{lib}.models.resnet.{cls}": kind for lib in ("torchvision", "timm")
           for cls, kind in (("BasicBlock", "basic"), ("Bottleneck", "bottleneck"))}
_PLAIN = (nn.Sequential, nn.ReLU, nn.Identity, nn.Flatten, nn.Linear)
_FROZEN_BN = "torchvision.ops.misc.FrozenBatchNorm2d"
# per block kind, each conv's kernel and role: "1x1" (stride 1), "shortcut" (1x1 with the block's
# stride), "first" (3x3 with the block's stride and its first dilation), "3x3" (3x3, the stage's dilation)
_BLOCK_CONVS = {
    "basic": {"conv1": (3, "first"), "conv2": (3, "3x3"), "downsample.0": (1, "shortcut")},
    "bottleneck": {"conv1": (1, "1x1"), "conv2": (3, "first"), "conv3": (1, "1x1"), "downsample.0": (1, "shortcut")},
}


def _type_name(m: nn.Module) -> str:
    return f"{type(m).__module__}.{type(m).__name__}"


def _expected_conv(name: str, blocks: dict[str, str], geometry: list[tuple[int, int, int]]):
    """(kernel, stride, padding, dilation) of conv ``name`` in fastzoo's ResNet, whose blocks are
    ``blocks`` (name -> 'basic' / 'bottleneck') and whose stages have ``geometry``
    (:func:`~fastzoo.models.resnet.config.stage_geometry`), or None if it has no such conv."""
    if name == "conv1":
        return (7, 7), (2, 2), (3, 3), (1, 1)
    m = _CONV.match(name)
    if m is None or m[1] not in blocks or m[2] not in _BLOCK_CONVS[blocks[m[1]]]:
        return None
    kernel, role = _BLOCK_CONVS[blocks[m[1]]][m[2]]
    stage, index = (int(i) for i in m[1][len("layer"):].split("."))
    if stage > len(geometry):
        return None
    stride, dilation, previous = geometry[stage - 1]
    s = stride if index == 0 and role in ("first", "shortcut") else 1
    d = (previous if index == 0 else dilation) if role == "first" else dilation if role == "3x3" else 1
    return (kernel, kernel), (s, s), (d * (kernel // 2),) * 2, (d, d)


def _output_stride(module: nn.Module, blocks: dict[str, str]) -> int:
    """The output stride a live ResNet's strides give (timm does not keep its ``output_stride``;
    torchvision has none): 8 or 16, else 32 (its convs are then checked against the plain net)."""
    net = 4
    for name, kind in blocks.items():
        if re.fullmatch(r"layer\d+\.0", name):
            conv = module.get_submodule(f"{name}.{'conv2' if kind == 'bottleneck' else 'conv1'}")
            net *= conv.stride[0] if isinstance(conv, nn.Conv2d) else 1
    return net if net in (8, 16) else 32


def check_resnet_module(module: nn.Module) -> dict:
    """Raise CheckpointError unless the live ``module`` computes fastzoo's ResNet (what its keys
    cannot show: strides, dilation, activation, pooling, extra layers, BN settings). Returns the
    fields it reads: ``output_stride`` (from its strides) and ``frozen_bn`` (torchvision's
    FrozenBatchNorm2d)."""
    problems, frozen = [], set()
    blocks = {name: _BLOCKS[_type_name(m)] for name, m in module.named_modules() if _type_name(m) in _BLOCKS}
    output_stride = _output_stride(module, blocks)
    stages = len({name.split(".")[0] for name in blocks})
    geometry = stage_geometry(stages, output_stride)
    for name, m in module.named_modules():
        kind = _type_name(m)
        where = name or "the root"
        if name == "":
            if kind not in _ROOTS:
                problems.append(f"the module is a {kind}, not torchvision's or timm's ResNet")
            if getattr(m, "drop_rate", 0.0):
                problems.append(f"drop_rate={m.drop_rate} (dropout before fc)")
        elif kind in _BLOCKS:
            pass  # its children are checked one by one (timm's drop_block / aa / drop_path among them)
        elif type(m) is nn.Conv2d:
            want = _expected_conv(name, blocks, geometry)
            got = (m.kernel_size, m.stride, m.padding, m.dilation)
            # only a bottleneck's 3x3 is grouped, by as many groups as its weight shows (ResNeXt)
            grouped = name.endswith(".conv2") and blocks.get(name.rsplit(".", 1)[0]) == "bottleneck"
            if want is None:
                problems.append(f"an extra conv {name}")
            elif got != want or (m.groups != 1 and not grouped) or m.padding_mode != "zeros":
                problems.append(f"{name} has kernel/stride/padding/dilation {got}, groups {m.groups}, "
                                f"padding_mode {m.padding_mode}; fastzoo (output_stride={output_stride}) has {want}, "
                                f"{'any' if grouped else 1}, zeros")
        elif type(m) in (nn.BatchNorm2d, nn.SyncBatchNorm) or kind == _FROZEN_BN:
            frozen.add(kind == _FROZEN_BN)
            if m.eps != 1e-5:
                problems.append(f"{name} has eps={m.eps} (fastzoo: 1e-5)")
            if kind != _FROZEN_BN and (m.momentum != 0.1 or not m.affine or not m.track_running_stats):
                problems.append(f"{name} has momentum={m.momentum}, affine={m.affine}, "
                                f"track_running_stats={m.track_running_stats} (fastzoo: 0.1, True, True)")
        elif type(m) is nn.MaxPool2d:
            if (m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode) not in ((3, 2, 1, 1, False),):
                problems.append(f"{name} is {m} (fastzoo: 3x3, stride 2, padding 1)")
        elif type(m) is nn.AdaptiveAvgPool2d:
            if m.output_size not in (1, (1, 1)):
                problems.append(f"{name} pools to {m.output_size} (fastzoo: 1x1)")
        elif kind == "timm.layers.adaptive_avgmax_pool.SelectAdaptivePool2d":
            if m.pool_type != "avg" or not isinstance(m.flatten, nn.Flatten):
                problems.append(f"{name} is {m} (fastzoo: flattened average pooling)")
        elif type(m) not in _PLAIN:
            problems.append(f"{where} is a {kind}")  # an activation, anti-aliasing, drop-block, attention...
    if len(frozen) > 1:
        problems.append("it mixes FrozenBatchNorm2d and BatchNorm2d layers")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; ... and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise CheckpointError(
            f"live {type(module).__name__} module: not the function of fastzoo's ResNet (torchvision's: stride 2 in "
            f"each later stage's first block, on a bottleneck's 3x3 (v1.5), ReLU, BatchNorm eps 1e-5; dilated only as "
            f"timm's output_stride=16 / 8 or torchvision's replace_stride_with_dilation=[False, False, True] / "
            f"[False, True, True]): {shown}. Its keys fit, but loading it would silently change the network; to take "
            f"its weights into the plain network anyway, pass module.state_dict()."
        )
    return {"frozen_bn": frozen == {True}, "output_stride": output_stride}


class ResNetConverter(SameKeys):
    """ResNet state dicts (basic or bottleneck blocks): torchvision's and timm's are the same keys."""

    def __init__(self, format: str):
        self.format = format

    @staticmethod
    def matches(state: dict) -> bool:
        w = state.get("conv1.weight")  # a 7x7 stem: not timm's deep-stem variants (conv1.0 ...)
        return w is not None and w.ndim == 4 and w.shape[-1] == 7 and "layer1.0.conv2.weight" in state

    @staticmethod
    def to_fastzoo(state: dict) -> dict:
        out = dict(state)
        for k in state:
            if k.endswith(".running_var"):
                out.setdefault(k[: -len("running_var")] + "num_batches_tracked", torch.tensor(0, dtype=torch.long))
        return out

    @staticmethod
    def check_module(module) -> None:
        check_resnet_module(module)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        """What the keys fix: the block (a ``conv3`` means bottlenecks), blocks per stage, stage
        widths (a bottleneck's output / 4, a basic block's 3x3), the 3x3's ``groups`` (from its
        weight's input channels) and ``width_per_group`` (the smallest that gives the first stage's
        3x3 width), input channels, and the classifier size (0 when the checkpoint has no ``fc``);
        from a live module also ``frozen_bn`` and ``output_stride`` (after checking that it is
        fastzoo's ResNet at all)."""
        depth: dict[int, int] = {}
        for k in state:
            m = _BLOCK.match(k)
            if m:
                stage, block = int(m[1]), int(m[2])
                depth[stage] = max(depth.get(stage, 0), block + 1)
        stages = sorted(depth)
        out = check_resnet_module(module) if module is not None else {}
        if "layer1.0.conv3.weight" in state:
            channels = tuple(state[f"layer{s}.0.conv3.weight"].shape[0] // EXPANSION["bottleneck"] for s in stages)
            width, per_group = state[f"layer{stages[0]}.0.conv2.weight"].shape[:2]  # [width, width / groups, 3, 3]
            shape = dict(block="bottleneck", groups=width // per_group,
                         width_per_group=-(-64 * per_group // channels[0]))  # int(c * wpg / 64) = per_group
        else:
            channels = tuple(state[f"layer{s}.0.conv2.weight"].shape[0] for s in stages)
            shape = dict(block="basic", groups=1, width_per_group=64)
        return {
            **out,
            **shape,
            "num_classes": state["fc.weight"].shape[0] if "fc.weight" in state else 0,
            "layers": tuple(depth[s] for s in stages),
            "channels": channels,
            "in_chans": state["conv1.weight"].shape[1],
        }


RESNET = ResNetConverter("torchvision")
TIMM_RESNET = ResNetConverter("timm")  # timm's ResNet has torchvision's keys
