"""The training scripts end to end, as a user runs them: subprocesses on CPU, tiny configs.

For each script: a few steps write checkpoints; ``--resume`` from a middle checkpoint
continues with exactly the losses and weights of the uninterrupted run; a planted
non-finite loss (``--debug-nan-at-step K`` adds +inf to step K's loss) stops the run
before the update with a capture of the pre-update weights, and ``--replay`` reproduces
the loss and every gradient bit for bit; ``torchrun`` with 2 gloo processes matches one
process on the same global batch; user errors are one line and exit status 2.
"""
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, model_kwargs
from safetensors.torch import load_file

import fastzoo

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--lr", "1e-3", "--workers", "0", "--log-interval", "1"]


# The spec's tiny ViT, narrower and on 16px images: at 64 wide / 32px, two processes end two
# steps with 2 weights past 1e-5 of one process's (Adam's first +-lr step on gradients at fp32
# noise), and test_torchrun_two_gloo_processes_match_one allows none for the ViT.
VIT_SIZES = {**TINY["vit"], "img_size": 16, "embed_dim": 32, "num_heads": 2}
# the class count is the script's (--num-classes, the data) and the vocabulary the tokenizer's: neither is passed
VIT = ["--model", "vit_s16",
       "--model-kwargs", *model_kwargs(VIT_SIZES, "img_size", "patch_size", "embed_dim", "depth", "num_heads"),
       "--synthetic", "32", "-b", "8"]
GPT2 = ["--model", "gpt2", "--model-kwargs", *model_kwargs(TINY["gpt2"], "n_layer", "n_embd", "n_head", "n_positions"),
        "--max-tokens", "128", "-b", "2", "--validation-split-percentage", "10"]
# transformers' own ResNet backbone at its test sizes under a 2+2-layer transformer (the spec's tiny DETR)
DETR_SIZES = ["use_timm_backbone=false", "embedding_size=8", "hidden_sizes=[8,16,24,32]", "depths=[1,1,1,1]", "d_model=32",
              "encoder_attention_heads=2", "decoder_attention_heads=2", "encoder_ffn_dim=64", "decoder_ffn_dim=64",
              "encoder_layers=2", "decoder_layers=2", "num_queries=8"]
DETR = ["--model", "detr", "--model-kwargs", *DETR_SIZES, "--synthetic", "8", "--img-size", "32", "-b", "2"]
# Randomness for the resume / NaN-capture runs: dropout (gpt2 and DETR: 0.1 by default).
DROPOUT = {"vit": ["--model-kwargs", "drop_path_rate=0.1", "drop_rate=0.1"], "gpt2": [], "detr": []}
# For 1 vs 2 processes: no dropout.
NO_DROPOUT = {"vit": [], "gpt2": ["--model-kwargs", "resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0"]}
SCRIPTS = {kind: pytest.param(kind, id=kind) for kind in ("vit", "gpt2", "detr")}
FILES = {"vit": "finetune_image_classification.py", "gpt2": "finetune_causal_lm.py", "detr": "finetune_detection.py"}
MODELS = {"vit": "vit_s16", "gpt2": "gpt2", "detr": "detr"}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = "the cat sat on a mat while dogs ran in the park and birds sang".split()
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(60)))
    return path


def base_args(kind, text_file):
    return {"vit": VIT, "gpt2": [*GPT2, "--train-files", text_file], "detr": DETR}[kind] + COMMON


