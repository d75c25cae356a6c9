"""transformers' config.json of ``ResNetForImageClassification`` / ``ResNetModel`` for a fastzoo
ResNet config (:func:`hf_config_dict`), and what it cannot say.

transformers' ResNet is torchvision's network without grouped or widened bottlenecks or dilated
stages, with a bottleneck a quarter of its output wide, average pooling and a classifier only in
``ResNetForImageClassification``: a config that is another network has no transformers form
(:func:`misfits`, each naming its fields). The same rule refuses an ``hf_config`` its config
cannot have when the config is made (:func:`check`), not when it is written.
"""
from __future__ import annotations

from fastzoo.errors import CheckpointError, ConfigError

# architecture -> key prefix of its base model in the state dict
ARCHITECTURES = {"ResNetForImageClassification": "resnet.", "ResNetModel": ""}
REDUCTION = 4  # transformers' bottleneck: its 1x1 and 3x3 are a quarter of its output wide


def architecture_of(config) -> str:
    """The transformers class a fastzoo ResNet config is written as: its ``hf_config``'s, else by its head."""
    arch = ((config.hf_config or {}).get("architectures") or [None])[0]
    if arch in ARCHITECTURES:
        return arch
    return "ResNetForImageClassification" if config.num_classes else "ResNetModel"


def misfits(config) -> list[tuple[tuple[str, ...], str]]:
    """``(fields, why)`` for each way the config is not the network of its transformers class."""
    bad = []
    if config.groups != 1 or config.width_per_group != 64:
        bad.append((("groups", "width_per_group"), f"groups={config.groups}, width_per_group={config.width_per_group} "
                    f"(transformers' ResNet has neither grouped nor widened bottlenecks: 1 and 64)"))
    if config.output_stride != 32:
        bad.append((("output_stride",), f"output_stride={config.output_stride} (transformers' ResNet has no dilated "
                    f"stages: 32; timm's and torchvision's have)"))
    if config.global_pool != "avg":
        bad.append((("global_pool",), f"global_pool={config.global_pool!r} (transformers' ResNet pools with 'avg')"))
    outs = [config.stage_out(i) for i in range(len(config.channels))]
    if config.block == "bottleneck" and any(c != o // REDUCTION for c, o in zip(config.channels, outs)):
        bad.append((("channels", "out_channels"), f"channels={config.channels} with out_channels={tuple(outs)} "
                    f"(transformers' bottleneck is a quarter of its output wide: channels = out_channels // 4)"))
    arch = architecture_of(config)
    if arch == "ResNetModel" and config.num_classes:
        bad.append((("num_classes",), f"num_classes={config.num_classes} (transformers' ResNetModel has no classifier; "
                    f"ResNetForImageClassification has)"))
    return bad


def _hf_object(cfg: dict):
    from transformers import ResNetConfig

    if cfg.get("model_type", "resnet") != "resnet":
        raise CheckpointError(f"config.json has model_type={cfg.get('model_type')!r}; fastzoo's ResNet reads 'resnet'")
    obj = ResNetConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "problem_type")})
    obj.problem_type = cfg.get("problem_type")  # as a live config holds it (its constructor checks it against the labels)
    return obj


def check_writable(config) -> None:
    """CheckpointError naming every misfit (:func:`misfits`): the config has no transformers form."""
    bad = misfits(config)
    if bad:
        raise CheckpointError(f"this ResNet has no transformers form: {'; '.join(why for _, why in bad)}",
                              fields=tuple(dict.fromkeys(f for fields, _ in bad for f in fields)))


def hf_config_dict(config) -> dict:
    """The transformers config.json of a fastzoo ResNet config (labels kept from its ``hf_config``)."""
    check_writable(config)
    arch = architecture_of(config)
    base = {k: v for k, v in (config.hf_config or {}).items() if k != "num_labels"}  # the labels come from num_classes
    fields = dict(embedding_size=config.stem, hidden_sizes=[config.stage_out(i) for i in range(len(config.channels))],
                  depths=list(config.layers), layer_type=config.block, hidden_act="relu", num_channels=config.in_chans,
                  downsample_in_first_stage=False, downsample_in_bottleneck=False)
    if arch == "ResNetForImageClassification":
        labels = base.get("id2label") or {}
        if len(labels) != config.num_classes:
            labels = {str(i): f"LABEL_{i}" for i in range(config.num_classes)}
        fields.update(id2label=labels, label2id={v: int(k) for k, v in labels.items()})
    return _hf_object({**base, **fields, "model_type": "resnet"}).to_dict() | {"architectures": [arch]}


def check(config) -> None:
    """ConfigError naming ``hf_config`` and the fields its transformers class cannot have (the rule of
    :func:`hf_config_dict`), for a config with an ``hf_config``."""
    bad = misfits(config)
    if bad:
        raise ConfigError(f"hf_config: this ResNet is not transformers' {architecture_of(config)}: "
                          f"{'; '.join(why for _, why in bad)}. Change those fields, or drop hf_config (hf_config=None: "
                          f"a fastzoo ResNet that is no transformers class)",
                          fields=("hf_config", *dict.fromkeys(f for fields, _ in bad for f in fields)))
