"""The mutation suite (fastzoo.equivalence.mutants), fast profile: every mutant once through the public
checks (fp32 equivalence.check with and without gradients; a kernel mutant also through the op-level
check in bf16), each killed, i.e. its worst comparison past its bound, where the same check without
the mutant passes. A survivor fails here unless its catalogue entry says why it is not a bug."""
import pytest

from fastzoo.attention.base import AttentionBackend
from fastzoo.equivalence import mutants
from fastzoo.equivalence.check import tiny_overrides
from fastzoo.layers.layer_scale import LayerScale
from fastzoo.layers.norm import RMSNorm


def test_catalogue():
    names = [m.name for m in mutants.CATALOGUE]
    assert len(names) >= 15 and len(set(names)) == len(names)
    for m in mutants.CATALOGUE:
        assert m.models and set(m.models) <= set(mutants.MODELS), m.name
        assert (m.feature is not None) == (m.kernel and m.name != "attention_scale_x1.01"), m.name
    for label, (name, overrides) in mutants.MODELS.items():
        tiny_overrides(name)  # every model has an original to check against


@pytest.mark.parametrize("mutant", mutants.CATALOGUE, ids=lambda m: m.name)
def test_fast_profile_kills(mutant):
    rows = mutants.run(long=False, only=(mutant.name,))
    assert rows
    for r in rows:
        assert r.killed is not None, f"{r.check} on {r.family} {r.backend}: not judged ({r.note})"
    if mutant.kernel:  # the op-level check kills every kernel mutant in bf16
        assert [r.killed for r in rows if r.check == "op-level"] == [True]
    survivors = [r for r in rows if not r.killed and not r.note.startswith("FINDING")]
    assert not survivors or all(r.note for r in survivors), [(r.check, r.family, r.dtype, r.margin) for r in survivors]
    findings = [(r.check, r.family, r.dtype, r.margin) for r in rows if not r.killed and r.note.startswith("FINDING")]
    assert not findings, findings  # the fast profile's rows are all killed or explained as not bugs
    assert all(r.killed or r.note for r in rows)


def test_patches_are_undone():
    before = (AttentionBackend.__call__, mutants.check_module.create, LayerScale.forward, RMSNorm.forward)
    for m in mutants.CATALOGUE:
        with m.applied():
            pass
    assert (AttentionBackend.__call__, mutants.check_module.create, LayerScale.forward, RMSNorm.forward) == before
    assert "forward" not in LayerScale.__dict__ or LayerScale.__dict__["forward"] is before[2]


def test_a_backend_that_never_serves_the_feature_is_not_judged():
    softcap = next(m for m in mutants.CATALOGUE if m.name == "softcap_x1.05")
    cache = {}
    row = mutants._row(softcap, "op-level", mutants.torch.bfloat16, ("sdpa", {}), "op-level",
                       mutants._op_check(("sdpa", {}), mutants.torch.bfloat16), cache)
    assert row.killed is None and "serves no softcap case" in row.note