def run(script, *args, nproc=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    return subprocess.run([*launcher, str(ROOT / "scripts" / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def ok(proc, code=0):
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r}


def weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


_full_runs = {}


@pytest.fixture
def full_run(request, text_file, tmp_path_factory):
    """4 uninterrupted steps with a checkpoint after each (computed once per script)."""
    kind = request.param
    if kind not in _full_runs:
        out = tmp_path_factory.mktemp(kind) / "full"
        ok(run(FILES[kind], *base_args(kind, text_file), *DROPOUT[kind], "--steps", 4, "--ckpt-interval", 1,
               "--keep-checkpoints", 0, "--output-dir", out))
        _full_runs[kind] = out
    return kind, _full_runs[kind]


ALL = [SCRIPTS["vit"], SCRIPTS["gpt2"], SCRIPTS["detr"]]


@pytest.mark.parametrize("full_run", ALL, indirect=True)
def test_script_trains_and_writes_checkpoints(full_run):
    kind, out = full_run
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and all(0 < l < 20 for l in losses.values()), losses
    assert all((out / f"checkpoint-{s}" / "train_state.pt").is_file() for s in range(1, 5))
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert any(k.startswith("eval_") for r in records for k in r), "no evaluation after training"
    # a checkpoint directory is a pretrained= source
    model = fastzoo.create(MODELS[kind], pretrained=out / "checkpoint-4")
    name, p = next(iter(model.state_dict().items()))
    assert torch.equal(p, weights(out / "checkpoint-4")[name])


@pytest.mark.parametrize("full_run", ALL, indirect=True)
def test_resume_matches_then_nan_is_captured_and_replayed(full_run, text_file, tmp_path):
    kind, full = full_run
    proc = run(FILES[kind], *base_args(kind, text_file), *DROPOUT[kind], "--steps", 4, "--ckpt-interval", 1,
               "--keep-checkpoints", 0, "--output-dir", tmp_path, "--resume", full / "checkpoint-2",
               "--debug-nan-at-step", 4)
    ok(proc, code=3)
    # Resume: same weights, optimizer, RNG streams and data order on the same CPU, so step 3
    # is exactly the uninterrupted run's (tolerance 0), and so are the weights after it.
    resumed, uninterrupted = train_losses(tmp_path), train_losses(full)
    assert resumed == {3: uninterrupted[3]}, (resumed, uninterrupted)
    assert same_weights(tmp_path / "checkpoint-3", full / "checkpoint-3")
    # NaN capture: stopped at step 4 before the update; the captured weights are the ones after step 3.
    cap = tmp_path / "nan_step4"
    assert not (tmp_path / "checkpoint-4").exists()
    assert same_weights(cap, full / "checkpoint-3")
    assert f"--replay {cap}" in proc.stderr
    rep = ok(run(FILES[kind], "--replay", cap))
    n = len(load_file(str(cap / "observed.safetensors"))) - 1  # every gradient, plus the loss
    assert "loss inf (captured inf): bit-identical" in rep.stdout, rep.stdout
    assert f"gradients: {n}/{n} tensors bit-identical" in rep.stdout and "reproduced bit for bit" in rep.stdout


@pytest.mark.parametrize("kind", [SCRIPTS["vit"], SCRIPTS["gpt2"]])
def test_torchrun_two_gloo_processes_match_one(kind, text_file, tmp_path):
    """Same global batch on 1 and 2 processes. For GPT-2 the two processes hold different
    numbers of tokens, which the loss normalisation (by the all-reduced counts) must absorb.
    (DETR's class term is a weighted mean over each process's own queries, in transformers and
    in DETR alike, so N processes train on the mean of N per-process losses, not on one.)"""
    args = [*base_args(kind, text_file), *NO_DROPOUT[kind], "--steps", 2, "--device", "cpu"]
    ok(run(FILES[kind], *args, "--output-dir", tmp_path / "one"))
    ok(run(FILES[kind], *args, "--output-dir", tmp_path / "two", nproc=2))
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2]
    # Only the order of fp32 sums differs (all-reduce): relative 1e-5.
    assert all(abs(one[s] - two[s]) <= 1e-5 * abs(one[s]) for s in one), (one, two)
    a, b = weights(tmp_path / "one" / "checkpoint-2"), weights(tmp_path / "two" / "checkpoint-2")
    # Two AdamW steps from identical weights: Adam's normalised update turns ~1e-7 relative
    # gradient differences into weight differences far below 1e-5 (weights are ~0.02-1).
    assert all(((a[k] - b[k]).abs() <= 1e-5).all() for k in a)


# -- user errors: one line on stderr, exit status 2 ---------------------------------------
def _main(script):
    spec = importlib.util.spec_from_file_location(script[:-3], ROOT / "scripts" / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def user_error(capsys, script, args, *needles):
    """In process (cheap): run_main turns the error into SystemExit(2) and one message line."""
    mod = _main(script)
    with pytest.raises(SystemExit) as e:
        mod.run_main(mod.main, [str(a) for a in args])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and all(n in err for n in needles), err


def test_user_error_in_a_subprocess_is_one_line(tmp_path):
    proc = run("finetune_image_classification.py", "--data-dir", tmp_path / "missing")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"finetune_image_classification.py: error: --data-dir {tmp_path / 'missing'}: "
                                                 "no train/ folder there (expected DATA/train/<class>/<image>)"]


@pytest.mark.parametrize("args,needles", [
    (["--synthetic", "8", "--model", "vit_nope"], ["unknown model 'vit_nope'"]),
    (["--synthetic", "8", "--model-kwargs", "dept=2"], ["dept"]),
    (["--synthetic", "8", "-b", "0"], ["--batch-size", "positive"]),
    (["--synthetic", "8", "--model-kwargs", "img_size=16", "patch_size=8", "depth=1", "-b", "64"], ["fewer than --batch-size 64"]),
    (["--synthetic", "8", "-b", "4", "--resume", "/nonexistent/ckpt", "--model-kwargs", "img_size=16", "patch_size=8", "depth=1"],
     ["--resume /nonexistent/ckpt"]),
    ([], ["--data-dir DIR", "--synthetic N"]),
    (["--replay", "/nonexistent/nan_step3"], ["/nonexistent/nan_step3", "meta.json"]),
])
def test_vit_user_errors(capsys, tmp_path, args, needles):
    user_error(capsys, "finetune_image_classification.py", [*args, "--output-dir", tmp_path, "--workers", "0"], *needles)


def test_vit_unreadable_image_folder(capsys, tmp_path):
    (tmp_path / "train").mkdir()  # a train/ folder without class folders
    user_error(capsys, "finetune_image_classification.py", ["--data-dir", tmp_path, "--output-dir", tmp_path / "o"], str(tmp_path / "train"))


@pytest.mark.parametrize("args,needles", [
    (["--train-files", "/nonexistent.txt"], ["no such text file: /nonexistent.txt"]),
    (["--tokenizer", "/nonexistent_tok"], ["--tokenizer /nonexistent_tok"]),
    (["--max-seq-len", "4096"], ["exceeds the model's n_positions 64"]),
])
def test_gpt2_user_errors(capsys, tmp_path, text_file, args, needles):
    base = [*GPT2, "--train-files", text_file, "--output-dir", tmp_path, "--workers", "0"]
    user_error(capsys, "finetune_causal_lm.py", [*base, *args], *needles)


def test_detection_unreadable_annotations(capsys, tmp_path):
    bad = tmp_path / "ann.json"
    bad.write_text('{"images": [{"id": 1}]}')
    user_error(capsys, "finetune_detection.py", ["--train-images", tmp_path, "--train-ann", bad, "--output-dir", tmp_path / "o"],
               str(bad), "not COCO detection format")


# -- one script per task: any family of the task ----------------------------------------------------
def test_image_classification_script_trains_a_resnet_and_timm_reads_its_checkpoint(tmp_path):
    """The recipe comes from the model: a convnet has no image size of its own (--img-size), its
    normalisation is its pretrained_cfg's. The checkpoint is timm's hub format: timm builds the same
    network from it (logits within fp32's 1e-4)."""
    import timm

    out = tmp_path / "run"
    ok(run("finetune_image_classification.py", "--model", "resnet18", "--model-kwargs", "layers=[1,1,1,1]",
           "--synthetic", 16, "--img-size", 32, "-b", 8, "--steps", 2, "--output-dir", out, *COMMON))
    losses = train_losses(out)
    assert sorted(losses) == [1, 2] and all(0 < v < 20 for v in losses.values()), losses
    ckpt = out / "checkpoint-2"
    ours = fastzoo.create("resnet18", pretrained=ckpt).eval()
    theirs = timm.create_model(f"local-dir:{ckpt}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - theirs(x)).abs().max().item() <= 1e-4  # fp32 equivalence rule


@pytest.mark.parametrize("name,fields", [
    ("llama", ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "max_position_embeddings")),
    ("gpt2", ("n_layer", "n_embd", "n_head", "n_positions")),
])
def test_causal_lm_script_trains_any_family_and_transformers_reads_its_checkpoint(name, fields, text_file, tmp_path):
    """`--model llama` trains (its longest sequence from max_position_embeddings: it has no
    n_positions); the checkpoint carries model_type and transformers' keys, so
    AutoModelForCausalLM.from_pretrained reads it and computes fastzoo's logits (fp32: 1e-4)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    ok(run("finetune_causal_lm.py", "--model", name, "--model-kwargs", *model_kwargs(TINY[name], *fields),
           "--train-files", text_file, "--max-tokens", 128, "-b", 2, "--validation-split-percentage", 10,
           "--steps", 2, "--output-dir", out, *COMMON))
    losses = train_losses(out)
    assert sorted(losses) == [1, 2] and all(0 < v < 20 for v in losses.values()), losses
    ckpt = out / "checkpoint-2"
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == name
    theirs = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ours = fastzoo.create(name, pretrained=ckpt, attn="eager").eval()
    ids = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max().item() <= 1e-4  # fp32 equivalence rule


@pytest.mark.parametrize("script,model,needle", [
    ("finetune_image_classification.py", "llama", "finetune_causal_lm.py"),
    ("finetune_causal_lm.py", "resnet18", "finetune_image_classification.py"),
    ("finetune_image_classification.py", "detr", "finetune_detection.py"),
    ("finetune_detection.py", "resnet18", "finetune_image_classification.py"),
])
def test_a_model_of_another_task_is_refused_in_one_line_naming_its_script(script, model, needle, text_file, tmp_path):
    proc = run(script, "--model", model, "--train-files" if "causal" in script else "--synthetic",
               text_file if "causal" in script else 8, "--output-dir", tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and f"--model {model}: a " in lines[0] and needle in lines[0], lines
