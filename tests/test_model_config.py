"""Configs describe themselves and are checked once, where they are made.

Every field of every model's config declares its kind (the weights decide it / it changes the
function / it is free), its meaning and its constraint. A bad value (a negative or zero size,
heads that do not divide the width, a string for an int) is a ConfigError naming the field,
whether it comes from an override, a config.json or ``fastzoo.create``; and a checkpoint that
differs from the model only in a free field loads."""
import dataclasses
import json

import pytest
import torch
from conftest import tiny_of

import fastzoo
from fastzoo.cli import main
from fastzoo.errors import CheckpointError, ConfigError, UnknownFieldError
from fastzoo.models.config import FREE, FUNCTION, KINDS, WEIGHTS
from fastzoo.models.decoder import GPT2Config
from fastzoo.models.detr import DetrConfig
from fastzoo.models.resnet import ResNetConfig
from fastzoo.models.vit import ViTConfig

TINY = {name: tiny_of(name) for name in ("vit_s16", "gpt2", "resnet50", "detr")}
CONFIGS = {"vit_s16": ViTConfig, "gpt2": GPT2Config, "resnet50": ResNetConfig, "detr": DetrConfig}

# model -> (field, bad value, what the message says)
BAD = [
    ("gpt2", "n_layer", -1, ">= 1"), ("gpt2", "n_head", 0, ">= 1"), ("gpt2", "vocab_size", 0, ">= 1"),
    ("gpt2", "n_embd", "32", "must be int"), ("gpt2", "attn_pdrop", 1.5, "<= 1"),
    ("gpt2", "activation_function", "swish", "choose one of"),
    ("vit_s16", "depth", 0, ">= 1"), ("vit_s16", "embed_dim", -32, ">= 1"), ("vit_s16", "num_heads", "2", "must be int"),
    ("vit_s16", "global_pool", "max", "choose one of"), ("vit_s16", "qkv_bias", "yes", "must be bool"),
    ("resnet50", "layers", [1, 0, 1, 1], ">= 1"), ("resnet50", "num_classes", -1, ">= 0"),
    ("resnet50", "channels", "64", "must be tuple"), ("resnet50", "channels_last", 1, "must be bool"),
    ("detr", "num_queries", 0, ">= 1"), ("detr", "d_model", 2.5, "must be int"),
    ("detr", "giou_impl", "fast", "choose one of"), ("detr", "eos_coefficient", 0.0, "> 0"),
]


@pytest.mark.parametrize("model, field, value, says", BAD)
def test_a_bad_override_names_its_field(model, field, value, says):
    with pytest.raises(ConfigError, match=rf"{field}=.*{says}") as e:
        fastzoo.create(model, **{**TINY[model], field: value})
    assert e.value.fields == (field,)


@pytest.mark.parametrize("model, field, value, says", BAD)
def test_the_same_check_runs_when_the_config_is_made_from_a_dict(model, field, value, says):
    with pytest.raises(ConfigError, match=rf"{field}=.*{says}"):
        CONFIGS[model].from_dict({**TINY[model], field: value})


@pytest.mark.parametrize("model, a, b, values", [
    ("gpt2", "n_embd", "n_head", {"n_embd": 32, "n_head": 3}),
    ("vit_s16", "embed_dim", "num_heads", {"embed_dim": 32, "num_heads": 3}),
    ("vit_s16", "img_size", "patch_size", {"img_size": 30}),
    ("resnet50", "layers", "channels", {"layers": [1, 1]}),
    ("detr", "depths", "hidden_sizes", {"depths": [1, 1]}),
])
def test_fields_that_must_agree_are_named_together(model, a, b, values):
    with pytest.raises(ConfigError) as e:
        fastzoo.create(model, **{**TINY[model], **values})
    assert set(e.value.fields) == {a, b} and a in str(e.value) and b in str(e.value)


def test_an_unknown_field_is_a_type_error_carrying_its_name():
    with pytest.raises(UnknownFieldError, match="Did you mean 'n_head'") as e:
        fastzoo.create("gpt2", n_heads=2)
    assert isinstance(e.value, TypeError) and e.value.fields == ("n_heads",)


