"""transformers' ``ResNetForImageClassification`` / ``ResNetModel`` (``microsoft/resnet-*``) as
checkpoints of fastzoo's ResNet, both ways.

transformers' ResNet is torchvision's network (v1.5: the stride on a bottleneck's 3x3, ReLU,
BatchNorm eps 1e-5) under other names, so conversion is renaming:
``embedder.embedder.convolution`` / ``normalization`` are ``conv1`` / ``bn1``; stage ``S`` block ``L``
is ``layer{S+1}.{L}``, its ``layer.J`` ``conv{J+1}`` / ``bn{J+1}``, its ``shortcut`` ``downsample``;
``classifier.1`` is ``fc``. Its config's ``hidden_sizes`` are the stages' output widths (a bottleneck
reduces to a quarter of its output, ``channels``); where they or the stem's ``embedding_size`` are not
torchvision's they are ``out_channels`` / ``stem_width``. Options transformers has and fastzoo's ResNet
has not (a stride on the first 1x1, a downsampling first stage, another activation) are refused by name.
"""
from __future__ import annotations

import re

from fastzoo.errors import CheckpointError
from fastzoo.models.resnet.config import EXPANSION
from fastzoo.models.resnet.hf_config import ARCHITECTURES, _hf_object, architecture_of, check_writable, hf_config_dict

_STEM = {"embedder.embedder.convolution": "conv1", "embedder.embedder.normalization": "bn1"}
_BLOCK = re.compile(r"^encoder\.stages\.(\d+)\.layers\.(\d+)\.(shortcut|layer\.(\d+))\.(convolution|normalization)\.(.+)$")
_TV_BLOCK = re.compile(r"^layer(\d+)\.(\d+)\.(downsample\.(0|1)|conv(\d)|bn(\d))\.(.+)$")


def matches(state: dict) -> bool:
    return any(k.endswith("embedder.embedder.convolution.weight") for k in state)


def to_fastzoo(state: dict) -> dict:
    """torchvision's names for a transformers ResNet state dict (or its gradients)."""
    prefix = "resnet." if any(k.startswith("resnet.embedder.") for k in state) else ""
    out, unknown = {}, []
    for k, v in state.items():
        if k.startswith("classifier.1."):
            out["fc." + k[len("classifier.1."):]] = v
            continue
        k = k[len(prefix):] if k.startswith(prefix) else k
        module, _, leaf = k.rpartition(".")
        if module in _STEM:
            out[f"{_STEM[module]}.{leaf}"] = v
        elif m := _BLOCK.match(k):
            stage, block, which, j, kind, leaf = m.groups()
            if which == "shortcut":
                name = f"downsample.{0 if kind == 'convolution' else 1}"
            else:
                name = f"{'conv' if kind == 'convolution' else 'bn'}{int(j) + 1}"
            out[f"layer{int(stage) + 1}.{block}.{name}.{leaf}"] = v
        else:
            unknown.append(k)
    if unknown:
        raise CheckpointError(f"transformers ResNet checkpoint: keys fastzoo's ResNet has no place for "
                              f"({len(unknown)}): {', '.join(unknown[:8])}")
    return out


def from_fastzoo(state: dict, config) -> dict:
    """A state dict transformers' ResNet class (:func:`architecture_of`) takes with ``strict=True``."""
    check_writable(config)
    prefix = ARCHITECTURES[architecture_of(config)]
    out = {}
    for k, v in state.items():
        if k.startswith("fc."):
            out["classifier.1." + k[3:]] = v
            continue
        module, _, leaf = k.rpartition(".")
        stem = {b: a for a, b in _STEM.items()}
        if module in stem:
            out[f"{prefix}{stem[module]}.{leaf}"] = v
            continue
        m = _TV_BLOCK.match(k)
        if m is None:
            raise CheckpointError(f"{k}: no place in transformers' ResNet")
        stage, block, _, ds, conv, bn, leaf = m.groups()
        if ds is not None:
            name = f"shortcut.{'convolution' if ds == '0' else 'normalization'}"
        else:
            name = f"layer.{int(conv or bn) - 1}.{'convolution' if conv else 'normalization'}"
        out[f"{prefix}encoder.stages.{int(stage) - 1}.layers.{block}.{name}.{leaf}"] = v
    return out


