"""`fastzoo tour`, the README's main job: at its smallest size, through the real command line.

The tour is run once (a subprocess, as a user runs it); the tests read what it printed and
wrote. Values are checked, not presence: parity within the rule of each row's precision, the
recommended path one that passed parity and the fastest that did, every figure beside its
limit, the chart a real PNG. Times are never asserted.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastzoo.bench.harness import Row
from fastzoo.bench.recipes import BASELINE
from fastzoo.bench.tour import Entry, Recommendation, recommend
from fastzoo.registry import specs
from fastzoo.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
FP32_OUT_ATOL = 1e-4  # fastzoo.equivalence's rule: fp32 logits within 1e-4 of the original
FP32_GRAD_RTOL = 1e-4  # gradients: the worst parameter's relative error (fastzoo.parity's rule)
# every family with quick tour settings, image classifiers first, then causal LMs, then detectors
ORDERED = sorted((s for s in specs() if s.bench is not None and "quick" in s.bench.sizes), key=lambda s: TASKS.index(s.task))
MODELS = [s.bench.variant for s in ORDERED]


# families whose fp32 rows are compared with the original in fp64 (bilinear sampling's gradient jumps at its cell
# edges): within the fp32 rule or 3x the original fp32's own error from fp64, parameter by parameter
FP64_REFERENCE = tuple(s.bench.variant for s in ORDERED if s.original.fp64_reference)


def _within_rule(r) -> bool:
    """fp32 rows within the fp32 rule; a low-precision row within its bound (3x the original's own error)."""
    if r["precision"] == "fp32" and not r["group"].startswith(FP64_REFERENCE):
        return r["max_err"] <= FP32_OUT_ATOL and (r["grad_err"] is None or r["grad_err"] <= FP32_GRAD_RTOL)
    return r["max_err"] <= r["out_bound"] and (r["grad_err"] is None or r["grad_err"] <= r["grad_bound"])


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    out = tmp_path_factory.mktemp("tour")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "fastzoo.cli", "tour", "--quick", "--device", "cpu", "--out", str(out),
                           "--no-progress", "--threads", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    STDERR.append(proc.stderr)
    return proc.stdout, json.loads((out / "tour.json").read_text()), out


STDERR = []  # the tour's stderr, kept by the fixture


def test_stderr_is_clean(tour):
    """No profiler start/stop or device-probe lines, no warnings about the random configs the tour
    builds itself: whatever reaches stderr is the user's business (here: nothing)."""
    noise = [line for line in STDERR[-1].splitlines() if line.strip()]
    assert not noise, "\n".join(noise[:20])


def test_every_speedup_says_whether_it_is_reliable(tour):
    """--quick times one round: no spread to judge, so every figure is marked unreliable, in the
    JSON, the table and the printed line; the load before and after is in the header."""
    stdout, data, _ = tour
    assert len(data["load"]) == 2 and data["cores"] >= 1
    assert "load " in stdout and f"on {data['cores']} cores" in stdout
    for rec in data["recommendations"]:
        if rec["label"] is not None:
            assert "one timed round, spread not measured" in rec["unreliable"]
            assert "UNRELIABLE: one timed round" in rec["line"]
    table = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert sum("| no: one timed round" in line for line in table) == sum(r["label"] is not None for r in data["recommendations"])


def test_every_model_has_a_recommendation_that_passed_parity(tour):
    _, data, _ = tour
    assert [r["model"] for r in data["recommendations"]] == MODELS
    rows = {(r["group"], r["label"]): r for r in data["rows"]}
    for rec in data["recommendations"]:
        chosen = [r for r in data["rows"] if r["label"] == rec["label"] and not r["peer"]]
        assert chosen, f"{rec['model']}: recommended {rec['label']!r}, which is not a measured row"
        row = chosen[0]
        assert row["status"] == "ok", f"{rec['model']}: recommended a path with status {row['status']}"
        assert row["max_err"] is not None and _within_rule(row)
        assert (row["group"], row["label"]) in rows


def test_parity_of_every_timed_fastzoo_path_is_within_the_rule_of_its_precision(tour):
    _, data, _ = tour
    checked = 0
    for r in data["rows"]:
        assert r["status"] in ("ok", "unavailable"), f"{r['group']} / {r['label']}: {r['status']} {r['note']}"
        if r["status"] == "ok" and not r["peer"] and not r["floor"]:  # a floor row computes no loss
            assert _within_rule(r), f"{r['label']} ({r['precision']}): logits {r['max_err']}, grads {r['grad_err']}"
            if r["precision"] == "fp32" and not r["group"].startswith(FP64_REFERENCE):
                assert r["out_bound"] == FP32_OUT_ATOL
            elif r["precision"] == "fp32":  # against the original's fp64 run: bounded by its own fp32 error there
                assert r["out_bound"] is not None and r["grad_bound"] is not None
            checked += 1
    assert checked >= len(MODELS)  # at least one fastzoo path per model was compared with its original


def test_every_model_step_is_beside_the_same_run_gemm_peak(tour):
    """FLOP/s of a step (its family's count) / the GEMM peak in its precision, measured in the same run;
    a packed row's FLOP-ratio bound is the padded peer's FLOPs over its own (> 1: padding removed)."""
    _, data, _ = tour
    peaks = data["limits"]["gemm_flops"]
    assert "fp32" in peaks and all(v > 0 for v in peaks.values())
    model_steps = [r for r in data["rows"] if r["unit"] in ("images/s", "tokens/s") and r["median_s"] is not None]
    assert model_steps and all(r["flop_rate"] is not None for r in model_steps)
    for r in model_steps:
        assert r["flop_share"] == pytest.approx(r["flop_rate"] / peaks[r["precision"]])
    packed = [r for r in data["rows"] if "packed" in r["label"] and r["median_s"] is not None]
    assert packed and all(r["work_bound"] > 1 for r in packed)


def test_speedups_are_against_the_original_timed_in_the_same_run(tour):
    _, data, _ = tour
    for group in {r["group"] for r in data["rows"]}:
        rows = [r for r in data["rows"] if r["group"] == group]
        peer = [r for r in rows if r["peer"]]
        assert len(peer) == 1, f"{group}: one original per setting"
        for r in rows:
            if r["median_s"] is not None:
                assert r["speedup"] == pytest.approx(peer[0]["median_s"] / r["median_s"])


def test_printed_table_and_lines_carry_the_measured_values(tour):
    stdout, data, _ = tour
    assert "fastzoo tour on **cpu-" in stdout and "same-run limits" in stdout
    table = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert [line.split("|")[1].strip() for line in table] == MODELS
    for rec in data["recommendations"]:
        assert rec["line"] in stdout  # one line per model: what to use here, the ratio and the parity numbers
        assert rec["line"].startswith(f"{rec['model']}: {rec['use']}")
        assert f"{rec['speedup']:.2f}x" in rec["line"]
    from fastzoo.bench.tour import BRING

    assert BRING in stdout  # how to bring one's own (transformers') checkpoint: tests/test_hf_vision.py runs it


def test_chart_is_a_png_and_the_markdown_lists_every_row(tour):
    _, data, out = tour
    png = (out / "tour.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (out / "tour.md").read_text()
    for r in data["rows"]:
        assert r["label"] in md


def _row(label, status="ok", median=1.0, peer=False):
    return Row("g", label, False, status, peer=peer, median_s=median if status == "ok" else None,
               speedup=None, max_err=0.0)


def test_recommendation_is_the_fastest_path_that_passed_parity():
    entry = Entry("m", "orig", suite=None, paths={"a": "use a", "b": "use b", "c": "use c"}, groups={"g": BASELINE})
    rows = [_row("orig", peer=True, median=2.0), _row("a", median=1.0), _row("b", "failed parity"), _row("c", median=0.5)]
    assert recommend(entry, rows).use == "use c"
    rows[3] = _row("c", "failed parity")  # the fastest answer is wrong: never recommended
    assert recommend(entry, rows).use == "use a"


def test_no_recommendation_when_nothing_passed():
    entry = Entry("m", "orig", suite=None, paths={"a": "use a"}, groups={"g": BASELINE})
    rec = recommend(entry, [_row("orig", peer=True), _row("a", "failed parity")])
    assert rec.row is None and "no fastzoo path passed parity" in rec.line()


def test_recommendation_line_shows_each_error_beside_its_bound():
    from fastzoo.bench.tour import Recommendation

    row = Row("g | bf16 autocast", "fastzoo sdpa", False, "ok", median_s=1.0, speedup=1.3, max_err=2.1e-3,
              grad_err=6.9e-3, out_bound=6e-3, grad_bound=2e-2, precision="bf16 autocast")
    line = Recommendation("m", "use", row, None).line()
    assert "logits 2e-03 (<= 6e-03), grads 7e-03 (<= 2e-02), bf16 autocast rule" in line


def _timed(label, median, lo, hi, iters=5, peer=False):
    return Row("g", label, False, "ok", peer=peer, median_s=median, min_s=lo, max_s=hi, iters=iters, speedup=1.0)


def test_reliability_flags_spread_load_and_single_rounds():
    from fastzoo.bench.harness import SPREAD_LIMIT, reliability

    quiet = _timed("a", 1.0, 0.96, 1.04), _timed("peer", 2.0, 1.92, 2.08, peer=True)
    assert reliability(*quiet, load=[0.5, 0.7], cores=2) == []
    wide = _timed("a", 1.0, 0.5, 1.0 + SPREAD_LIMIT + 0.1)
    assert any("a's rounds spread" in w for w in reliability(wide, quiet[1], load=[0.5], cores=2))
    assert any("load 5.0 on 2 cores" in w for w in reliability(*quiet, load=[1.0, 5.0], cores=2))
    once = _timed("a", 1.0, 1.0, 1.0, iters=1)
    assert reliability(once, quiet[1], load=[0.1], cores=2) == ["one timed round, spread not measured"]


def test_every_suite_records_its_load_and_judges_each_timed_row():
    """The harness, not each report, applies the rule: a suite's rows carry their verdicts, its
    markdown the load before and after and a "reliable" column."""
    from fastzoo.bench.harness import Case, Group, Step, Suite, run_suite

    step = lambda: Step(run=lambda: torch.ones(64).sum(), items=1)  # noqa: E731
    suite = Suite("s", [Group("g", [Case("peer", step, peer=True), Case("ours", step)])], device=torch.device("cpu"))
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    assert len(report.load) == 2 and report.cores >= 1
    assert all("one timed round, spread not measured" in r.unreliable for r in report.rows)
    text = report.to_markdown()
    assert "Load (1-minute average)" in text and "| no: one timed round" in text


def test_recommendation_names_the_same_recipe_first_and_says_when_the_recipe_is_the_gain():
    row = _timed("fastzoo sdpa", 1.0, 0.99, 1.01)
    row.speedup, row.vs_original, row.max_err = 1.97, 1.01, 1e-3
    line = Recommendation("vit", "use", row, _timed("timm (fp32, eager)", 1.97, 1.95, 1.99, peer=True)).line()
    same, default = line.index("1.01x the original under the same recipe"), line.index("1.97x timm (fp32, eager)")
    assert same < default and "the gain over its users' default is the recipe" in line
    row.vs_original = 2.62
    assert "is the recipe" not in Recommendation("gpt2", "use", row, None).line()



def test_tables_show_the_same_recipe_ratio_before_the_peer_ratio():
    from fastzoo.bench.report import Report

    ours, peer = _timed("fastzoo sdpa", 1.0, 0.99, 1.01), _timed("timm (fp32, eager)", 1.97, 1.95, 1.99, peer=True)
    ours.speedup, ours.vs_original = 1.97, 1.01
    ours.throughput = peer.throughput = 1.0
    header = Report("s", "cpu", "bf16", {}, 1, 5, {}, 1, [peer, ours]).table().splitlines()[0]
    assert header.index("vs the original, same recipe") < header.index("speed-up vs peer")
    assert "| 1.01x | 1.97x |" in Report("s", "cpu", "bf16", {}, 1, 5, {}, 1, [peer, ours]).table()