def test_lists_from_json_become_tuples_and_ints_become_floats():
    cfg = ResNetConfig.from_dict({"layers": [1, 1], "channels": [4, 8]})
    assert cfg.layers == (1, 1) and cfg.channels == (4, 8)
    assert GPT2Config(layer_norm_epsilon=1).layer_norm_epsilon == 1.0


# -- from a config.json --------------------------------------------------------------------------
@pytest.mark.parametrize("model, field, value", [
    ("gpt2", "n_head", 0), ("gpt2", "n_layer", "2"), ("vit_s16", "num_heads", 0), ("vit_s16", "depth", "one"),
    ("resnet50", "layers", [1, -1, 1, 1]), ("detr", "num_queries", 0),
])
def test_a_bad_value_in_a_config_json_names_the_field_and_loads_nothing(tmp_path, model, field, value):
    fastzoo.create(model, **TINY[model]).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ConfigError, CheckpointError), match=rf"{field}={value!r}"):
        fastzoo.create(model, pretrained=tmp_path)
    target = fastzoo.create(model, **TINY[model])
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{field}={value!r}"):
        fastzoo.load_pretrained(target, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # all or nothing


# -- what the declarations are for ---------------------------------------------------------------
@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_every_field_declares_its_kind_and_meaning(model):
    cls = fastzoo.registry.get_entry(model).model_class.config_class
    for f in dataclasses.fields(cls):
        assert f.metadata.get("kind") in KINDS, f"{cls.__name__}.{f.name} declares no kind"
        assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} says nothing about what it means"


@pytest.mark.parametrize("model, field, value", [
    ("resnet50", "channels_last", True), ("detr", "channels_last", True), ("detr", "giou_impl", "per_sample"),
    ("detr", "eos_coefficient", 0.5), ("detr", "freeze_backbone", "all"), ("vit_s16", "drop_path_rate", 0.1),
    ("gpt2", "attn_pdrop", 0.0),
])
def test_a_checkpoint_that_differs_only_in_a_free_field_loads(tmp_path, model, field, value):
    assert CONFIGS[model].field_kind(field) == FREE
    src = fastzoo.create(model, **TINY[model])
    src.save_pretrained(tmp_path)
    target = fastzoo.create(model, **{**TINY[model], field: value})
    fastzoo.load_pretrained(target, tmp_path)
    assert getattr(target.config, field) == value  # the model keeps its own runtime choice
    for k, v in src.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k


@pytest.mark.parametrize("model, field, value", [
    ("gpt2", "layer_norm_epsilon", 1e-3), ("gpt2", "activation_function", "relu"), ("vit_s16", "norm_eps", 1e-3), ("vit_s16", "act_layer", "quick_gelu"),
])
def test_a_checkpoint_that_differs_in_a_function_field_is_refused_by_name(tmp_path, model, field, value):
    assert CONFIGS[model].field_kind(field) == FUNCTION
    fastzoo.create(model, **TINY[model]).save_pretrained(tmp_path)
    target = fastzoo.create(model, **{**TINY[model], field: value})
    with pytest.raises(CheckpointError, match=rf"Differing fields \(1\): {field}:"):
        fastzoo.load_pretrained(target, tmp_path)


def test_a_field_is_compared_through_the_part_that_changes_the_function():
    # LayerScale's init value is overwritten by the weights: only "LayerScale or not" is compared
    a, b = ViTConfig(init_values=1e-5), ViTConfig(init_values=0.1)
    assert ViTConfig.field_kind("init_values") == WEIGHTS and a.compared("init_values") == b.compared("init_values")
    assert GPT2Config(n_embd=32, n_head=2).compared("n_inner") == GPT2Config(n_embd=32, n_head=2, n_inner=128).compared("n_inner")


def test_cli_list_model_prints_the_fields_with_their_kinds(capsys):
    assert main(["list", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "| n_head | function | int | 12 | >= 1 |" in out
    assert "| attn_pdrop | free | float | 0.1 | >= 0 and <= 1 |" in out
    assert "| vocab_size | weights | int | 50257 | >= 1 |" in out
