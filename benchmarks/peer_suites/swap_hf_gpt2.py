"""pytest plugin: Hugging Face's own GPT-2 model tests with fastzoo's GPT-2 in the place of
``transformers.GPT2LMHeadModel``, as a new user would swap it in.

The swap is the two lines a user changes, nothing else:

- ``GPT2LMHeadModel(config)`` -> ``fastzoo.create("gpt2", **fields)``: the fields of the
  ``transformers.GPT2Config`` that fastzoo's config has (same names), and the attention
  backend named by ``config._attn_implementation`` (``eager`` / ``sdpa`` / ``flex_attention`` /
  ``flash_attention_2``; unset: fastzoo's default). A config field that changes the function
  and that fastzoo has no field for (cross-attention, ``reorder_and_upcast_attn``) raises
  :class:`NotProvidedByFastzoo` rather than being dropped; the rest of HF's config (ids of
  the heads fastzoo does not have, bookkeeping) is not read, as a user would not pass it.
  ``tie_word_embeddings``: HF's causal-LM tester sets it False for every test; fastzoo's GPT-2
  always ties its head (as every GPT-2 checkpoint does), so the model built is the tied one
  and the tests about an untied head fail (listed as such in the results).
- ``GPT2LMHeadModel.from_pretrained(path, **kw)`` -> ``fastzoo.create("gpt2", pretrained=path)``
  (``attn_implementation`` and ``dtype`` mapped to fastzoo's ``attn`` / ``dtype``; anything else
  is passed on and fastzoo refuses what it does not know).

Every other attribute of the swapped class is fastzoo's own class's (``forward``'s signature,
``can_generate``, ``main_input_name`` ...). Classes fastzoo does not provide (``GPT2Model``,
``GPT2DoubleHeadsModel``, ``GPT2For*``) are replaced by stand-ins that raise
:class:`NotProvidedByFastzoo` when built; the test class's ``all_model_classes`` is the
swapped ``GPT2LMHeadModel`` alone. Test bodies and assertions are not touched. The swap is made
only with ``PEER_SUITE_SWAP=1`` (``run.py`` runs the same selection without it as the baseline).
What this and ``swap_hf_llama.py`` share is ``hf_swap.py``.
"""
from __future__ import annotations

from hf_swap import NotProvidedByFastzoo, _attn_of, stand_in, swap_when_collected
from hf_swap import swap as _swap

_TEST_MODULE = "tests.models.gpt2.test_modeling_gpt2"
_NOT_PROVIDED = ("GPT2Model", "GPT2DoubleHeadsModel", "GPT2ForQuestionAnswering",
                 "GPT2ForSequenceClassification", "GPT2ForTokenClassification")


def _function_fields_fastzoo_lacks(config) -> list[str]:
    """HF config values that change the model's function and that fastzoo cannot express."""
    lacks = []
    if getattr(config, "add_cross_attention", False):
        lacks.append("add_cross_attention=True")
    if getattr(config, "reorder_and_upcast_attn", False):
        lacks.append("reorder_and_upcast_attn=True")
    if getattr(config, "is_encoder_decoder", False):
        lacks.append("is_encoder_decoder=True")
    return lacks


def build_fastzoo_gpt2(config, **create_kwargs):
    """``fastzoo.create("gpt2", ...)`` from a ``transformers.GPT2Config``."""
    import dataclasses

    import fastzoo
    from fastzoo.models.decoder import GPT2Config

    lacks = _function_fields_fastzoo_lacks(config)
    if lacks:
        raise NotProvidedByFastzoo(f"fastzoo's GPT-2 has no {', '.join(lacks)}")
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(GPT2Config) if hasattr(config, f.name)}
    return fastzoo.create("gpt2", **{**_attn_of(config), **create_kwargs}, **fields)


def _fastzoo_gpt2():
    from fastzoo.models.decoder import GPT2LMHeadModel

    return GPT2LMHeadModel


FastzooGPT2LMHeadModel = stand_in("GPT2LMHeadModel", build_fastzoo_gpt2, _fastzoo_gpt2, "gpt2")


def swap(module) -> None:
    _swap(module, "GPT2", FastzooGPT2LMHeadModel, _NOT_PROVIDED)


pytest_collection_finish = swap_when_collected(_TEST_MODULE, "tests/models/gpt2/test_modeling_gpt2.py", swap)
