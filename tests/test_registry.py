"""The registry as users meet it: every name builds, at full size, the network of its original.

Each registered name (and alias) is built on the meta device (no memory) and its parameter
count compared with the original library's model built from the same variant config, also on
meta. A variant whose sizes were typed wrong fails here without a download or a big allocation.
"""
import pytest
import torch

import fastzoo
from fastzoo.errors import UnknownModelError
from fastzoo.registry import get_entry, specs


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


WITH_ORIGINAL = [n for n in fastzoo.list_models() if get_entry(n).spec.original is not None]


@pytest.mark.parametrize("name", WITH_ORIGINAL)
def test_full_size_parameter_count_equals_the_original(name):
    entry = get_entry(name)
    ours = fastzoo.create(name, device="meta")
    with torch.device("meta"):
        ref = entry.spec.original.build(entry.config)
    assert _count(ours) == _count(ref) > 0


def test_every_name_and_alias_is_listed_once_and_resolves_to_its_variant():
    names = fastzoo.list_models()
    assert len(names) == len(set(names))
    for spec in specs():
        for variant in spec.variants:
            for name in (variant.name, *variant.aliases):
                assert name in names
                assert get_entry(name).variant is variant


def test_list_models_filters_with_wildcards_like_timm():
    assert fastzoo.list_models("gpt2*") == [n for n in fastzoo.list_models() if n.startswith("gpt2")]
    assert fastzoo.list_models("no_such_model*") == []


def test_an_alias_builds_the_canonical_variant():
    spec = next(s for s in specs() if any(v.aliases for v in s.variants))
    variant = next(v for v in spec.variants if v.aliases)
    model = fastzoo.create(variant.aliases[0], device="meta")
    assert model.model_name == variant.name


def test_unknown_name_suggests_the_closest_names():
    with pytest.raises(UnknownModelError, match="distilgpt2"):
        fastzoo.create("distilgpt")


def _one_per_shallow_config(names: list[str]) -> list[str]:
    """Names whose reduced configs are equal build the same network there: one of them is checked."""
    seen = {}
    for name in names:
        entry = get_entry(name)
        seen.setdefault((entry.spec.family, repr(sorted(entry.spec.shallow(entry.config).items()))), name)
    return list(seen.values())


SHALLOW = _one_per_shallow_config(
    [n for n in WITH_ORIGINAL if get_entry(n).spec.shallow is not None and n == get_entry(n).name])


@pytest.mark.parametrize("name", SHALLOW)
def test_every_name_at_reduced_depth_equals_its_original(name):
    """Same widths, one block: logits and gradients against the original on the same weights,
    the fp32 rule of fastzoo.equivalence (logits 1e-4 absolute, gradients 1e-4 relative)."""
    from fastzoo.equivalence import check

    entry = get_entry(name)
    shallow = entry.spec.shallow(entry.config)
    result = check(name, "eager", overrides={k: v for k, v in shallow.items()}, batch=1)
    assert result.passed, result.rows()
    assert {c.name.split(" ")[0] for c in result.comparisons} >= {"logits", "grads"}
