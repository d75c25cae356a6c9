"""pytest plugin: Hugging Face's own Llama model tests with fastzoo's Llama in the place of
``transformers.LlamaForCausalLM``, as a new user would swap it in.

The swap is the user's two lines, as for GPT-2 (``swap_hf_gpt2.py``; both are built on ``hf_swap.py``):
``LlamaForCausalLM(config)`` -> ``fastzoo.create(config.model_type, **fields)`` with the fields
fastzoo reads from a transformers config (the converter's own reading: rotary parameters,
windows, biases; a field fastzoo does not reproduce is refused by name) and the attention
backend named by ``config._attn_implementation``; ``LlamaForCausalLM.from_pretrained(path)`` ->
``fastzoo.create("llama", pretrained=path)``. Classes fastzoo does not provide (``LlamaModel``,
``LlamaFor{SequenceClassification,QuestionAnswering,TokenClassification}``) are stand-ins that
raise :class:`NotProvidedByFastzoo` when built; the test class's ``all_model_classes`` is the
swapped ``LlamaForCausalLM`` alone. Test bodies and assertions are not touched. The swap is
made only with ``PEER_SUITE_SWAP=1``.
"""
from __future__ import annotations

from hf_swap import _attn_of, stand_in, swap_when_collected
from hf_swap import swap as _swap

_TEST_MODULE = "tests.models.llama.test_modeling_llama"
_NOT_PROVIDED = ("LlamaModel", "LlamaForQuestionAnswering", "LlamaForSequenceClassification",
                 "LlamaForTokenClassification")


def build_fastzoo_llama(config, **create_kwargs):
    """``fastzoo.create(<model_type>, ...)`` from a transformers ``LlamaConfig``."""
    import fastzoo
    from fastzoo.models.decoder.convert import LLAMA

    fields = LLAMA.config_from_json(config.to_dict())
    return fastzoo.create(fields["model_type"], **{**_attn_of(config), **create_kwargs}, **fields)


def _fastzoo_llama():
    from fastzoo.models.decoder.llama import LlamaForCausalLM

    return LlamaForCausalLM


FastzooLlamaForCausalLM = stand_in("LlamaForCausalLM", build_fastzoo_llama, _fastzoo_llama, "llama")


def swap(module) -> None:
    test = _swap(module, "Llama", FastzooLlamaForCausalLM, _NOT_PROVIDED)
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout (see run.py)
    test._torch_compile_train_cls = FastzooLlamaForCausalLM


pytest_collection_finish = swap_when_collected(_TEST_MODULE, "tests/models/llama/test_modeling_llama.py", swap)
