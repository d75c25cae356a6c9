"""``benchmarks/gpu_suite.sh seeds``: its CPU dry run projects the stage within 8 minutes of one
H100, and the suites it runs take every case it plans (sdpa's pinned kernels included)."""
import os
import subprocess
import sys
from pathlib import Path

import torch

from fastzoo.bench import run_suite, seeds

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_prints_each_part_and_fits_the_stage():
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "seeds", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    for part in ("vit", "gpt2", "giou"):
        assert f"| {part} |" in out.stdout and f"seeds.py --part {part} --device cuda" in out.stdout
    assert "(fits)" in out.stdout and "projected total on one H100" in out.stdout


def test_projection_counts_fixed_costs_and_refuses_an_overrun():
    part = seeds.Part("p", "what", ["a", "b"], flops_per_step=seeds.H100_BF16_FLOPS * seeds.STEP_EFFICIENCY)  # 1 s steps
    steps = (seeds.WARMUP + seeds.ROUNDS + 1) * 2
    assert part.projected_s() == seeds.COLD_START_S + 2 * seeds.CASE_S + steps * 1.0
    assert not seeds.fits([part] * 20) and seeds.fits([seeds.Part("q", "what", ["a"])])


def test_plan_covers_the_seeds_backends():
    vit, gpt2, giou = seeds.plan()
    assert {"fastzoo sdpa (sdpa_backend=flash)", "fastzoo sdpa (sdpa_backend=math)", "fastzoo flex", "fastzoo nested",
            "fastzoo xformers", "fastzoo fa4"} <= set(vit.cases)
    assert "fastzoo varlen (packed)" in gpt2.cases and "fastzoo nested (packed)" in gpt2.cases
    assert {c.split(",")[0] for c in giou.cases} == {"per_sample", "concat", "padded", "kernel"}


def test_a_pinned_kernel_is_a_case_of_the_image_suite():
    from fastzoo.bench.image_classification import image_classification_suite
    from fastzoo.models.spec import Workload
    from fastzoo.registry import get_entry

    tiny = Workload("tiny", dict(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4, num_classes=10), batch=2)
    suite = image_classification_suite(get_entry("vit_b16"), [tiny], backends=["eager", ("sdpa", {"sdpa_backend": "math"})],
                                       device=torch.device("cpu"))
    rows = run_suite(suite, warmup=0, iters=1, progress=False).rows
    pinned = next(r for r in rows if r.label == "fastzoo sdpa (sdpa_backend=math)")
    assert pinned.status == "ok" and pinned.max_err <= 1e-4  # fp32: the equivalence rule
