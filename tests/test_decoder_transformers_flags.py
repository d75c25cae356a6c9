"""What transformers' code reads of a causal LM besides its forward, on fastzoo's decoders, and
each of it true: the class flags (``_supports_sdpa``, ``_can_compile_fullgraph`` ...) that
transformers' own model tests read to decide what to run, ``config._attn_implementation`` and
``set_attn_implementation`` (SDPA dispatch by transformers' names), a static cache in
``generate`` (token for token HF's), the forward captured whole by ``torch.compile``, the legacy
``gradient_checkpointing`` config field honoured; and what is refused, by name: a 4-D
``attention_mask``, ``generate``'s own compilation (``compile_config``)."""
import json

import pytest
import torch
import transformers
from transformers import DynamicCache, StaticCache

import fastzoo
from fastzoo import equivalence
from fastzoo.models.decoder.generation import HF_ATTENTION, CausalLMConventions

TOL = equivalence.FP32_OUT_ATOL  # DESIGN.md: fp32 CPU, same weights (1e-4)
V = 64


def hf_llama(**kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


def hf_gpt2(**kw):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    return transformers.GPT2LMHeadModel(cfg).eval()


ORIGINALS = {"llama": hf_llama, "gpt2": hf_gpt2}


def left_padded():
    ids = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return ids, mask


def test_declared_flags_are_the_ones_transformers_reads():
    # each is read by transformers' test mixins (and generate) to decide what to run on a class
    for flag in ("_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn", "_supports_attention_backend",
                 "_can_compile_fullgraph"):
        assert getattr(CausalLMConventions, flag) is True, flag
        assert isinstance(getattr(transformers.PreTrainedModel, flag), bool)  # the name transformers uses
    assert CausalLMConventions._can_set_attn_implementation()
    assert set(HF_ATTENTION.values()) <= set(fastzoo.list_attention())  # each name maps to a real backend


@pytest.mark.parametrize("family", list(ORIGINALS))
def test_config_attn_implementation_names_the_backend_in_transformers_words(family):
    hf = ORIGINALS[family]()
    m = fastzoo.create(family, pretrained=hf)
    assert m.config._attn_implementation == "sdpa"  # fastzoo's default, as transformers' default on torch >= 2.1
    m.set_attn_implementation("eager")
    assert m.attn_name == "eager" and m.config._attn_implementation == "eager"
    m.set_attn_implementation({"": "flex_attention"})
    assert m.attn_name == "flex" and m.config._attn_implementation == "flex_attention"
    m.set_attention("varlen")  # a fastzoo backend transformers has no name for keeps fastzoo's
    assert m.config._attn_implementation == "varlen"
    with pytest.raises(ValueError, match='Specified `attn_implementation="foo"` is not supported'):
        m.set_attn_implementation("foo")
    assert m.attn_name == "varlen"  # nothing changed


@pytest.mark.parametrize("family", list(ORIGINALS))
def test_static_cache_generate_equals_transformers_token_for_token(family):
    hf = ORIGINALS[family]()
    m = fastzoo.create(family, pretrained=hf, attn="sdpa")
    ids, mask = left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    ref = hf.generate(ids, **kw)
    out = m.generate(ids, **kw, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert isinstance(out.past_key_values, StaticCache)
    # and the same tokens as fastzoo's default DynamicCache
    assert torch.equal(m.generate(ids, **{**kw, "cache_implementation": None}), ref)


def test_static_cache_forward_reads_the_written_keys_only():
    """A forward with a StaticCache gives the logits of one without a cache (fp32, 1e-4)."""
    hf = hf_llama()
    m = fastzoo.create("llama", pretrained=hf, attn="eager")
    ids, _ = left_padded()
    cache = StaticCache(config=hf.config, max_cache_len=16)
    first = m(ids[:, :4], past_key_values=cache, use_cache=True).logits
    second = m(ids[:, 4:], past_key_values=cache, use_cache=True).logits
    full = m(ids, use_cache=False).logits
    assert (torch.cat([first, second], 1) - full).abs().max() <= TOL


def test_the_text_config_sizes_a_static_cache_as_transformers_config_does():
    """``config.get_text_config()`` is what transformers' tests and PEFT read a cache's shape from
    (``getattr(config, "head_dim", hidden_size // num_attention_heads)``): its head_dim is the number,
    where the config keeps None for the default (a config made with another width gets its own)."""
    import dataclasses

    hf = hf_llama()
    m = fastzoo.create("llama", pretrained=hf, attn="eager")
    text = m.config.get_text_config(decoder=True)
    assert m.config.head_dim is None and text.head_dim == hf.config.head_dim == 8
    assert text.hidden_size == 32 and text.vocab_size == V
    text.use_cache = False  # set through to the config
    assert m.config.use_cache is False
    assert dataclasses.replace(m.config, hidden_size=64).get_text_config().head_dim == 16
    cache = StaticCache(config=text, max_cache_len=16)  # as PEFT builds one from the text config
    ids, _ = left_padded()
    first = m(ids[:, :4], past_key_values=cache, use_cache=True).logits
    assert cache.layers[0].keys.shape[-1] == 8
    assert (first - m(ids[:, :4], use_cache=False).logits).abs().max() <= TOL


def test_forward_is_captured_whole_by_torch_compile():
    """``_can_compile_fullgraph``: no graph break (fullgraph=True raises on one), eager's values."""
    m = fastzoo.create("llama", pretrained=hf_llama(), attn="sdpa")
    ids, mask = left_padded()
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="eager")  # graph capture is what is tested
    with torch.no_grad():
        got, ref = compiled(ids, attention_mask=mask).logits, m(ids, attention_mask=mask).logits
    assert (got - ref)[mask.bool()].abs().max() <= TOL


def test_generate_refuses_its_own_compilation_by_name():
    m = fastzoo.create("llama", pretrained=hf_llama())
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="compile_config"):
        m.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="static", pad_token_id=0,
                   compile_config=transformers.CompileConfig())


