"""GPT-2 under Hugging Face's model ids (gpt2 ... gpt2-xl), also spelled openai-community/<id> and
with underscores; no hub is contacted: the name picks the architecture. That each name is
Hugging Face's network (full-size parameters, one layer against transformers) is
tests/test_registry.py's check of every name."""
import fastzoo
from fastzoo.registry import get_entry, specs

GPT2 = [v for s in specs() if s.family == "gpt2" for v in s.variants if v.name.startswith("gpt2")]


def test_the_family_has_hugging_faces_names():
    assert [v.name for v in GPT2] == ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
    for v in GPT2:
        assert f"openai-community/{v.name}" in v.aliases
        for spelling in (v.name, *v.aliases):
            assert get_entry(spelling).name == v.name
    assert get_entry("gpt2_medium").name == "gpt2-medium"  # the short spelling stays
    assert fastzoo.list_models("openai-community/*") == sorted(f"openai-community/{v.name}" for v in GPT2)
    assert [fastzoo.create(v.name, device="meta").config.n_embd for v in GPT2] == [768, 1024, 1280, 1600]
