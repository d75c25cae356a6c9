"""The op-level low-precision check (fastzoo.equivalence.oplevel): every CPU kernel passes it, its
fp64 reference agrees with the eager backend's, and a 1 % scale error, which the model-level rule
passes in bf16, fails it and `fastzoo check --dtype bf16`."""
import math

import pytest
import torch

import fastzoo.attention
from fastzoo.attention.eager import EagerBackend
from fastzoo.attention.sdpa import SdpaBackend
from fastzoo.equivalence import oplevel

LOW = [torch.bfloat16, torch.float16]
CPU_BACKENDS = oplevel.cpu_backends()


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, options", CPU_BACKENDS, ids=[oplevel.backend_label(n, o) for n, o in CPU_BACKENDS])
def test_every_cpu_kernel_passes_on_every_case_it_serves(name, options, dtype):
    # seeds 0..1 (the check's), apart from the 10_000.. the bounds were measured on
    comps = oplevel.check_backend(name, options, dtype=dtype, draws=2)
    assert comps and all(c.passed for c in comps), [(c.name, c.err, c.bound, c.worst) for c in comps]


@pytest.mark.parametrize("case", oplevel.cases(EagerBackend.capabilities), ids=lambda c: c.name)
def test_reference_agrees_with_eager_in_fp64(case):
    # two writings of the contract (the reference's index arithmetic, attention.masks') on the same fp64 values:
    # equal up to fp64 rounding (1e-12 of outputs of size ~1)
    d = oplevel.draw(case, torch.bfloat16, seed=3)
    q, k, v = (x.double() for x in (d.q, d.k, d.v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    ref = oplevel.reference_attention(q, k, v, d.ctx)
    got = EagerBackend().forward(q, k, v, d.ctx)
    rows = d.real_BS[:, None, :, None].expand_as(ref)
    assert (got - ref)[rows].abs().max().item() < 1e-12


def _scaled(factor):
    class Scaled(SdpaBackend):
        def forward(self, q, k, v, ctx):
            return super().forward(q, k, v, ctx.replace(scale=(ctx.scale or q.shape[-1] ** -0.5) * factor))
    return Scaled


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
def test_a_one_percent_scale_error_fails(dtype):
    comps = oplevel.check_backend("sdpa", dtype=dtype, draws=1)
    assert all(c.passed for c in comps)
    backend = _scaled(1.01)()
    worst = max(oplevel._worst(oplevel.run_draw(backend, oplevel.draw(oplevel.Case(causal=True), dtype, 0), grads=True))
                .items(), key=lambda kv: kv[1][0] / oplevel.bounds("sdpa", dtype)[kv[0]])
    (q, st), (err, _) = worst
    assert err > oplevel.bounds("sdpa", dtype)[q, st]


def test_fastzoo_check_bf16_fails_a_kernel_with_a_one_percent_scale(monkeypatch, capsys):
    from fastzoo.cli import main

    monkeypatch.setitem(fastzoo.attention._REGISTRY, "sdpa_scaled", type("Scaled", (_scaled(1.01),), {"name": "sdpa_scaled"}))
    rc = main(["check", "gpt2", "--tiny", "--dtype", "bf16", "--attn", "sdpa_scaled"])
    out = capsys.readouterr().out
    assert rc == 1
    rows = [line for line in out.splitlines() if "attention op" in line]
    assert rows and any("FAIL" in r for r in rows), out
    # the model-level rows pass: only the op-level check sees a 1 % scale in bf16 on this tiny GPT-2
    assert all("pass" in line for line in out.splitlines() if "logits" in line), out


def test_bounds_are_measured_for_every_cpu_kernel():
    measured = oplevel._measured()
    assert measured["draws"] >= 40 and measured["threads"] == 1
    for name, opts in CPU_BACKENDS:
        for dt in LOW:
            b = oplevel.bounds(oplevel.backend_label(name, opts), dt)
            assert b and all(math.isfinite(v) and v > 0 for v in b.values())


def test_refuses_fp32():
    with pytest.raises(ValueError, match="dtype"):
        oplevel.check_backend("eager", dtype=torch.float32)


def test_a_backend_never_measured_gets_the_loosest_measured_bound():
    # a user's kernel, or any kernel on a GPU (not measured here): the worst CPU kernel's error is its allowance
    for dt in LOW:
        loosest = oplevel.bounds(None, dt)
        for name, opts in CPU_BACKENDS:
            own = oplevel.bounds(oplevel.backend_label(name, opts), dt)
            assert all(own[k] <= loosest[k] for k in own)
        assert oplevel.bounds("my_kernel", dt) == loosest
