"""Every GPT-2 name (Hugging Face's model ids gpt2 ... gpt2-xl, also as openai-community/<id> and
the underscore spellings) is Hugging Face's network: at one layer with the real widths, the same
logits and gradients as transformers' GPT2LMHeadModel on the same weights (padded and packed);
at full size, the same parameters on the meta device. No hub is contacted: the name picks the
architecture."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import fastzoo
from fastzoo.equivalence import check
from fastzoo.registry import get_entry, specs

VARIANTS = [v for s in specs() if s.family == "gpt2" for v in s.variants]
NAMES = [v.name for v in VARIANTS]
# one layer at the variant's width and heads; vocabulary, positions and special tokens shrink
# (they size embeddings, not the function of a layer)
ONE_LAYER = dict(n_layer=1, vocab_size=96, n_positions=64, bos_token_id=None, eos_token_id=None)


def test_the_family_has_hugging_faces_names():
    assert NAMES == ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
    for v in VARIANTS:
        assert f"openai-community/{v.name}" in v.aliases
        for spelling in (v.name, *v.aliases):
            assert get_entry(spelling).name == v.name
    assert get_entry("gpt2_medium").name == "gpt2-medium"  # the short spelling stays
    assert fastzoo.list_models("openai-community/*") == [f"openai-community/{n}" for n in sorted(NAMES)]


@pytest.mark.parametrize("name", NAMES)
def test_equals_hugging_face_at_one_layer(name):
    """fastzoo.equivalence's fp32 rule (logits within 1e-4, gradients within 1e-4 relative),
    padded batch and the same sequences packed, eager attention."""
    result = check(name, "eager", overrides=ONE_LAYER)
    assert [c.name for c in result.comparisons] == ["logits (padded)", "grads (padded)", "logits (packed)", "grads (packed)"]
    for c in result.comparisons:
        assert c.passed, f"{name} {c.name}: {c.err:.3g} > {c.bound:g} ({c.worst})"


@pytest.mark.parametrize("name", NAMES)
def test_full_size_has_hugging_faces_parameters(name):
    """Counted on the meta device (nothing allocated); HF ties lm_head to wte, as fastzoo does."""
    ours = fastzoo.create(f"openai-community/{name}", device="meta")
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(**get_entry(name).config))
    assert ours.config.n_embd == hf.config.n_embd and ours.config.n_layer == hf.config.n_layer
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
