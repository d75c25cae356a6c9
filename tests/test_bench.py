"""The benchmark suite's own correctness: statistics, ratios, parity gating, outputs, CLI.

No timing assertions: the CI machine is shared, so only the arithmetic on whatever times
were measured is checked, never the times themselves.
"""
import json

import pytest
import torch
from conftest import TINY

import fastzoo
from fastzoo.attention import Capabilities
from fastzoo.bench import Case, Group, Step, Suite, measure, run_suite, speedup, summarize
from fastzoo.bench.image_classification import image_classification_suite
from fastzoo.equivalence import compare_cases
from fastzoo.models.spec import Workload
from fastzoo.registry import get_entry

TINY_VIT = Workload("tiny", dict(TINY["vit"]), batch=2)


def vit_suite(backends, modes):
    return image_classification_suite(get_entry("vit_s16"), [TINY_VIT], backends=backends, modes=modes)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box is shared; two spinning threads would only slow the suite
    yield
    torch.set_num_threads(before)


def test_summarize_median_and_range():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 10.0, 4)  # even count: mean of the middle two
    assert summarize([5.0, 1.0, 4.0]).median == 4.0  # odd count: the middle one, outliers ignored
    with pytest.raises(ValueError, match="samples"):
        summarize([])


def test_speedup_is_peer_time_over_case_time():
    assert speedup(2.0, 0.5) == 4.0
    assert speedup(1.0, 2.0) == 0.5
    with pytest.raises(ValueError):
        speedup(1.0, 0.0)


def test_measure_warms_up_then_times_each_call():
    calls = []
    samples = measure(lambda: calls.append(1), warmup=2, iters=3, device=torch.device("cpu"))
    assert len(calls) == 5 and len(samples) == 3 and all(t >= 0 for t in samples)
    with pytest.raises(ValueError, match="iters"):
        measure(lambda: None, warmup=0, iters=0, device=torch.device("cpu"))


def _synthetic_suite():
    def step(n_items):
        return lambda: Step(run=lambda: sum(range(2000)), items=n_items)

    cases = [Case("peer", step(10), peer=True), Case("fast", step(40)), Case("missing", lambda: (_ for _ in ()).throw(
        __import__("fastzoo.bench.harness", fromlist=["Unavailable"]).Unavailable("needs a thing")))]
    return Suite("synthetic", [Group("g", cases, unit="items/s")])


def test_ratios_and_throughput_follow_from_the_measured_medians():
    report = run_suite(_synthetic_suite(), warmup=0, iters=3, progress=False)
    peer, fast, missing = report.rows
    assert peer.speedup == 1.0 and peer.peer
    assert fast.speedup == pytest.approx(peer.median_s / fast.median_s, rel=1e-12)
    assert fast.throughput == pytest.approx(40 / fast.median_s, rel=1e-12)
    assert fast.min_s <= fast.median_s <= fast.max_s and fast.iters == 3
    assert missing.status == "unavailable" and missing.note == "needs a thing" and missing.median_s is None


def test_parity_gate_uses_the_shared_rule():
    ref = {"output": torch.zeros(3), "grad:w": torch.tensor([1.0, -4.0])}
    got = {"output": torch.tensor([0.0, 2e-5, 0.0]), "grad:w": torch.tensor([1.0, -4.02])}
    out, grads = compare_cases(ref, got)
    assert out.err == pytest.approx(2e-5) and out.passed  # fp32 outputs: <= 1e-4
    assert grads.err == pytest.approx(0.02 / 4.0) and not grads.passed  # relative to the gradient scale, > 1e-4
    # low precision: a bound of 3x the eager model's own error in that dtype (plus a small floor)
    peer = {"output": torch.tensor([0.0, 1e-2, 0.0]), "grad:w": torch.tensor([1.0, -4.04])}
    out, grads = compare_cases(ref, got, peer)
    assert out.bound == pytest.approx(3e-2, rel=1e-3) and out.passed and grads.passed
    # a peer library with its own parameter names: gradients compared on the shared names only
    foreign = {"output": torch.zeros(3), "grad:w": torch.tensor([1.0, -4.0]), "grad:theirs": torch.ones(2)}
    assert [c.passed for c in compare_cases(ref, foreign, same_names=False)] == [True, True]
    assert len(compare_cases(ref, {"output": torch.zeros(3), "grad:x": torch.ones(1)}, same_names=False)) == 1


