"""pytest plugin: Hugging Face's own model tests of the Llama layouts (``llama``, ``qwen2``,
``mistral``) with fastzoo's decoder in the place of transformers' ``<Layout>ForCausalLM``, as a
new user would swap it in.

The swap is the user's two lines, as for GPT-2 (``swap_hf_gpt2.py``; both are built on ``hf_swap.py``):
``LlamaForCausalLM(config)`` -> ``fastzoo.create(config.model_type, **fields)`` with the fields
fastzoo reads from a transformers config (the converter's own reading: rotary parameters,
windows, biases; a field fastzoo does not reproduce is refused by name) and the attention
backend named by ``config._attn_implementation``; ``LlamaForCausalLM.from_pretrained(path)`` ->
``fastzoo.create("llama", pretrained=path)``. Classes fastzoo does not provide (``LlamaModel``,
``LlamaFor{SequenceClassification,QuestionAnswering,TokenClassification}``) are stand-ins that
raise :class:`NotProvidedByFastzoo` when built; the test class's ``all_model_classes`` is the
swapped causal LM alone. Test bodies and assertions are not touched. The swap is made only
with ``PEER_SUITE_SWAP=1``, on whichever of the layouts' test modules pytest collected.
"""
from __future__ import annotations

import os
import sys

from hf_swap import _attn_of, stand_in
from hf_swap import swap as _swap

# transformers' model_type -> the class-name prefix of its test module and classes
LAYOUTS = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}
_OTHER_CLASSES = ("Model", "ForQuestionAnswering", "ForSequenceClassification", "ForTokenClassification")


def build_fastzoo_llama(config, **create_kwargs):
    """``fastzoo.create(<model_type>, ...)`` from a transformers config of a Llama layout."""
    import fastzoo
    from fastzoo.models.decoder.convert import LLAMA

    fields = LLAMA.config_from_json(config.to_dict())
    return fastzoo.create(fields["model_type"], **{**_attn_of(config), **create_kwargs}, **fields)


def _fastzoo_llama():
    from fastzoo.models.decoder.llama import LlamaForCausalLM

    return LlamaForCausalLM


def swapped_class(model_type: str) -> type:
    """The class standing where the tests name ``<Layout>ForCausalLM``."""
    prefix = LAYOUTS[model_type]
    return stand_in(f"{prefix}ForCausalLM", build_fastzoo_llama, _fastzoo_llama, model_type)


FastzooLlamaForCausalLM = swapped_class("llama")


def swap(module, model_type: str) -> None:
    prefix = LAYOUTS[model_type]
    swapped = FastzooLlamaForCausalLM if model_type == "llama" else swapped_class(model_type)
    test = _swap(module, prefix, swapped, tuple(prefix + suffix for suffix in _OTHER_CLASSES))
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout (see run.py)
    test._torch_compile_train_cls = swapped


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":
        return
    found = [t for t in LAYOUTS if f"tests.models.{t}.test_modeling_{t}" in sys.modules]
    if len(found) != 1:
        raise RuntimeError(f"run pytest on one of tests/models/{{{','.join(LAYOUTS)}}}/test_modeling_*.py (collected: {found})")
    swap(sys.modules[f"tests.models.{found[0]}.test_modeling_{found[0]}"], found[0])
