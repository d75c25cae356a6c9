"""The mutation suite (fastzoo.equivalence.mutants), fast profile: every mutant once through the public
checks (fp32 equivalence.check with and without gradients; a kernel mutant also through the op-level
check in bf16), each killed, i.e. its worst comparison past its bound, where the same check without
the mutant passes. No mutant's first model is one where it is an equivalent mutant, so every row is killed."""
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
    # fp32 (every row of the fast profile): killed, or an equivalent mutant on that model (none is its first)
    survivors = [(r.check, r.family, r.dtype, r.margin, r.note) for r in rows if not r.killed]
    assert not survivors, survivors


def test_equivalent_mutants_are_counted_apart():
    """A survivor that the catalogue calls an equivalent mutant (Llama's rotary positions shifted by one)
    is counted apart from the judged rows; any other survivor is a survivor."""
    shift = next(m for m in mutants.CATALOGUE if m.name == "packed_position_ids_off_by_one")
    rows = [mutants.Row(shift.name, "llama", "fp32", "sdpa", "check train", False, 0.09,
                        note=mutants.survivor_note(shift, "llama", "fp32")),
            mutants.Row(shift.name, "gpt2", "fp32", "sdpa", "check train", False, 0.5,
                        note=mutants.survivor_note(shift, "gpt2", "fp32")),
            mutants.Row(shift.name, "gpt2", "fp32", "eager", "check train", True, 9.0)]
    fp32 = mutants.summary(rows)["fp32"]
    assert fp32["judged"] == 2 and fp32["killed"] == 1
    assert fp32["survivors"] == {"packed_position_ids_off_by_one on gpt2": {"rows": 1, "kind": "UNEXPLAINED"}}
    assert fp32["equivalent (not judged)"] == {"packed_position_ids_off_by_one on llama": 1}


def test_a_kernel_mutant_that_changes_no_call_is_not_judged():
    """An inverted key-padding mask on a packed-only backend (GPT-2 unpads its padded batch: no call carries
    a mask): nothing changed, so the row is not judged rather than a survivor."""
    padding = next(m for m in mutants.CATALOGUE if m.name == "padding_mask_inverted")
    row = mutants._row(padding, "gpt2", mutants.torch.float32, ("varlen", {}), "check train",
                       mutants._check_fn(padding, "gpt2", mutants.torch.float32, ("varlen", {}), "check train"), {})
    assert row.killed is None and row.note.startswith("not reached"), row


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
