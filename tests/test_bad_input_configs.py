"""Bad input, config layer: every way a model config or a run file can be wrong gets a named
error naming the field, and nothing on disk changes.

Three doors a config comes in by:

1. ``fastzoo.create(name, **overrides)``: :class:`ConfigError` (or :class:`UnknownFieldError`
   for a name the config lacks), with ``.fields`` naming the field(s), from the one place
   configs are checked (``fastzoo/models/config.py``) -- also for huge sizes, which are
   refused before anything is allocated (``registry.check_fits``), not an allocator error or
   the kernel killing the process;
2. a ``save_pretrained`` directory's ``config.json`` (malformed, truncated, edited): a
   :class:`CheckpointError` or :class:`ConfigError` naming the file or field; the directory's
   files stay byte for byte;
3. a YAML run file (``--config``, ``configs/*.yaml``) with mistyped fields: the script's one
   line ``error: --config FILE: FIELD: ...`` and exit status 2, and no output directory.

The cases: 170 bad inputs (110 overrides, 2 configs made directly, 1 size past this machine,
31 config.json edits, 25 run-file fields, 1 command line), each a named error. Among them the
values a plain type check lets through: overrides ViT ``init_values`` = nan / inf,
``mlp_ratio=1e-9`` (an MLP of width 0) or ``inf``, GPT-2 ``layer_norm_epsilon`` = inf, DETR
``d_model=31`` (not divisible by the heads), ``giou_cost`` = inf, ``class_cost`` = nan; the same in configs
made directly and in config.json; run-file values of the wrong type or range on untyped fields
(``batch_size: 0 / -1 / true / 2.5``, ``epochs: null / [1, 2]``, ``lr: .nan / .inf / -1e-3``,
``weight_decay: .nan``, a 2-value ``mean``, ``warmup_steps: -3``, ``model_kwargs: {init_values:
.nan}``), ``--lr nan``, and sizes too large to allocate (``depth=10**9``). Accepted on purpose: a GPT-2 ``eos_token_id`` past ``vocab_size`` (transformers
accepts it, and tiny test vocabularies keep GPT-2's ids), an unknown ``fastzoo_model`` name in
config.json (informational).
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import tiny_of

import fastzoo
from fastzoo.errors import CheckpointError, ConfigError, UnknownFieldError

TINY = {name: tiny_of(name) for name in ("vit_s16", "gpt2", "resnet50", "detr")}
NAN, INF = float("nan"), float("inf")
HUGE = 10**12

# (model, override, the field the error must name)
OVERRIDES = [
    # ViT: zero / negative sizes, types, bool for int, NaN / inf, huge, choices, tuples, ties between fields
    *[("vit_s16", {k: v}, k) for k, v in [
        ("depth", 0), ("depth", -1), ("embed_dim", 0), ("num_heads", 0), ("depth", "2"), ("depth", 2.0), ("depth", True),
        ("mlp_ratio", NAN), ("mlp_ratio", INF), ("init_values", NAN), ("init_values", INF), ("norm_eps", NAN),
        ("norm_eps", 0.0), ("norm_eps", -1e-6), ("drop_rate", NAN), ("drop_rate", 1.5), ("drop_path_rate", -0.1),
        ("img_size", 0), ("img_size", (32,)), ("img_size", (32, 32, 32)), ("img_size", [32, "a"]), ("img_size", (32, 0)),
        ("patch_size", 0), ("patch_size", 5), ("global_pool", "max"), ("global_pool", None), ("act_layer", "relu6"),
        ("qkv_bias", 1), ("class_token", None), ("reg_tokens", -1), ("reg_tokens", True), ("num_classes", -1),
        ("fc_norm", "yes"), ("init_values", "1e-5"), ("in_chans", 0), ("patch_embed", "Conv"), ("mlp_ratio", 1e-9),
        ("img_size", 10**9), ("depth", 10**9), ("embed_dim", 3 * 10**9), ("mlp_ratio", 1e12), ("num_classes", 2**63),
        ("num_heads", 5), ("embed_dim", HUGE)]],
    ("vit_s16", {"deph": 2}, "deph"),
    ("vit_s16", {"global_pool": "token", "class_token": False}, "class_token"),
    # GPT-2
    *[("gpt2", {k: v}, k) for k, v in [
        ("n_layer", -1), ("n_layer", 0), ("n_head", 0), ("n_head", 3), ("n_embd", 0), ("vocab_size", 0), ("n_positions", 0),
        ("n_embd", "32"), ("n_head", 2.5), ("n_layer", True), ("layer_norm_epsilon", NAN), ("layer_norm_epsilon", INF),
        ("initializer_range", NAN), ("initializer_range", -1.0), ("resid_pdrop", NAN), ("attn_pdrop", 2.0),
        ("embd_pdrop", -0.5), ("vocab_size", HUGE), ("n_positions", HUGE), ("n_embd", 10**10), ("n_inner", 0),
        ("n_inner", -5), ("activation_function", "relu6"), ("scale_attn_weights", "yes"), ("bos_token_id", -1),
        ("n_layer", 10**6)]],
    ("gpt2", {"n_layers": 2}, "n_layers"),
    # ResNet
    *[("resnet50", {k: v}, k) for k, v in [
        ("layers", (0, 1, 1, 1)), ("layers", ()), ("layers", (1, 1, 1)), ("channels", (8, 8, 8, 0)), ("layers", (1, 1, 1, -1)),
        ("layers", "1111"), ("layers", (1.0, 1, 1, 1)), ("layers", (True, 1, 1, 1)), ("num_classes", -1), ("in_chans", 0),
        ("global_pool", "max"), ("global_pool", ""), ("layers", (10**9, 1, 1, 1)), ("channels", (10**9, 8, 8, 8)),
        ("layers", [1, 1, 1, 1, 1]), ("frozen_bn", "no"), ("channels_last", 1), ("num_classes", 1.5)]],
    ("resnet50", {"laayers": (1, 1, 1, 1)}, "laayers"),
    # DETR
    *[("detr", {k: v}, k) for k, v in [
        ("num_queries", 0), ("num_labels", 0), ("d_model", 0), ("d_model", 31), ("eos_coefficient", 0.0),
        ("eos_coefficient", NAN), ("giou_loss_coefficient", NAN), ("bbox_loss_coefficient", -1.0), ("giou_cost", INF),
        ("giou_impl", "fast"), ("freeze_backbone", "some"), ("use_timm_backbone", "timm"), ("depths", (1, 1, 1)),
        ("num_queries", HUGE), ("num_queries", True), ("class_cost", NAN), ("id2label", {0: "a"}), ("dropout", 1.5)]],
]


@pytest.mark.parametrize("name, override, field", OVERRIDES, ids=[f"{n}-{f}={o[f]!r}"[:60] for n, o, f in OVERRIDES])
def test_a_bad_override_is_a_named_error_naming_the_field(name, override, field):
    with pytest.raises((ConfigError, UnknownFieldError)) as e:
        fastzoo.create(name, **{**TINY[name], **override})
    assert field in e.value.fields and field in str(e.value), (e.value.fields, str(e.value))


def test_a_size_too_big_for_this_machine_names_its_sizes_before_allocating():
    """Huge but representable: the weights alone exceed this machine's memory (counted on the
    meta device), so nothing is allocated and the error names every size field."""
    with pytest.raises(ConfigError, match=r"its weights alone need .* GiB on cpu, more than the .* GiB") as e:
        fastzoo.create("gpt2", **{**TINY["gpt2"], "vocab_size": HUGE})
    assert {"vocab_size", "n_embd", "n_layer"} <= set(e.value.fields)


def test_a_config_made_directly_is_checked_the_same_way():
    from fastzoo.models.vit import ViTConfig

    with pytest.raises(ConfigError, match="init_values=nan: must be a finite number"):
        ViTConfig(init_values=NAN)
    with pytest.raises(ConfigError, match="mlp_ratio"):
        ViTConfig(embed_dim=8, num_heads=2, mlp_ratio=0.1)


# -- config.json in a save_pretrained directory -----------------------------------------------
def _snapshot(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for name in ("vit_s16", "gpt2"):
        d = tmp_path_factory.mktemp(name) / "model"
        fastzoo.create(name, **TINY[name]).save_pretrained(d)
        out[name] = (d, (d / "config.json").read_text())
    return out


def _edit(good: str, **fields) -> str:
    return json.dumps({**json.loads(good), **fields})


# (model, how config.json is written, what the error must say)
CONFIG_JSON = [
    ("vit_s16", lambda g: "{", "not valid JSON"),
    ("vit_s16", lambda g: g[: len(g) // 2], "not valid JSON"),  # truncated
    ("vit_s16", lambda g: "", "not valid JSON"),
    ("vit_s16", lambda g: "[1, 2]", "holds a JSON list"),
    ("vit_s16", lambda g: "\xff\xfe garbage", "not valid JSON"),
    ("vit_s16", lambda g: _edit(g, num_heads=5), "num_heads=5"),  # does not divide the tiny embed_dim
    ("vit_s16", lambda g: _edit(g, num_heads=0), "num_heads=0"),
    ("vit_s16", lambda g: _edit(g, num_heads="3"), "num_heads='3'"),
    ("vit_s16", lambda g: _edit(g, num_heads=True), "num_heads=True"),
    ("vit_s16", lambda g: _edit(g, depth=-1), "depth=-1"),
    ("vit_s16", lambda g: _edit(g, depth=None), "depth=None"),
    ("vit_s16", lambda g: _edit(g, depth=3), "blocks.2"),  # more blocks than the weights hold
    ("vit_s16", lambda g: _edit(g, num_head=4), "num_head"),  # unknown field (a typo)
    ("vit_s16", lambda g: _edit(g, norm_eps=NAN), "norm_eps=nan"),
    ("vit_s16", lambda g: _edit(g, norm_eps=INF), "norm_eps=inf"),
    ("vit_s16", lambda g: _edit(g, init_values=NAN), "init_values=nan"),
    ("vit_s16", lambda g: _edit(g, img_size=[32]), "img_size=[32]"),
    ("vit_s16", lambda g: _edit(g, global_pool="max"), "global_pool='max'"),
    ("vit_s16", lambda g: _edit(g, act_layer=7), "act_layer=7"),
    ("vit_s16", lambda g: _edit(g, num_classes=1e12), "num_classes"),
    ("vit_s16", lambda g: _edit(g, patch_size=0), "patch_size=0"),
    ("vit_s16", lambda g: _edit(g, embed_dim=HUGE), "embed_dim"),
    ("vit_s16", lambda g: _edit(g, family="gpt2"), "gpt2"),
    ("vit_s16", lambda g: _edit(g, drop_rate=-1), "drop_rate=-1"),
    ("vit_s16", lambda g: _edit(g, qkv_bias="yes"), "qkv_bias='yes'"),
    ("gpt2", lambda g: _edit(g, n_head=3), "n_head=3"),
    ("gpt2", lambda g: _edit(g, n_layer="1"), "n_layer='1'"),
    ("gpt2", lambda g: _edit(g, n_positions=0), "n_positions=0"),
    ("gpt2", lambda g: _edit(g, layer_norm_epsilon=INF), "layer_norm_epsilon=inf"),
    ("gpt2", lambda g: _edit(g, vocab_size=True), "vocab_size=True"),
    ("gpt2", lambda g: _edit(g, activation_function="swish9"), "activation_function"),
]


@pytest.mark.parametrize("i", range(len(CONFIG_JSON)))
def test_a_bad_config_json_is_a_named_error_and_the_directory_is_untouched(saved, i):
    name, write, needle = CONFIG_JSON[i]
    d, good = saved[name]
    (d / "config.json").write_text(write(good))
    before = _snapshot(d)
    try:
        with pytest.raises((CheckpointError, ConfigError, UnknownFieldError)) as e:
            fastzoo.create(name, pretrained=d)
        assert needle in str(e.value), str(e.value)
        if needle != "blocks.2":  # the others are about config.json itself: the error names that file
            assert str(d / "config.json") in str(e.value), str(e.value)
        assert _snapshot(d) == before
    finally:
        (d / "config.json").write_text(good)


# -- YAML run files ----------------------------------------------------------------------------
def _run_file_error(capsys, tmp_path, text: str) -> str:
    from tests.test_train_scripts import _main

    run_file = tmp_path / "run.yaml"
    run_file.write_text(text)
    out = tmp_path / "out"
    mod = _main("finetune_image_classification.py")
    # the command line gives no field a case sets: it would win over the run file
    args = ["--config", run_file, "--synthetic", "64", "--steps", "1", "--workers", "0", "--output-dir", out]
    with pytest.raises(SystemExit) as e:
        mod.run_main(mod.main, [str(a) for a in args])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()  # nothing written
    return err


RUN_FILES = [
    ("batch_sise: 8", "unknown field 'batch_sise'"),
    ("batch_size: 0", "batch_size: must be a positive integer"),
    ("batch_size: -1", "batch_size: must be a positive integer"),
    ("batch_size: true", "batch_size"),
    ("batch_size: many", "batch_size: must be an integer"),
    ("batch_size: 2.5", "batch_size: must be an integer"),
    ("epochs: null", "epochs: needs a value"),
    ("epochs: [1, 2]", "epochs"),
    ("lr: .nan", "lr: must be a finite number"),
    ("lr: .inf", "lr: must be a finite number"),
    ("lr: -1.0e-3", "lr: must be a finite number >= 0"),
    ("lr: fast", "lr: must be a number"),
    ("weight_decay: .nan", "weight_decay"),
    ("amp: fp8", "amp: 'fp8' is not one of"),
    ("mean: [0.5, 0.5]", "mean: expected 3 values"),
    ("mean: [0.5, 0.5, x]", "mean"),
    ("compile: 1", "compile: expected true or false"),
    ("model_kwargs: depth=2", "model_kwargs: expected a mapping"),
    ("model_kwargs: {depth: 0}", "depth=0"),
    ("model_kwargs: {num_heads: 5}", "embed_dim=384 is not divisible by num_heads=5"),
    ("model_kwargs: {init_values: .nan}", "init_values=nan"),
    ("model_kwargs: {dept: 2}", "dept"),
    ("- a list\n- not a mapping", "expected a mapping of option: value"),
    ("a: [1, 2", "cannot read it as YAML"),
    ("warmup_steps: -3", "warmup_steps: must be 0 or more"),
]


@pytest.mark.parametrize("text, needle", RUN_FILES, ids=[t.splitlines()[0][:40] for t, _ in RUN_FILES])
def test_a_mistyped_run_file_is_one_line_naming_the_field(capsys, tmp_path, text, needle):
    assert needle in _run_file_error(capsys, tmp_path, text)


def test_lr_nan_on_the_command_line_is_refused_too(capsys, tmp_path):
    from tests.test_train_scripts import user_error

    user_error(capsys, "finetune_image_classification.py", ["--synthetic", "8", "--lr", "nan", "--output-dir", tmp_path / "out"],
               "--lr", "finite")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_the_shipped_run_files_parse_with_every_field_typed(path):
    """The repo's own run files stay valid under the stricter typing (every value through its
    option's type); the accuracy suites' files have their own schema (fastzoo/accuracy/runs.py)."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    if path.name.startswith("accuracy_"):
        return
    from tests.test_train_scripts import _main

    script = {"finetune_image_classification": "finetune_image_classification.py", "finetune_causal_lm": "finetune_causal_lm.py",
              "finetune_detection": "finetune_detection.py"}[path.stem]
    mod = _main(script)
    from fastzoo.train.cli import read_run_config

    parser = mod.build_parser() if hasattr(mod, "build_parser") else None
    if parser is None:
        pytest.skip(f"{script} exposes no build_parser() to read its run file with")
    values = read_run_config(parser, path, [])
    assert all(not (isinstance(v, float) and not math.isfinite(v)) for v in values.values())
