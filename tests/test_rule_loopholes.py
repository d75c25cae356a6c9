"""The rule has no loopholes: NaN, +inf and -inf are told apart; a non-finite reference gradient
is compared where it is finite instead of excusing every gradient; a bf16 loss is compared; a
missing gradient fails; a backend's refusal counts as a refusal only where its declared
capabilities say it cannot serve the model (the fuzzing's properties judge with these)."""
import dataclasses
import math

import pytest
import torch
from conftest import TINY
from fuzzing import undeclared_refusal

import fastzoo
from fastzoo import equivalence
from fastzoo.attention.eager import EagerBackend
from fastzoo.errors import BackendUnavailableError

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("ours,ref", [(NAN, INF), (INF, -INF), (-INF, NAN), (1.0, NAN), (INF, 1.0)])
def test_nan_and_each_infinity_are_different_results(ours, ref):
    a, b = torch.tensor([0.5, ours, 2.0]), torch.tensor([0.5, ref, 2.0])
    assert equivalence.nonfinite_difference(a, b)
    assert not equivalence.compare_outputs_where_finite("logits", a, b).passed


def test_the_same_non_finite_values_at_the_same_places_compare_the_finite_rest():
    ref = torch.tensor([NAN, INF, -INF, 1.0])
    assert equivalence.compare_outputs_where_finite("logits", ref.clone(), ref).passed
    off = torch.tensor([NAN, INF, -INF, 1.01])
    assert not equivalence.compare_outputs_where_finite("logits", off, ref).passed


def test_a_non_finite_reference_gradient_does_not_excuse_the_others():
    ref = {"a": torch.tensor([1.0, NAN]), "b": torch.tensor([1.0, 2.0])}
    same = {"a": torch.tensor([1.0, NAN]), "b": torch.tensor([1.0, 2.0])}
    assert equivalence.compare_grads_where_finite("grads", same, ref).passed
    wrong_b = {"a": torch.tensor([1.0, NAN]), "b": torch.tensor([1.0, 2.5])}
    c = equivalence.compare_grads_where_finite("grads", wrong_b, ref)
    assert not c.passed and c.worst == "b"
    inf_for_nan = {"a": torch.tensor([1.0, INF]), "b": torch.tensor([1.0, 2.0])}
    assert not equivalence.compare_grads_where_finite("grads", inf_for_nan, ref).passed


def test_a_missing_gradient_fails():
    ref = {"a": torch.ones(2), "b": torch.ones(2)}
    c = equivalence.compare_grads("grads", {"a": torch.ones(2)}, ref)
    assert not c.passed and math.isinf(c.err)


def test_a_bf16_loss_is_compared_against_the_originals_own_error_plus_half_a_rounding_unit():
    """The original's own bf16 error on this loss is 0.004: the bound is 3 x 0.004 + half a bf16 unit
    of 5 (0.0195) = 0.0315; that error passes, a loss 1% off (0.05) fails, 1.6x the bound."""
    ref, peer = torch.tensor([5.0]), [torch.tensor([5.004])]
    assert equivalence.compare_loss("loss", torch.tensor([5.004]), ref, peer, dtype=torch.bfloat16).passed
    off = equivalence.compare_loss("loss", torch.tensor([5.05]), ref, peer, dtype=torch.bfloat16)
    assert not off.passed and off.bound == pytest.approx(3 * 0.004 + 5 * 2**-8 + equivalence.LOW_OUT_FLOOR, rel=1e-3)
    assert not equivalence.compare_loss("loss", torch.tensor([5.001]), ref).passed  # fp32: 1e-4


