"""Bad arguments to ``fastzoo bench | check | convert | list`` and to the training scripts:
one line on stderr naming the problem (``fastzoo CMD: error: ...``), exit status 2, no
traceback, nothing written. In process (``fastzoo.cli.main``) for the many cases; two
subprocesses prove what a user sees from the real entry points."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY

import fastzoo
from fastzoo.cli import main

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ck") / "vit"
    fastzoo.create("vit_s16", **TINY["vit"]).save_pretrained(path)
    return path


def one_line_error(capsys, argv, *needles):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors exit from inside parse_args
        code = e.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"fastzoo {argv[0]}: error: ") or lines[0].startswith("fastzoo: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


BENCH = {
    "unknown model": (["bench", "vit_nope"], ["unknown model 'vit_nope'", "Did you mean"]),
    "no model": (["bench"], ["required: model"]),
    "batch size 0": (["bench", "vit_s16", "--batch-size", "0"], ["--batch-size", "positive"]),
    "batch size -1": (["bench", "vit_s16", "--batch-size", "-1"], ["--batch-size", "positive"]),
    "batch size text": (["bench", "vit_s16", "--batch-size", "many"], ["--batch-size", "integer"]),
    "iters 0 (a median of no runs)": (["bench", "vit_s16", "--iters", "0"], ["--iters", "positive"]),
    "warmup -1": (["bench", "vit_s16", "--warmup", "-1"], ["--warmup", "0 or more"]),
    "threads 0": (["bench", "vit_s16", "--threads", "0"], ["--threads"]),
    "set a text depth": (["bench", "vit_s16", "--set", "depth=x"], ["--set depth='x'", "like 12"]),
    "set depth 0": (["bench", "vit_s16", "--set", "depth=0"], ["--set depth=0", "positive"]),
    "set without =": (["bench", "vit_s16", "--set", "depth"], ["--set 'depth'", "key=value"]),
    "set an unknown field": (["bench", "vit_s16", "--set", "dept=2"], ["--set dept", "depth"]),
    "set a field resnet lacks": (["bench", "resnet50", "--set", "depth=2"], ["--set depth", "img_size"]),
    "unknown backend": (["bench", "vit_s16", "--attn", "flsh"], ["unknown attention backend 'flsh'"]),
    "empty backend list": (["bench", "vit_s16", "--attn", ","], ["--attn"]),
    "unknown dtype": (["bench", "vit_s16", "--dtype", "fp13"], ["--dtype", "fp13"]),
    "parity-train of a GPT-2": (["bench", "gpt2", "--parity-train"], ["--parity-train", "vit_s16", "gpt2"]),
}


@pytest.mark.parametrize("case", list(BENCH))
def test_bench_bad_arguments(capsys, case):
    argv, needles = BENCH[case]
    one_line_error(capsys, argv, *needles)


CHECK = {
    "unknown model": (["check", "vit_nope", "--tiny"], ["unknown model 'vit_nope'"]),
    "a name fastzoo refuses": (["check", "boxdet_r50", "--tiny"], ["'boxdet_r50' is not reproduced by fastzoo",
                                                                    "create('detr')"]),
    "unknown backend": (["check", "vit_s16", "--tiny", "--attn", "nope"], ["unknown attention backend 'nope'"]),
    "unknown backend option": (["check", "vit_s16", "--tiny", "--attn", "sdpa:bogus=1"], ["unknown option(s) ['bogus']"]),
    "batch 0": (["check", "vit_s16", "--tiny", "--batch", "0"], ["--batch", "positive"]),
}


@pytest.mark.parametrize("case", list(CHECK))
def test_check_bad_arguments(capsys, case):
    argv, needles = CHECK[case]
    one_line_error(capsys, argv, *needles)


@NO_CUDA
@pytest.mark.parametrize("command", [["bench", "vit_s16"], ["check", "vit_s16", "--tiny"]])
def test_device_cuda_without_cuda(capsys, command):
    one_line_error(capsys, [*command, "--device", "cuda"], "--device='cuda' is not available on this machine")


def test_convert_bad_arguments(capsys, ckpt, tmp_path):
    out = tmp_path / "out"
    one_line_error(capsys, ["convert", "vit_nope", ckpt, out], "unknown model 'vit_nope'")
    one_line_error(capsys, ["convert", "vit_s16", tmp_path / "missing", out], "no such file or directory")
    one_line_error(capsys, ["convert", "vit_s16", ckpt, out, "--set", "depth"], "--set 'depth'")
    one_line_error(capsys, ["convert", "vit_s16", ckpt, out, "--to", "onnx"], "format='onnx'")
    one_line_error(capsys, ["convert", "gpt2", ckpt, out], "a vit checkpoint, not a gpt2 one")
    one_line_error(capsys, ["convert", "vit_s16", ckpt, tmp_path / "no" / "x.safetensors", "--to", "timm"], "no such directory")
    (tmp_path / "damaged.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{{{{")
    one_line_error(capsys, ["convert", "vit_s16", tmp_path / "damaged.safetensors", out], "damaged.safetensors: cannot read")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.safetensors"]  # nothing written


def test_unknown_command_and_option(capsys):
    one_line_error(capsys, ["lst"], "invalid choice: 'lst'")
    one_line_error(capsys, ["list", "--bogus"], "unrecognized arguments: --bogus")


def run(args, script=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    target = [str(ROOT / "scripts" / script)] if script else ["-m", "fastzoo.cli"]
    return subprocess.run([sys.executable, *target, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_real_entry_points_print_one_line():
    proc = run(["bench", "vit_s16", "--set", "depth=x"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "fastzoo bench: error: --set depth='x': depth takes a value like 12 (int)"], proc.stderr
    proc = run(["--model", "vit_s16", "--synthetic", "8", "--warmup-steps", "-3"], script="finetune_image_classification.py")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--warmup-steps: must be 0 or more, got -3" in proc.stderr


def test_traceback_on_request(tmp_path):
    """FASTZOO_TRACEBACK=1: the traceback a bug report needs, instead of the one line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FASTZOO_TRACEBACK": "1"}
    proc = subprocess.run([sys.executable, "-m", "fastzoo.cli", "convert", "vit_s16", str(tmp_path / "x"), str(tmp_path / "y")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "CheckpointError" in proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["--synthetic", "8", "--workers", "-1"], "--workers/-j: must be 0 or more"),
    (["--synthetic", "8", "--ckpt-interval", "-5"], "--ckpt-interval: must be 0 or more"),
    (["--synthetic", "8", "--keep-checkpoints", "-1"], "--keep-checkpoints: must be 0 or more"),
    (["--synthetic", "8", "--steps", "0"], "--steps: must be a positive integer"),
    (["--synthetic", "8", "--debug-nan-at-step", "0"], "--debug-nan-at-step: must be a positive integer"),
    (["--synthetic", "8", "-b", "two"], "--batch-size/-b: must be an integer, got 'two'"),
    (["--synthetic", "8", "--model-kwargs", "depth"], "key=value"),
])
def test_script_bad_arguments_are_one_line(capsys, tmp_path, args, needle):
    from test_train_scripts import _main

    mod = _main("finetune_image_classification.py")
    with pytest.raises(SystemExit) as e:
        mod.run_main(mod.main, [*args, "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert not any(tmp_path.iterdir())  # refused before anything was written
