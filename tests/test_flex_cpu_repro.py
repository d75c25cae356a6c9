"""Compiled FlexAttention on CPU: refused or served by the torch-only reproducer's verdict.

The reproducer (``python -m fastzoo.attention.flex_cpu_repro``) compares compiled with eager
flex on CPU and stores its verdict per torch version. This test runs it on the torch installed
here and checks that fastzoo follows it: no verdict or ``wrong`` refuses, ``correct`` serves,
and a served compiled flex equals eager. On a torch where the two disagree it stays refused.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastzoo.attention import AttnContext, AttnRequest, get_backend
from fastzoo.attention import flex as flex_module
from fastzoo.errors import BackendUnavailableError

ROOT = Path(__file__).resolve().parents[1]
CPU = AttnRequest(head_dim=16, device="cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTZOO_CACHE_DIR", str(tmp_path))
    flex_module._refusal_for.cache_clear()
    yield tmp_path
    flex_module._refusal_for.cache_clear()


def test_without_a_verdict_compiled_flex_on_cpu_is_refused_naming_the_reproducer(cache):
    problems = get_backend("flex", compile=True).problems(CPU)
    assert any("python -m fastzoo.attention.flex_cpu_repro" in p and "no verdict" in p for p in problems)


def test_the_reproducer_decides_the_refusal(cache):
    r = subprocess.run([sys.executable, "-m", "fastzoo.attention.flex_cpu_repro"], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "FASTZOO_CACHE_DIR": str(cache)},
                       timeout=600)
    verdict = json.loads(r.stdout.strip().splitlines()[-1])
    assert verdict["torch"] == torch.__version__ and verdict["runs"] > 0
    assert r.returncode == (0 if verdict["verdict"] == "correct" else 1)
    flex_module._refusal_for.cache_clear()
    backend = get_backend("flex", compile=True)
    refused = [p for p in backend.problems(CPU) if "compiled FlexAttention on CPU is refused" in p]
    if verdict["verdict"] == "wrong":
        assert refused and f"wrong in {verdict['wrong']} of {verdict['runs']}" in refused[0]
        return
    assert not refused  # this torch passed: the refusal lifted itself
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    ctx = AttnContext(causal=True)
    with torch.no_grad():
        out = backend(q, k, v, ctx)
    assert (out - get_backend("eager")(q, k, v, ctx)).abs().max() <= 1e-4  # fp32 CPU, summation order


def test_a_wrong_verdict_keeps_the_refusal(cache):
    (cache / f"flex_cpu_compiled-torch-{torch.__version__}.json").write_text(
        json.dumps({"torch": torch.__version__, "verdict": "wrong", "wrong": 3, "runs": 6}))
    with pytest.raises(BackendUnavailableError, match="wrong in 3 of 6 runs"):
        get_backend("flex", compile=True).check(CPU)
