"""benchmarks/gpu_suite.sh: stages that each fit one call on the GPU machine.

What a CPU can check: the stage list, argument errors (exit 2 with the usage), the commands
each stage runs (--dry-run), and that a real stage, run on the CPU at tiny size (--cpu),
leaves exactly one archive and one summary in OUTDIR, prints the summary, and writes
nothing else anywhere in the repository.
"""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.sh"


def suite(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})}, timeout=300)


def stages() -> list[str]:
    return [line.split()[0] for line in suite("--list").stdout.splitlines()]


def test_the_stages_cover_env_tests_parity_per_backend_and_each_benchmark():
    names = stages()
    assert {"env", "tests", "bench-vit", "bench-gpt2", "bench-giou", "bench-resnet"} <= set(names)
    # the backends fastzoo ships, asked of a fresh process (other tests register their own)
    fresh = subprocess.run([sys.executable, "-c", "import fastzoo; print(*fastzoo.list_attention())"],
                           capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    builtin = set(fresh.stdout.split()) - {"neuron"}  # neuron needs Trainium, not a GPU
    assert {f"parity-{b}" for b in builtin} <= set(names)


@pytest.mark.parametrize("args,words", [
    ((), "usage:"),
    (("nope", "/tmp/x"), "unknown stage 'nope'"),
    (("env", "/tmp/x", "--fast"), "unknown option '--fast'"),
    (("env", ROOT / "inside"), "OUTDIR must be outside the repository"),
])
def test_argument_errors_exit_2_with_the_reason(args, words):
    res = suite(*args)
    assert res.returncode == 2 and words in res.stderr
    assert not (ROOT / "inside").exists()


def test_dry_run_prints_each_step_and_leaves_outdir_empty(tmp_path):
    res = suite("parity-sdpa", tmp_path / "out", "--dry-run")
    assert res.returncode == 0
    lines = res.stdout.splitlines()
    assert any(line.startswith("sdpa_pinned_gpt2_bf16:") and "sdpa:sdpa_backend=cudnn" in line for line in lines)
    assert all("--device cuda" in line and "--explain" in line for line in lines)
    assert list((tmp_path / "out").iterdir()) == []


def _tree_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True).stdout


def test_a_stage_leaves_one_archive_and_one_summary_and_writes_nothing_else(tmp_path):
    before = _tree_state()
    out = tmp_path / "out"
    res = suite("parity-eager", out, "--cpu")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["parity-eager.md", "parity-eager.tar.gz"]
    summary = (out / "parity-eager.md").read_text()
    assert summary.strip() in res.stdout  # printed as well
    assert "| eager_vit_s16_fp32 | ok |" in summary and "| eager_gpt2_fp32 | ok |" in summary
    with tarfile.open(out / "parity-eager.tar.gz") as tar:
        names = tar.getnames()
        prefix = next(n for n in names if n.count("/") == 3 and n.endswith("/parity-eager"))
        assert prefix.startswith("benchmarks/results/") and all(n == prefix or n.startswith(prefix + "/")
                                                                 for n in names if n.count("/") >= 3)
        result = json.load(tar.extractfile(f"{prefix}/parity_eager_gpt2_fp32.json"))
    assert result["results"][0]["passed"]
    assert _tree_state() == before  # no bytecode, cache or result file appeared in the repository


def test_a_stage_refuses_to_overwrite_its_own_archive(tmp_path):
    (tmp_path / "env.tar.gz").write_bytes(b"")
    res = suite("env", tmp_path, "--dry-run")
    assert res.returncode == 2 and "exists" in res.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python: names the device, fails pip installs, prints fastzoo check's table for a refused backend
case "$*" in
  *device_name*) echo cpu-test ;;
  *"pip install"*) echo "ERROR: wheel.whl is not a supported wheel on this platform." >&2; exit 1 ;;
  *"fastzoo.cli check"*)
    echo "| backend | device | dtype | compared | max error | bound | original's own error | result |"
    echo "|---|---|---|---|---|---|---|---|"
    echo "| fa4 | cpu | fp32 |  |  |  |  | unavailable: attention backend 'fa4' needs the package(s) flash_attn.cute |"
    exit 1 ;;
esac
"""


def test_a_failed_step_names_the_refusal_and_a_failed_wheel_install_is_a_row(tmp_path):
    """The summary says why a step failed (not the table's "max error" header), and a wheel that
    did not install is a row of the summary, not silence."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"")
    res = suite("parity-fa4", tmp_path / "out", "--cpu", env={"PYTHON": str(fake), "WHEELS": str(wheels)})
    assert res.returncode == 1
    summary = (tmp_path / "out" / "parity-fa4.md").read_text()
    assert "| install_wheels | failed: ERROR: wheel.whl is not a supported wheel" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| fa4_")]
    assert rows and all("unavailable: attention backend 'fa4' needs the package(s) flash_attn.cute" in r for r in rows)
    assert "max error" not in summary