def test_an_fp32_bound_widens_by_the_originals_own_fp64_error_only():
    """The original's fp32 run is 1e-3 from its fp64 run: fastzoo 2e-3 from the fp32 run passes (within 3x
    the original's own error), 4.5e-3 from it and 3.5e-3 from the fp64 run fails; without the fp64 run, or
    where it is not finite, the fixed 1e-4 holds. Gradients likewise, relative to their scale."""
    ref, exact = torch.tensor([1.0, 2.0]), torch.tensor([1.001, 2.0], dtype=torch.float64)
    assert equivalence.compare_outputs("logits", torch.tensor([0.998, 2.0]), ref, exact=exact).passed
    assert not equivalence.compare_outputs("logits", torch.tensor([1.0045, 2.0]), ref, exact=exact).passed
    assert not equivalence.compare_outputs("logits", torch.tensor([0.998, 2.0]), ref).passed
    assert not equivalence.compare_outputs("logits", torch.tensor([0.998, 2.0]), ref,
                                           exact=torch.tensor([NAN, 2.0], dtype=torch.float64)).passed
    g = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.01, 0.0])}
    e = {"a": torch.tensor([1.0, 0.0], dtype=torch.float64), "b": torch.tensor([0.0102, 0.0], dtype=torch.float64)}
    assert equivalence.compare_grads("grads", {"a": g["a"], "b": torch.tensor([0.0105, 0.0])}, g, exact=e).passed
    c = equivalence.compare_grads("grads", {"a": g["a"], "b": torch.tensor([0.0110, 0.0])}, g, exact=e)
    # own error 2e-4 / 0.0102 = 0.020 of b's scale: 5e-4 / 0.01 = 0.05 passes; 0.1 (and 0.078 from fp64) fails
    assert not c.passed and c.worst == "b"


def test_where_the_originals_low_precision_runs_give_another_kind_fastzoo_gives_one_of_theirs():
    """An overflow whose sign is a logit's rounding: +inf in the original's fp32 run, -inf in its bf16 run.
    There fastzoo may give either infinity, not a NaN or a finite value; everywhere else the kinds and the
    values are held as before."""
    ref, peer = torch.tensor([INF, 1.0, -INF]), [torch.tensor([-INF, 1.0, -INF])]
    assert equivalence.compare_outputs_where_finite("logits", torch.tensor([-INF, 1.0, -INF]), ref, peer).passed
    assert equivalence.compare_outputs_where_finite("logits", torch.tensor([INF, 1.0, -INF]), ref, peer).passed
    for wrong in ([NAN, 1.0, -INF], [5.0, 1.0, -INF], [INF, 1.0, INF], [INF, 1.5, -INF]):
        assert not equivalence.compare_outputs_where_finite("logits", torch.tensor(wrong), ref, peer).passed, wrong
    g_ref, g_peer = {"w": ref}, [{"w": peer[0]}]
    assert equivalence.compare_grads_where_finite("grads", {"w": torch.tensor([-INF, 1.0, -INF])}, g_ref, g_peer).passed
    assert not equivalence.compare_grads_where_finite("grads", {"w": torch.tensor([NAN, 1.0, -INF])}, g_ref, g_peer).passed


class _RefusesCausal(EagerBackend):
    """Declares eager's capabilities (causal masking included) but refuses every causal model."""

    def problems(self, req):
        return super().problems(req) + (["refuses the causal masking it declares"] if req.causal else [])


@pytest.fixture
def registry(monkeypatch):
    """Backends registered by a test, gone after it."""
    import fastzoo.attention as attention

    monkeypatch.setattr(attention, "_REGISTRY", dict(attention._REGISTRY))
    return attention


def test_a_refusal_the_declared_capabilities_do_not_explain_is_a_failure(registry):
    registry.register_attention("refuses_declared", _RefusesCausal)
    registry.register_attention("declares_no_causal", EagerBackend,
                                capabilities=dataclasses.replace(EagerBackend.capabilities, causal=False))
    model = fastzoo.create("gpt2", attn="eager", **TINY["gpt2"])
    with pytest.raises(BackendUnavailableError) as e:
        model.set_attention("refuses_declared")
    assert "declared capabilities serve the model" in undeclared_refusal(model, "refuses_declared", {}, e.value)
    with pytest.raises(BackendUnavailableError) as e:  # its capabilities lack causal masking: a refusal
        model.set_attention("declares_no_causal")
    assert undeclared_refusal(model, "declares_no_causal", {}, e.value) == ""