def test_a_group_with_the_originals_fp64_run_judges_fp32_by_its_own_error():
    """``Group.exact`` (the original's fp64 outputs): an fp32 case against them within 3x the original
    fp32's own error from them (flash-attn's rule one precision up), the gradients' worst over every
    parameter, as bilinear sampling's kinks move another parameter in each fp32 run; the output likewise.
    Without it, the same case fails the fixed fp32 tolerance."""
    ref = {"output": torch.tensor([10.001]), "grad:a": torch.tensor([1.0, -4.4]), "grad:b": torch.tensor([2.0, 2.0])}
    exact = {"output": torch.tensor([10.0], dtype=torch.float64),
             "grad:a": torch.tensor([1.0, -4.0], dtype=torch.float64), "grad:b": torch.tensor([2.0, 2.0], dtype=torch.float64)}

    def case(label, outputs, **kw):
        return Case(label, lambda: Step(run=lambda: None, items=1, outputs=lambda: outputs), **kw)

    near = {"output": torch.tensor([10.002]), "grad:a": torch.tensor([1.0, -4.0]), "grad:b": torch.tensor([2.0, 2.5])}
    far = {**near, "grad:b": torch.tensor([2.0, 2.7])}  # 0.7 / 2 = 0.35 > 3x the original's worst, 0.1
    off_out = {**near, "output": torch.tensor([10.0045])}  # the original's own output error is 1e-3
    group = Group("g", [case("original", ref, peer=True, reference=True), case("near", near), case("far", far),
                        case("output off", off_out)], reference=lambda: ref, exact=lambda: exact)
    rows = {r.label: r for r in run_suite(Suite("s", [group]), warmup=0, iters=1, progress=False).rows}
    assert rows["original"].status == "ok" and rows["near"].status == "ok", rows["near"].note
    assert rows["near"].grad_err == pytest.approx(0.25) and rows["near"].grad_bound == pytest.approx(0.3, rel=1e-3)
    assert rows["far"].status == "failed parity" and rows["far"].grad_err == pytest.approx(0.35)
    assert rows["output off"].status == "failed parity" and rows["output off"].out_bound == pytest.approx(3e-3, rel=1e-2)
    without = Group("g", [case("original", ref, peer=True, reference=True), case("near", near)], reference=lambda: ref)
    assert run_suite(Suite("s", [without]), warmup=0, iters=1, progress=False).rows[1].status == "failed parity"


@pytest.fixture
def wrong_backend():
    """A deliberately wrong attention (returns v: no mixing across tokens), counting its calls."""
    from fastzoo.attention import _REGISTRY

    calls = []

    def attend(q, k, v, ctx):
        calls.append(1)
        return v

    fastzoo.register_attention("wrong_for_bench_test", attend, capabilities=Capabilities(devices={"cpu": (torch.float32,)}))
    yield calls
    _REGISTRY.pop("wrong_for_bench_test")


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_backend_failing_parity_is_reported_and_not_timed(wrong_backend, mode):
    suite = vit_suite(["eager", "sdpa", "wrong_for_bench_test"], (mode,))
    report = run_suite(suite, warmup=1, iters=2, progress=False)
    rows = {r.label: r for r in report.rows}
    wrong = rows["fastzoo wrong_for_bench_test"]
    assert wrong.status == "failed parity" and "not timed" in wrong.note
    assert wrong.median_s is None and wrong.speedup is None and wrong.max_err > 1e-2
    assert len(wrong_backend) == TINY_VIT.config["depth"]  # one parity forward through each layer, no timed run
    for label in ("fastzoo eager", "fastzoo sdpa", "timm (sdpa)", "timm (eager)"):
        assert rows[label].status == "ok", rows[label].note
        assert rows[label].max_err <= 1e-4  # fp32 CPU logits, fastzoo.equivalence's rule
        if mode == "train":  # same parameter names as timm, so gradients are compared for the peer too
            assert rows[label].grad_err is not None and rows[label].grad_err <= 1e-3
    assert rows["timm (sdpa)"].speedup == 1.0


