"""Run files in configs/: the scripts' ``--config`` (precedence, refusals) and every README
fine-tune recipe run at tiny size from its YAML, flags overriding only what a tiny run needs."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY

from fastzoo.train.cli import UsageError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _script(name):
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), ROOT / "scripts" / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse(script, argv):
    from fastzoo.train import parse_args

    return parse_args(_script(script).build_parser(), list(map(str, argv)))


def run(script, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# -- precedence ----------------------------------------------------------------------------
def test_config_fields_become_the_options(tmp_path):
    cfg = write(tmp_path, "model: vit_b16\nattn: eager\nlr: 3.0e-4\nbatch_size: 16\nsynthetic: 8\n"
                          "model_kwargs: {depth: 2, img_size: 32}\namp: bf16\n")
    args = parse("finetune_image_classification.py", ["--config", cfg])
    assert (args.model, args.attn, args.lr, args.batch_size, args.synthetic, args.amp) == ("vit_b16", "eager", 3e-4, 16, 8, "bf16")
    assert args.model_kwargs == {"depth": 2, "img_size": 32}


def test_command_line_flags_override_config_fields(tmp_path):
    cfg = write(tmp_path, "attn: eager\nlr: 3.0e-4\nbatch_size: 16\nsynthetic: 8\nmodel_kwargs: {depth: 2, img_size: 32}\n")
    args = parse("finetune_image_classification.py", ["--config", cfg, "--lr", "1e-2", "-b", "4", "--model-kwargs", "depth=1"])
    assert (args.lr, args.batch_size, args.attn) == (1e-2, 4, "eager")  # given flags win, the rest is the file's
    assert args.model_kwargs == {"depth": 1, "img_size": 32}  # key by key: the flag's key wins, the file's others stay


def test_a_command_line_data_source_replaces_the_configs_exclusive_one(tmp_path):
    cfg = write(tmp_path, "data_dir: DATA\n")
    args = parse("finetune_image_classification.py", ["--config", cfg, "--synthetic", "8"])
    assert args.synthetic == 8 and args.data_dir is None  # --data-dir and --synthetic are mutually exclusive


def test_config_paths_and_lists_take_the_options_types(tmp_path):
    cfg = write(tmp_path, "train_files: [a.txt, b.txt]\ntokenizer: tok/\nmax_tokens: 128\n")
    args = parse("finetune_causal_lm.py", ["--config", cfg])
    assert args.train_files == [Path("a.txt"), Path("b.txt")] and args.tokenizer == Path("tok") and args.max_tokens == 128


# -- refusals: by name, one line, exit 2 -------------------------------------------------------
@pytest.mark.parametrize("text, needles", [
    ("bach_size: 8\n", ["unknown field 'bach_size'", "did you mean 'batch_size'"]),
    ("batch-size: 8\nlearning_rate: 0.1\n", ["unknown field 'learning_rate'"]),
    ("amp: fp8\n", ["amp", "'fp8' is not one of none, bf16"]),
    ("batch_size: '-3'\n", ["batch_size", "positive integer"]),
    ("model_kwargs: depth=2\n", ["model_kwargs", "expected a mapping"]),
    ("compile: yes please\n", ["compile", "expected true or false"]),
    ("- lr\n- 0.1\n", ["expected a mapping of option: value"]),
])
def test_bad_config_fields_are_refused_by_name(tmp_path, text, needles):
    cfg = write(tmp_path, text)
    with pytest.raises(UsageError) as e:
        parse("finetune_image_classification.py", ["--config", cfg, "--synthetic", "8"])
    for n in needles:
        assert n in str(e.value)


def test_a_bad_config_is_one_line_and_exit_2_from_the_command_line(tmp_path):
    cfg = write(tmp_path, "synthetic: 8\nlr: 1e-3\nwarmup_step: 10\n")
    proc = run("finetune_image_classification.py", "--config", cfg)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"finetune_image_classification.py: error: --config {cfg}: unknown field 'warmup_step'")
    assert "did you mean 'warmup_steps'" in lines[0]


def test_every_shipped_config_names_only_real_options():
    scripts = {"finetune_image_classification": "finetune_image_classification.py", "finetune_causal_lm": "finetune_causal_lm.py",
               "finetune_detection": "finetune_detection.py"}
    shipped = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("accuracy_"))
    assert {p.stem for p in shipped} >= set(scripts)
    for p in shipped:
        script = next(v for k, v in scripts.items() if p.stem.startswith(k))
        parse(script, ["--config", p])  # raises UsageError on any unknown or mistyped field


# -- every README recipe, at tiny size, from its config ---------------------------------------
TINY_RUN = ["--steps", "2", "--workers", "0", "--log-interval", "1"]


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def logged_losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def _png(path, size, seed):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_recipe_finetune_image_classification(tmp_path):
    import fastzoo

    pre = tmp_path / "vit"
    fastzoo.create("vit_b16", **TINY["vit"]).save_pretrained(pre)
    for cls in ("a", "b"):
        for i in range(4):
            _png(tmp_path / "DATA" / "train" / cls / f"{i}.png", 20, hash((cls, i)) % 1000)
    out = tmp_path / "out"
    # CPU: flex has no backward here, so the recipe's attn is the one override beyond size and data.
    ok(run("finetune_image_classification.py", "--config", CONFIGS / "finetune_image_classification.yaml", "--pretrained", pre, "--data-dir", tmp_path / "DATA",
           "--num-classes", "2", "--attn", "sdpa", "-b", "4", "--output-dir", out, *TINY_RUN))
    losses = logged_losses(out)
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    cfg = json.loads((out / "checkpoint-2" / "config.json").read_text())
    # the pretrained file's architecture, the folder's classes
    assert cfg["num_classes"] == 2 and cfg["embed_dim"] == TINY["vit"]["embed_dim"]


def test_recipe_finetune_causal_lm(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from fastzoo.accuracy.data import bpe_tokenizer

    text = tmp_path / "train.txt"
    text.write_text("\n\n".join(f"paragraph {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(40)))
    tok_dir = tmp_path / "gpt2_dir"
    tok = bpe_tokenizer([text.read_text()], vocab_size=300)
    tok.save_pretrained(tok_dir)
    GPT2LMHeadModel(GPT2Config(**{**TINY["gpt2"], "vocab_size": len(tok)})).save_pretrained(tok_dir)
    out = tmp_path / "out"
    ok(run("finetune_causal_lm.py", "--config", CONFIGS / "finetune_causal_lm.yaml", "--pretrained", tok_dir, "--tokenizer", tok_dir,
           "--train-files", text, "--max-tokens", TINY["gpt2"]["n_positions"], "-b", "2", "--output-dir", out, *TINY_RUN))
    losses = logged_losses(out)
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)


# configs/finetune_detection.yaml (README's detection recipe) runs in tests/test_finetune_detection.py, on a COCO-format set
