"""Reading checkpoints and translating foreign state dicts, both directions.

A *source* is a file (``.safetensors``, ``.bin``, ``.pt``, ``.pth``), a directory written
by ``save_pretrained`` (fastzoo's or Hugging Face's: ``config.json`` + weights, sharded or
not), a state dict, or a live timm / transformers / torchvision module. The format is
detected from the keys by the converters of the model's family (its spec's
``converters``: this package knows no family). Loading is all or
nothing: any missing, unexpected or mis-shaped key raises :class:`CheckpointError`
naming the keys, and nothing is copied into the model. A source that states its
architecture (a ``config.json``, a live module) must also agree with the model's config
on every field that changes the function, or :func:`load_pretrained` refuses it.
"""
from fastzoo.weights.formats import (
    TIMM_HUB_KEYS, config_from_source, export_state_dict, find_converter, load_pretrained, loads_in_eval,
    pretrained_cfg_of, states_config, to_fastzoo,
)
from fastzoo.weights.sources import (
    INDEX_FILES, WEIGHT_FILES, Source, read_config_json, read_file, read_source, stale_shard_files,
)
from fastzoo.weights.strict import check_config, check_state_dict, load_into, model_state, untied

__all__ = [
    "INDEX_FILES", "TIMM_HUB_KEYS", "WEIGHT_FILES", "Source", "check_config", "check_state_dict", "config_from_source",
    "export_state_dict", "find_converter", "load_into", "load_pretrained", "loads_in_eval", "model_state", "pretrained_cfg_of",
    "read_config_json", "read_file", "read_source", "stale_shard_files", "states_config", "to_fastzoo", "untied",
]
