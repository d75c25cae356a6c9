"""pytest plugin: Hugging Face's own Llama model tests with fastzoo's Llama in the place of
``transformers.LlamaForCausalLM``, as a new user would swap it in.

The swap is the user's two lines, as for GPT-2 (``swap_hf_gpt2.py``, whose helpers it shares):
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

import os
import sys

from swap_hf_gpt2 import NotProvidedByFastzoo, _attn_of, _create_kwargs, _FastzooClassMeta, _not_provided

_TEST_MODULE = "tests.models.llama.test_modeling_llama"
_NOT_PROVIDED = ("LlamaModel", "LlamaForQuestionAnswering", "LlamaForSequenceClassification",
                 "LlamaForTokenClassification")


def build_fastzoo_llama(config, **create_kwargs):
    """``fastzoo.create(<model_type>, ...)`` from a transformers ``LlamaConfig``."""
    import fastzoo
    from fastzoo.models.decoder.convert import LLAMA

    fields = LLAMA.config_from_json(config.to_dict())
    return fastzoo.create(fields["model_type"], **{**_attn_of(config), **create_kwargs}, **fields)


class _LlamaClassMeta(_FastzooClassMeta):
    """Class-level look-ups fall through to fastzoo's Llama class (else PreTrainedModel's defaults)."""

    def __getattr__(cls, name):
        import inspect

        from transformers import PreTrainedModel

        from fastzoo.models.decoder.llama import LlamaForCausalLM

        try:
            return getattr(LlamaForCausalLM, name)
        except AttributeError:
            default = inspect.getattr_static(PreTrainedModel, name, None)
            if name.startswith("_") and not name.startswith("__") and isinstance(default, (bool, type(None), str, list, tuple, dict)):
                return default
            raise


class FastzooLlamaForCausalLM(metaclass=_LlamaClassMeta):
    """Stands where a test names ``LlamaForCausalLM``; building it builds fastzoo's Llama."""

    def __new__(cls, config=None, *args, **kwargs):
        if config is None:
            config = kwargs.pop("config")
        if args or kwargs:
            raise TypeError(f"fastzoo.create takes no extra constructor arguments: {args} {sorted(kwargs)}")
        return build_fastzoo_llama(config)

    @classmethod
    def _from_config(cls, config, **kwargs):
        return build_fastzoo_llama(config, **_create_kwargs(kwargs))

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        import fastzoo

        if args:
            raise TypeError(f"from_pretrained: positional arguments after the path: {args}")
        return fastzoo.create("llama", pretrained=path, **_create_kwargs(kwargs))

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return False

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return False


FastzooLlamaForCausalLM.__name__ = FastzooLlamaForCausalLM.__qualname__ = "LlamaForCausalLM"


def swap(module) -> None:
    stand_ins = {name: _not_provided(name, "LlamaForCausalLM") for name in _NOT_PROVIDED}
    for name, cls in stand_ins.items():
        setattr(module, name, cls)
    module.LlamaForCausalLM = FastzooLlamaForCausalLM

    tester = module.LlamaModelTester
    original_init = tester.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)  # HF's own checks of its wiring run on HF's classes
        self.base_model_class = stand_ins["LlamaModel"]
        self.causal_lm_class = FastzooLlamaForCausalLM
        self.question_answering_class = stand_ins["LlamaForQuestionAnswering"]
        self.sequence_classification_class = stand_ins["LlamaForSequenceClassification"]
        self.token_classification_class = stand_ins["LlamaForTokenClassification"]

    tester.__init__ = init
    test = module.LlamaModelTest
    test.all_model_classes = (FastzooLlamaForCausalLM,)
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout (see run.py)
    test._torch_compile_train_cls = FastzooLlamaForCausalLM


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":  # the baseline run: HF's own classes
        return
    module = sys.modules.get(_TEST_MODULE)
    if module is None:
        raise RuntimeError(f"{_TEST_MODULE} was not collected: run pytest on tests/models/llama/test_modeling_llama.py")
    swap(module)
