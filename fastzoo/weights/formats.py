"""Which foreign format a source's keys are in, through the converters of the model's family
(its spec's ``converters``: this package knows no family), what architecture the source
states, and :func:`load_pretrained`, which puts reading, format and strict loading together.
"""
from __future__ import annotations

from fastzoo.errors import CheckpointError
from fastzoo.weights.sources import Source, read_source
from fastzoo.weights.strict import check_config, load_into, model_state

def find_converter(spec, source: Source):
    """The converter of ``spec`` (a family's :class:`~fastzoo.models.spec.ModelSpec`) whose format
    these keys are in, or a CheckpointError saying what was seen."""
    for conv in spec.converters:
        if conv.matches(source.state_dict):
            return conv
    sample = ", ".join(list(source.state_dict)[:6])
    names = ", ".join(c.format for c in spec.converters) or "none"
    raise CheckpointError(
        f"{source.origin}: not a {spec.family} checkpoint in any format fastzoo reads ({names}); its first keys are: {sample}"
    )


def _is_fastzoo(config: dict | None) -> bool:
    """A config written by save_pretrained (or read from a live fastzoo model)."""
    return bool(config) and "fastzoo_model" in config


# keys timm's hub format adds to a save_pretrained config.json (timm reads the directory too)
TIMM_HUB_KEYS = ("architecture", "pretrained_cfg", "model_args", "num_features", "label_names", "label_descriptions")


def pretrained_cfg_of(src: Source) -> dict | None:
    """The timm ``pretrained_cfg`` a source carries (a live timm or fastzoo model's, a
    save_pretrained directory's config.json), or None: preprocessing goes with the weights."""
    cfg = getattr(src.module, "pretrained_cfg", None) if src.module is not None else None
    if not cfg and src.config:
        cfg = src.config.get("pretrained_cfg")
    # JSON has no tuples; timm's configs hold sizes and mean/std as tuples
    return {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()} if cfg else None


def config_from_source(spec, src: Source) -> dict:
    """The config fields the source decides: all of them from a config.json or a live module
    that states its architecture, what the keys fix from a bare state dict."""
    if _is_fastzoo(src.config):
        if src.config.get("family", spec.family) != spec.family:
            raise CheckpointError(f"{src.config_origin or src.origin}: a {src.config['family']} checkpoint, not a {spec.family} one")
        return {k: v for k, v in src.config.items() if k not in ("fastzoo_model", "family") + TIMM_HUB_KEYS}
    conv = find_converter(spec, src)
    if src.config and hasattr(conv, "config_from_json"):
        return conv.config_from_json(src.config)
    try:
        return conv.infer_config(src.state_dict, src.module)
    except (KeyError, IndexError) as e:
        raise CheckpointError(f"{src.origin}: missing key {e}: the architecture cannot be read from the weights "
                              f"without it") from e


# the mode each library's loader returns a model in: transformers' ``from_pretrained`` gives eval,
# timm's ``create_model`` and torchvision's ``get_model`` give train (``nn.Module``'s default)
EVAL_AFTER_LOADING = {"hf": True, "timm": False, "torchvision": False}


def loads_in_eval(spec, src: Source) -> bool:
    """Whether a model built from ``src`` comes back in eval mode: as the loader of the library whose
    checkpoint it is would return it (fastzoo's own keys: as the family's original library, the
    format of its first converter)."""
    fmt = "fastzoo" if _is_fastzoo(src.config) else find_converter(spec, src).format
    if fmt == "fastzoo":
        fmt = spec.converters[0].format
    return EVAL_AFTER_LOADING[fmt]


def states_config(src: Source) -> bool:
    """Whether the source states its whole architecture (config.json, a live module)
    rather than leaving fields the keys cannot decide to the model's YAML."""
    return bool(src.config) or src.module is not None


def to_fastzoo(spec, source: Source) -> dict:
    if _is_fastzoo(source.config):
        return dict(source.state_dict)  # written by save_pretrained: already fastzoo keys
    conv = find_converter(spec, source)
    if source.module is not None and hasattr(conv, "check_module"):
        conv.check_module(source.module)  # what the keys cannot show (e.g. a ResNet's dilation)
    return conv.to_fastzoo(source.state_dict)


def export_state_dict(model, spec, format: str) -> dict:
    """The model's weights in ``format`` (e.g. "timm", "hf", "torchvision"), ready for that library."""
    return spec.converter(format).from_fastzoo(model_state(model), model.config)


def load_pretrained(model, source, spec) -> None:
    """Load ``source`` (any form ``pretrained=`` takes) into ``model``, strictly.

    A source that states its architecture (config.json, a live module) must agree with
    ``model.config`` on every field that changes the function (every field the config does
    not declare ``free``: see :mod:`fastzoo.models.config`), else :class:`CheckpointError`
    names each differing field. A bare state dict is checked by its keys and shapes only. To
    build a model that fits a checkpoint, use ``fastzoo.create(name, pretrained=source)``.
    """
    src = read_source(source)
    if states_config(src):
        check_config(model, config_from_source(spec, src), src.origin)
    load_into(model, to_fastzoo(spec, src), src.origin)


