"""pytest plugin: Hugging Face's own model tests of the Llama-style layouts (``llama``, ``qwen2``,
``mistral``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``phi3``, ``olmo2``, ``smollm3``, ``granite``) with fastzoo's decoder in the place of transformers' ``<Layout>ForCausalLM``, as a
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

# transformers' model_type -> (its test module's folder, the prefix of its test classes, its causal LM class)
LAYOUTS = {
    "llama": ("llama", "Llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2", "Qwen2ForCausalLM"),
    "mistral": ("mistral", "Mistral", "MistralForCausalLM"), "qwen3": ("qwen3", "Qwen3", "Qwen3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2", "Gemma2ForCausalLM"), "gemma3_text": ("gemma3", "Gemma3Text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3", "Phi3ForCausalLM"), "olmo2": ("olmo2", "Olmo2", "Olmo2ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3", "SmolLM3ForCausalLM"), "granite": ("granite", "Granite", "GraniteForCausalLM"),
}


def test_module(model_type: str) -> str:
    folder = LAYOUTS[model_type][0]
    return f"tests.models.{folder}.test_modeling_{folder}"


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
    """The class standing where the tests name the layout's causal LM (``LlamaForCausalLM`` ...)."""
    return stand_in(LAYOUTS[model_type][2], build_fastzoo_llama, _fastzoo_llama, model_type)


FastzooLlamaForCausalLM = swapped_class("llama")


def swap(module, model_type: str) -> None:
    """Every other transformers model class the test module names (the base model, the other
    heads, a multimodal model) becomes a refusing stand-in."""
    from transformers import PreTrainedModel

    _, prefix, causal = LAYOUTS[model_type]
    swapped = FastzooLlamaForCausalLM if model_type == "llama" else swapped_class(model_type)
    others = tuple(n for n, v in vars(module).items()
                   if isinstance(v, type) and issubclass(v, PreTrainedModel) and n != causal)
    test = _swap(module, prefix, swapped, others)
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout (see run.py)
    test._torch_compile_train_cls = swapped


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":
        return
    found = [t for t in LAYOUTS if test_module(t) in sys.modules]
    if len(found) != 1:
        raise RuntimeError(f"run pytest on the test file of one of {', '.join(LAYOUTS)} (collected: {found})")
    swap(sys.modules[test_module(found[0])], found[0])
