"""The machine's limits (fastzoo.bench.limits) and the harness's limit columns: the arithmetic
only; nothing here is timed against a threshold."""
import json

import pytest
import torch

from fastzoo.bench import limits as L
from fastzoo.bench.harness import Case, Group, Step, Suite, run_suite

# A hand-written Limits (nothing measured): the round numbers make every share easy to check.
FAKE = L.Limits(device="cpu", threads=2, gemm_flops={"fp32": 200e9, "bf16": 400e9}, gemm_size=1024,
                copy_bytes_per_s=50e9, copy_large_bytes=64 * 2**20, copy_cached_bytes_per_s=160e9,
                copy_cached_bytes=512 * 2**10, bf16_units=["AMX"])


def test_share_rate_and_gemm_flop_count():
    assert L.share(97e9, 194e9) == 0.5
    assert L.rate(6e9, 2.0) == 3e9
    assert L.gemm_flop_count(2, 3, 4) == 48  # one multiply and one add per term of [2,4] @ [4,3]
    for bad in ((1.0, 0.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="limit"):
            L.share(*bad)
    with pytest.raises(ValueError, match="seconds"):
        L.rate(1.0, 0.0)


def test_op_floor_is_the_larger_of_bytes_over_bandwidth_and_the_autograd_call():
    assert L.op_floor(5e6, 50e9, 170e-6) == 170e-6  # 5 MB at 50 GB/s is 100 us: the autograd call bounds it
    assert L.op_floor(50e6, 50e9, 170e-6) == pytest.approx(1e-3)  # 50 MB: 1 ms of streaming bounds it
    with pytest.raises(ValueError, match="bandwidth"):
        L.op_floor(1.0, 0.0, 0.0)


def test_si_prefixes():
    assert L.si(194e9, "FLOP/s") == "194 GFLOP/s"
    assert L.si(1.38e12, "FLOP/s") == "1.38 TFLOP/s"
    assert L.si(49.2e9, "B/s") == "49.2 GB/s"
    assert L.si(12.0, "B/s") == "12 B/s"


@pytest.mark.parametrize("flags, units", [
    ("fpu sse avx512f avx512_bf16 amx_bf16 amx_tile", ["AMX", "AVX512-BF16"]),
    ("fpu sse avx2 avx512f avx512_vnni", []),
])
def test_bf16_units_are_read_from_the_cpu_flags(flags, units):
    cpuinfo = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert L.cpu_bf16_units(cpuinfo) == units


def test_limits_lookup_and_description():
    assert FAKE.gemm_peak(torch.float32) == 200e9 and FAKE.gemm_peak(torch.bfloat16) == 400e9
    assert FAKE.gemm_peak(torch.float16) is None  # not measured: no share reported
    text = FAKE.describe()
    for part in ("2 threads", "fp32 200 GFLOP/s", "bf16 400 GFLOP/s", "AMX", "50 GB/s", "160 GB/s in cache"):
        assert part in text
    assert L.Limits(**json.loads(json.dumps(FAKE.to_dict()))) == FAKE  # a report's JSON gives it back


def test_autograd_floor_step_is_clone_times_other_sum_and_backward():
    x, other = torch.randn(3, 4), torch.randn(3, 4)
    step = L.autograd_floor_step(x, other)
    loss = step()
    assert torch.equal(loss, (x * other).sum())
    loss2 = step()  # the gradient is reset each step, not accumulated
    assert torch.equal(loss2, loss)


def test_harness_sets_each_row_beside_the_floor_and_the_limits():
    """Every timed row: time ÷ the floor row's time, FLOP/s ÷ the GEMM peak of the group's dtype,
    bytes/s ÷ the copy bandwidth -- from the medians the harness measured, whatever they are."""
    def step(flops=None, nbytes=None):
        return lambda: Step(run=lambda: torch.ones(8).sum(), items=8, flops=flops, bytes=nbytes)

    cases = [Case("peer", step(4e6, 1e6), peer=True), Case("ours", step(4e6, 1e6)),
             Case("floor", step(nbytes=1e6), floor=True)]
    suite = Suite("limits", [Group("g", cases, unit="items/s")], limits=FAKE, interleave=True)
    report = run_suite(suite, warmup=0, iters=3, progress=False)
    peer, ours, floor = report.rows
    assert floor.floor and floor.vs_floor == 1.0
    for r in (peer, ours):
        assert r.vs_floor == pytest.approx(r.median_s / floor.median_s)
        assert r.flop_share == pytest.approx(4e6 / r.median_s / 200e9)
        assert r.bandwidth_share == pytest.approx(1e6 / r.median_s / 50e9)
    assert floor.flop_share is None  # the floor declares no FLOPs
    assert report.limits == FAKE.to_dict()
    text = report.to_markdown()
    assert "Limits: same-run limits" in text and "time ÷ floor" in text and "share of GEMM peak" in text


def test_reports_without_limits_keep_their_columns():
    suite = Suite("plain", [Group("g", [Case("a", lambda: Step(run=lambda: None, items=1), peer=True)])])
    table = run_suite(suite, warmup=0, iters=1, progress=False).table()
    assert "floor" not in table and "share of" not in table