def test_report_json_markdown_and_plot(tmp_path):
    suite = vit_suite(["eager", "sdpa"], ("eval",))
    report = run_suite(suite, warmup=0, iters=2, progress=False, note="loaded machine")
    data = json.loads(report.write_json(tmp_path / "vit.json").read_text())
    assert data["suite"] == "vit" and data["device"].startswith("cpu-") and data["iters"] == 2
    assert {"torch", "timm", "transformers"} <= set(data["versions"])
    side = TINY_VIT.config["img_size"]  # every tiny size differs from vit_s16's, so each is named
    sizes = ", ".join(f"{k}={v}" for k, v in TINY_VIT.config.items())
    assert data["config"]["tiny"] == f"vit_small_patch16_224 with {sizes}, {side}x{side} images"
    assert [r["label"] for r in data["rows"]] == ["timm (sdpa)", "timm (eager)", "fastzoo eager", "fastzoo sdpa"]
    for r in data["rows"]:
        assert r["status"] == "ok" and r["median_s"] > 0 and r["throughput"] == pytest.approx(2 / r["median_s"])
        assert r["peak_mem_mib"] is None  # CPU: no allocator statistics; the table says n/a
    md = report.to_markdown()
    assert "> loaded machine" in md and "| backend | compiled | step time (median, min-max) |" in md
    assert sum(line.startswith("|") for line in md.splitlines()) == 2 + 4 and "n/a" in md  # header, rule, one per case
    png = report.plot(tmp_path / "vit.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_on_a_tiny_config(tmp_path, capsys):
    from fastzoo.cli import main

    out = tmp_path / "r.json"
    rc = main(["bench", "vit_s16", "--attn", "eager,sdpa", "--quick", "--no-progress", "--set", "depth=1",
               "--set", "img_size=32", "--set", "patch_size=8", "--json", str(out), "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| timm (sdpa) | no |" in text and "| fastzoo sdpa | no |" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 4 and rows[0]["iters"] == 3  # --quick: 3 timed runs
    assert (tmp_path / "r.png").exists()


def test_cli_bench_deformable_attention_at_the_sizes_set(tmp_path):
    """``fastzoo bench deformable_attention``: the detection task's part suite, its sizes changed by --set
    and named in each row (a 32x32 image at strides 8-64: 4x4, 2x2, 1x1, 1x1 = 22 tokens)."""
    from fastzoo.cli import main

    out = tmp_path / "d.json"
    rc = main(["bench", "deformable_attention", "--quick", "--no-progress", "--set", "image=32", "--set",
               "decoder_queries=5", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert rows[0]["group"].startswith("32x32 image, batch 1") and "encoder: 22 queries" in rows[0]["group"]
    assert "decoder: 5 queries" in rows[2]["group"]


def test_cli_bench_rejects_unknown_backend_and_bad_set(capsys):
    """One line naming the problem, exit status 2 (tests/test_bad_input_cli.py has the rest)."""
    from fastzoo.cli import main

    assert main(["bench", "vit_s16", "--attn", "sdpx", "--quick", "--no-progress"]) == 2
    assert "unknown attention backend 'sdpx'" in capsys.readouterr().err
    assert main(["bench", "vit_s16", "--set", "depht=1", "--quick", "--no-progress"]) == 2
    assert "--set depht" in capsys.readouterr().err


def test_parity_train_short_run_agrees_across_backends():
    from fastzoo.accuracy.backends import train_parity

    report = train_parity(["eager", "sdpa"], steps=15, batch_size=16, held_out=64, progress=False)
    eager, sdpa = report.arms
    assert eager.status == sdpa.status == "ok" and report.agree
    assert len(sdpa.train_loss) == 15
    # fp32, same init and data order: the two runs differ only by rounding in attention.
    assert max(abs(a - b) for a, b in zip(eager.train_loss, sdpa.train_loss)) <= 1e-4
    assert sdpa.final_metric == pytest.approx(eager.final_metric, abs=0.02)


def test_giou_suite_every_layout_matches_torchvision():
    from fastzoo.bench.giou import FLOOR_LABEL, GIoUSetting, giou_suite

    report = run_suite(giou_suite(GIoUSetting("tiny", 4, 8, 3), limits=False), warmup=0, iters=1, progress=False)
    assert [r.label for r in report.rows] == ["torchvision on concatenated real pairs", "fastzoo per-sample loop",
                                              "fastzoo concat", "fastzoo padded", "fastzoo kernel",
                                              "fastzoo padded kernel (mask)", "fastzoo padded kernel (validity from target)",
                                              FLOOR_LABEL, "torchvision (pairs given)", "fastzoo kernel (pairs given)",
                                              FLOOR_LABEL]
    for r in report.rows:
        assert r.status == "ok", (r.label, r.note)
        assert r.throughput == pytest.approx(report.config["real boxes"] / r.median_s)
        if r.floor:  # the floor computes no loss: nothing to compare, only its time to divide by
            assert r.max_err is None and r.vs_floor == 1.0
            continue
        assert r.max_err <= 1e-6 and r.grad_err <= 1e-4  # fp32 mean loss of ~8 pairs; gradients relative
        floor = next(f for f in report.rows if f.floor and f.group == r.group)
        assert r.vs_floor == pytest.approx(r.median_s / floor.median_s)


def test_linear_ce_suite_every_impl_matches_the_logits_and_reports_cpu_memory():
    from fastzoo.bench.linear_ce import LinearCESetting, linear_ce_suite

    suite = linear_ce_suite(LinearCESetting("tiny", 200, 16, 500), limits=False,
                            large_vocab=LinearCESetting("tiny, large vocabulary", 64, 8, 900))
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    assert [r.label.split(" ")[0] for r in report.rows] == ["reference:", "torch", "fastzoo", "HF:", "torch", "fastzoo"]
    for r in report.rows:
        assert r.status == "ok", (r.label, r.note)
        assert r.max_err <= 1e-5 and r.grad_err <= 1e-4  # fp32 mean loss; gradients relative
    ref, _, fused, hf, _, hf_fused = report.rows
    # the reference holds [200, 500] fp32 logits, their log-softmax and gradient (~400 KB each);
    # the fused loss one [256 or fewer, 500] block of them at a time (200 tokens: one chunk)
    assert ref.peak_mem_mib >= 3 * 200 * 500 * 4 / 2**20
    assert fused.peak_mem_mib < ref.peak_mem_mib and hf_fused.peak_mem_mib < hf.peak_mem_mib


def test_matcher_suite_detr_and_fastzoo_agree():
    from fastzoo.bench.matcher import MatcherSetting, matcher_suite

    report = run_suite(matcher_suite(MatcherSetting("tiny", 6, 10, 3)), warmup=0, iters=1, progress=False)
    assert len(report.rows) == 2
    for r in report.rows:
        assert r.status == "ok" and r.max_err == 0, (r.label, r.note)  # the same assignment, index for index


def test_deformable_attention_suite_gates_the_fused_kernel_on_transformers():
    """Both parts (encoder, decoder) time transformers' grid_sample path and the fused kernel, each
    within the fp32 rule of transformers' output and gradients (the peer itself exactly)."""
    from fastzoo.bench.deformable import DeformableSetting, deformable_suite

    report = run_suite(deformable_suite(DeformableSetting("tiny", image=64, decoder_queries=7)), warmup=0, iters=1,
                       progress=False)
    assert [r.label for r in report.rows] == ["transformers MultiScaleDeformableAttention (grid_sample)",
                                              "fastzoo impl=cpu"] * 2
    for r in report.rows:
        assert r.status == "ok" and r.median_s is not None, (r.label, r.note)
        assert r.max_err <= r.out_bound and r.grad_err <= r.grad_bound, r.label
        if r.peer:
            assert r.max_err == 0 and r.grad_err == 0


def test_gpt2_suite_packed_matches_padded():
    from fastzoo.bench.causal_lm import causal_lm_suite

    workload = Workload("tiny", TINY["gpt2"], batch=3, max_len=12)
    backends = [b for b in ("eager", "sdpa", "varlen", "nested") if b in fastzoo.list_attention(available_only=True)]
    suite = causal_lm_suite(get_entry("gpt2"), workload, backends=backends, modes=("train",))
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    for r in report.rows:
        assert r.status in ("ok", "unavailable"), (r.label, r.note)
        if r.status == "ok":
            assert r.max_err <= 1e-4, r.label  # real-token logits vs fastzoo eager padded, fp32
    assert report.rows[0].label.startswith("HF padded to longest") and report.rows[0].status == "ok"


def test_gpt2_training_step_with_labels_matches_the_logits_loss():
    """The training-step row: ``model(..., labels=...).loss.backward()``; fastzoo's fused loss
    (padded and packed) equals HF's loss on the logits, and the gradients too."""
    from fastzoo.bench.causal_lm import causal_lm_suite

    workload = Workload("tiny", TINY["gpt2"], batch=3, max_len=16)
    suite = causal_lm_suite(get_entry("gpt2"), workload, backends=["eager", "sdpa", "varlen"], modes=("train",))
    suite.groups = [g for g in suite.groups if "train with labels" in g.name]
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    assert len(report.rows) == 7 and any("packed (varlen)" in r.label for r in report.rows)
    assert any("DataCollatorWithFlattening" in r.label for r in report.rows)  # HF's own packing, a peer row
    for r in report.rows:
        assert r.status == "ok", (r.label, r.note)
        assert r.max_err <= 1e-5 and r.grad_err <= 1e-4  # fp32 mean loss; gradients relative
        assert r.peak_mem_mib is not None  # measured on CPU for this group


def test_llama_length_mix_labels_rows_carry_the_flop_ratio_bound():
    """The Llama workload's log-normal length mix (the spec's ``median_len``): lengths within
    [16, max_len]; the packed labels row equals the padded original's loss and gradients, and its
    FLOP-ratio bound is the spec's FLOPs padded to the longest over packed, as the config states."""
    from fastzoo.bench.causal_lm import _lengths, causal_lm_suite

    lengths = _lengths(Workload("mix", batch=256, max_len=300, median_len=40), torch.Generator().manual_seed(0))
    assert min(lengths) == 16 and max(lengths) == 300 and 30 <= sorted(lengths)[128] <= 50  # clipped both ends; median near 40
    entry = get_entry("llama")
    workload = Workload("mix", dict(entry.spec.tiny), batch=4, max_len=48, median_len=20)
    suite = causal_lm_suite(entry, workload, backends=["eager", "sdpa", "varlen"], modes=("train",))
    suite.groups = [g for g in suite.groups if "train with labels" in g.name]
    report = run_suite(suite, warmup=0, iters=1, progress=False)
    packed = next(r for r in report.rows if r.label == "fastzoo packed (varlen), labels: fused loss")
    assert packed.status == "ok" and packed.max_err <= 1e-5 and packed.grad_err <= 1e-4
    bound = suite.config["FLOP-ratio bound (train, padded to longest ÷ packed)"]
    assert bound > 1 and packed.work_bound == pytest.approx(bound, rel=1e-3)


def test_benchmark_scripts_import():
    """benchmarks/run_all.py imports every per-suite script (gpt2_varlen, vit, giou, ...), so its
    --help fails when a script names something the bench package does not have."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "run_all.py"), "--help"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