def test_a_4d_attention_mask_is_refused_by_name():
    m = fastzoo.create("llama", pretrained=hf_llama())
    ids, _ = left_padded()
    with pytest.raises(ValueError, match="attention_mask: a 4-D mask"):
        m(ids, attention_mask=torch.ones(2, 1, 6, 6))


@pytest.mark.parametrize("layout,attn", [("mistral", "sdpa"), ("gemma2", "eager")])
def test_static_cache_with_sliding_window_layers_generates_transformers_tokens(layout, attn):
    """A window (4) shorter than prompt + new tokens (Mistral: every layer; Gemma 2: alternating,
    with soft-capping): the static cache's sliding layers keep the last keys only; the same tokens
    as transformers'."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(layout, vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                            pad_token_id=0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    m = fastzoo.create(layout, pretrained=hf, attn=attn)
    ids, mask = left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(m.generate(ids, **kw), hf.generate(ids, **kw))


@pytest.mark.parametrize("family", list(ORIGINALS))
def test_legacy_gradient_checkpointing_field_is_honoured(family, tmp_path):
    """transformers turns ``config.gradient_checkpointing=True`` (older checkpoints' config.json
    carry it) into gradient checkpointing at construction; so does fastzoo, from a config.json
    or the keyword, and a model built without it has none."""
    hf = ORIGINALS[family]()
    hf.save_pretrained(tmp_path)
    assert not fastzoo.create(family, pretrained=tmp_path).is_gradient_checkpointing
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "gradient_checkpointing": True}))
    for m in (fastzoo.create(family, pretrained=tmp_path), fastzoo.create(family, pretrained=hf, gradient_checkpointing=True)):
        assert m.is_gradient_checkpointing and m.body.checkpoint_kwargs is not None
    m.train()
    ids, _ = left_padded()
    m(ids, labels=ids).loss.backward()  # recomputed in the backward: every gradient is there
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