def config_from_json(cfg: dict) -> dict:
    """fastzoo ResNet fields from a transformers ResNet config; what torchvision's network cannot be is refused."""
    c = _hf_object(cfg)
    arch = (cfg.get("architectures") or ["ResNetForImageClassification"])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"config.json: architectures={cfg.get('architectures')!r}; fastzoo's ResNet reads "
                              f"{', '.join(ARCHITECTURES)}")
    block = {"basic": "basic", "bottleneck": "bottleneck"}.get(c.layer_type)
    channels = tuple(h // EXPANSION[block] for h in c.hidden_sizes) if block else ()  # transformers' reduction
    bad = [f"{name}={value!r} (fastzoo: {want!r})" for name, value, want in (
        ("layer_type", c.layer_type, block or "basic or bottleneck"), ("hidden_act", c.hidden_act, "relu"),
        ("downsample_in_first_stage", c.downsample_in_first_stage, False),
        ("downsample_in_bottleneck", getattr(c, "downsample_in_bottleneck", False), False)) if value != want]
    if bad:
        raise CheckpointError(f"config.json: a ResNet fastzoo's (torchvision's) network is not: {'; '.join(bad)}")
    hf = c.to_dict()
    hf["architectures"] = [arch]
    outs = tuple(c.hidden_sizes)
    return dict(block=block, layers=tuple(c.depths), channels=channels, groups=1, width_per_group=64,
                stem_width=None if c.embedding_size == channels[0] else c.embedding_size,
                out_channels=None if outs == tuple(ch * EXPANSION[block] for ch in channels) else outs,
                in_chans=c.num_channels, num_classes=c.num_labels if arch == "ResNetForImageClassification" else 0,
                global_pool="avg", hf_config=hf)


def build(config):
    """transformers' ResNet of a fastzoo ResNet config, at random init (the equivalence reference)."""
    import transformers

    cfg = hf_config_dict(config)
    return getattr(transformers, cfg["architectures"][0])(_hf_object(cfg))


def infer_config(state: dict) -> dict:
    """What the keys of a transformers ResNet state dict fix (through torchvision's names)."""
    from fastzoo.models.resnet.convert import RESNET

    tv = to_fastzoo(state)
    out = RESNET.infer_config(tv)
    stages = range(1, len(out["layers"]) + 1)
    last = "conv3" if out["block"] == "bottleneck" else "conv2"
    outs = tuple(tv[f"layer{s}.0.{last}.weight"].shape[0] for s in stages)
    channels = tuple(tv[f"layer{s}.0.conv1.weight"].shape[0] for s in stages) if out["block"] == "bottleneck" else outs
    expansion = EXPANSION[out["block"]]
    stem = tv["conv1.weight"].shape[0]
    out.update(channels=channels, groups=1, width_per_group=64, stem_width=None if stem == channels[0] else stem,
               out_channels=None if outs == tuple(c * expansion for c in channels) else outs)
    arch = "ResNetForImageClassification" if "classifier.1.weight" in state else "ResNetModel"
    return {**out, "hf_config": {"architectures": [arch], "model_type": "resnet"}}


class HfResNetConverter:
    """The converter the ResNet spec lists for transformers' checkpoints (see :mod:`fastzoo.weights`)."""

    format = "hf"
    matches = staticmethod(matches)
    to_fastzoo = staticmethod(to_fastzoo)
    from_fastzoo = staticmethod(from_fastzoo)
    config_from_json = staticmethod(config_from_json)

    @staticmethod
    def infer_config(state: dict, module=None) -> dict:
        return infer_config(state)


HF_RESNET = HfResNetConverter()
