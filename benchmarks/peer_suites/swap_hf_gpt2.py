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
"""
from __future__ import annotations

import os
import sys

_TEST_MODULE = "tests.models.gpt2.test_modeling_gpt2"
_NOT_PROVIDED = ("GPT2Model", "GPT2DoubleHeadsModel", "GPT2ForQuestionAnswering",
                 "GPT2ForSequenceClassification", "GPT2ForTokenClassification")
_ATTN = {"eager": "eager", "sdpa": "sdpa", "flex_attention": "flex", "flash_attention_2": "flash"}


class NotProvidedByFastzoo(NotImplementedError):
    """The test asked for something fastzoo does not offer (a class, a config field)."""


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


def _attn_of(config) -> dict:
    name = getattr(config, "_attn_implementation", None)
    if name is None:
        return {}
    if name not in _ATTN:
        raise NotProvidedByFastzoo(f"attn_implementation={name!r}: fastzoo has no such backend")
    return {"attn": _ATTN[name]}


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


class _FastzooClassMeta(type):
    """Class-level look-ups fall through to fastzoo's own GPT-2 class; a private flag of
    ``PreTrainedModel`` that fastzoo's class does not declare (``_supports_sdpa``,
    ``_is_stateful``, ``_can_compile_fullgraph`` ...: read by the test mixins to decide what to
    run) answers ``PreTrainedModel``'s default, i.e. what transformers assumes of a model that
    declares nothing."""

    def __getattr__(cls, name):
        import inspect

        from transformers import PreTrainedModel

        from fastzoo.models.decoder import GPT2LMHeadModel

        try:
            return getattr(GPT2LMHeadModel, name)
        except AttributeError:
            default = inspect.getattr_static(PreTrainedModel, name, None)
            if name.startswith("_") and not name.startswith("__") and isinstance(default, (bool, type(None), str, list, tuple, dict)):
                return default
            raise


def _create_kwargs(kwargs: dict) -> dict:
    """transformers' loading options in fastzoo's words (``attn_implementation``, ``dtype``)."""
    kw = {}
    if "attn_implementation" in kwargs:
        name = kwargs.pop("attn_implementation")
        if name is not None:
            if name not in _ATTN:
                raise NotProvidedByFastzoo(f"attn_implementation={name!r}: fastzoo has no such backend")
            kw["attn"] = _ATTN[name]
    for key in ("dtype", "torch_dtype"):
        if key in kwargs:
            kw["dtype"] = kwargs.pop(key)
    return {**kw, **kwargs}


class FastzooGPT2LMHeadModel(metaclass=_FastzooClassMeta):
    """Stands where a test names ``GPT2LMHeadModel``; building it builds fastzoo's GPT-2."""

    def __new__(cls, config=None, *args, **kwargs):
        if config is None:
            config = kwargs.pop("config")
        if args or kwargs:
            raise TypeError(f"fastzoo.create takes no extra constructor arguments: {args} {sorted(kwargs)}")
        return build_fastzoo_gpt2(config)

    @classmethod
    def _from_config(cls, config, **kwargs):  # PreTrainedModel's: build from a config with loading options
        return build_fastzoo_gpt2(config, **_create_kwargs(kwargs))

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        import fastzoo

        if args:
            raise TypeError(f"from_pretrained: positional arguments after the path: {args}")
        return fastzoo.create("gpt2", pretrained=path, **_create_kwargs(kwargs))

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:  # fastzoo switches backends with set_attention, not HF's
        return False

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:  # no mixture of experts
        return False


FastzooGPT2LMHeadModel.__name__ = FastzooGPT2LMHeadModel.__qualname__ = "GPT2LMHeadModel"


def _not_provided(name: str, only: str = "GPT2LMHeadModel") -> type:
    def refuse(*_a, **_k):
        raise NotProvidedByFastzoo(f"fastzoo provides no {name} (only {only})")

    return type(name, (), {"__new__": lambda cls, *a, **k: refuse(), "from_pretrained": classmethod(refuse),
                           "_from_config": classmethod(refuse)})


def swap(module) -> None:
    stand_ins = {name: _not_provided(name) for name in _NOT_PROVIDED}
    for name, cls in stand_ins.items():
        setattr(module, name, cls)
    module.GPT2LMHeadModel = FastzooGPT2LMHeadModel

    tester = module.GPT2ModelTester
    original_init = tester.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)  # HF's own checks of its wiring run on HF's classes
        self.base_model_class = stand_ins["GPT2Model"]
        self.causal_lm_class = FastzooGPT2LMHeadModel
        self.question_answering_class = stand_ins["GPT2ForQuestionAnswering"]
        self.sequence_classification_class = stand_ins["GPT2ForSequenceClassification"]
        self.token_classification_class = stand_ins["GPT2ForTokenClassification"]

    tester.__init__ = init
    module.GPT2ModelTest.all_model_classes = (FastzooGPT2LMHeadModel,)


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":  # the baseline run: HF's own classes
        return
    module = sys.modules.get(_TEST_MODULE)
    if module is None:
        raise RuntimeError(f"{_TEST_MODULE} was not collected: run pytest on tests/models/gpt2/test_modeling_gpt2.py")
    swap(module)
