"""What the Hugging Face swap plugins (``swap_hf_gpt2.py``, ``swap_hf_llama.py``) share: the class
that stands where a test names transformers' causal LM and builds fastzoo's instead, the stand-ins
for the classes fastzoo does not provide, transformers' loading options in fastzoo's words, and
the hook that makes the swap once HF's test module is collected (only with ``PEER_SUITE_SWAP=1``).
"""
from __future__ import annotations

import os
import sys

# the heads HF's causal-LM model tester builds besides the causal LM (tester attributes)
_OTHER_HEADS = ("base_model_class", "question_answering_class", "sequence_classification_class",
                "token_classification_class")


class NotProvidedByFastzoo(NotImplementedError):
    """The test asked for something fastzoo does not offer (a class, a config field)."""


def _backend(name: str) -> str:
    """fastzoo's backend for transformers' ``attn_implementation`` name (the decoders' own table)."""
    from fastzoo.models.decoder.generation import fastzoo_attention

    try:
        return fastzoo_attention(name)
    except ValueError:
        raise NotProvidedByFastzoo(f"attn_implementation={name!r}: fastzoo has no such backend") from None


def _attn_of(config) -> dict:
    """The backend named by ``config._attn_implementation`` (unset: fastzoo's default)."""
    name = getattr(config, "_attn_implementation", None)
    return {} if name is None else {"attn": _backend(name)}


def _create_kwargs(kwargs: dict) -> dict:
    """transformers' loading options in fastzoo's words (``attn_implementation``, ``dtype``)."""
    kw = {}
    if "attn_implementation" in kwargs:
        name = kwargs.pop("attn_implementation")
        if name is not None:
            kw["attn"] = _backend(name)
    for key in ("dtype", "torch_dtype"):
        if key in kwargs:
            kw["dtype"] = kwargs.pop(key)
    return {**kw, **kwargs}


class _FastzooClassMeta(type):
    """Class-level look-ups fall through to fastzoo's own class; a private flag of
    ``PreTrainedModel`` that fastzoo's class does not declare (``_supports_sdpa``,
    ``_is_stateful``, ``_can_compile_fullgraph`` ...: read by the test mixins to decide what to
    run) answers ``PreTrainedModel``'s default, i.e. what transformers assumes of a model that
    declares nothing."""

    def __getattr__(cls, name):
        import inspect

        from transformers import PreTrainedModel

        try:
            return getattr(cls._fastzoo_class(), name)
        except AttributeError:
            default = inspect.getattr_static(PreTrainedModel, name, None)
            if name.startswith("_") and not name.startswith("__") and isinstance(default, (bool, type(None), str, list, tuple, dict)):
                return default
            raise


def stand_in(hf_name: str, build, fastzoo_class, pretrained_name: str) -> type:
    """The class named ``hf_name`` for the tests: ``cls(config)`` is ``build(config)`` (fastzoo's
    model from a transformers config, ``build(config, **create_kwargs)`` for ``_from_config``),
    ``from_pretrained(path)`` is ``fastzoo.create(pretrained_name, pretrained=path)``; every other
    attribute is fastzoo's class's (``fastzoo_class()``: ``forward``'s signature, ``can_generate`` ...)."""

    class Stand(metaclass=_FastzooClassMeta):
        _fastzoo_class = staticmethod(fastzoo_class)

        def __new__(cls, config=None, *args, **kwargs):
            if config is None:
                config = kwargs.pop("config")
            if args or kwargs:
                raise TypeError(f"fastzoo.create takes no extra constructor arguments: {args} {sorted(kwargs)}")
            return build(config)

        @classmethod
        def _from_config(cls, config, **kwargs):  # PreTrainedModel's: build from a config with loading options
            return build(config, **_create_kwargs(kwargs))

        @classmethod
        def from_pretrained(cls, path=None, *args, **kwargs):
            import fastzoo

            if path is None:  # transformers' keyword for it
                path = kwargs.pop("pretrained_model_name_or_path", None)
            if args:
                raise TypeError(f"from_pretrained: positional arguments after the path: {args}")
            return fastzoo.create(pretrained_name, pretrained=path, **_create_kwargs(kwargs))

        @classmethod
        def _can_set_experts_implementation(cls) -> bool:  # no mixture of experts
            return False

    Stand.__name__ = Stand.__qualname__ = hf_name
    return Stand


def _not_provided(name: str, only: str) -> type:
    def refuse(*_a, **_k):
        raise NotProvidedByFastzoo(f"fastzoo provides no {name} (only {only})")

    return type(name, (), {"__new__": lambda cls, *a, **k: refuse(), "from_pretrained": classmethod(refuse),
                           "_from_config": classmethod(refuse)})


def swap(module, prefix: str, swapped: type, not_provided: tuple[str, ...]) -> type:
    """In HF's test ``module`` of the ``prefix`` family (``GPT2``, ``Llama``): ``swapped`` where the
    tests name the causal LM, a refusing stand-in for each of ``not_provided``; the model tester
    builds them, the test class's ``all_model_classes`` is ``swapped`` alone. Returns the test class."""
    stand_ins = {name: _not_provided(name, swapped.__name__) for name in not_provided}
    for name, cls in stand_ins.items():
        setattr(module, name, cls)
    setattr(module, swapped.__name__, swapped)

    tester = getattr(module, f"{prefix}ModelTester")
    original_init = tester.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)  # HF's own checks of its wiring run on HF's classes
        self.causal_lm_class = swapped
        for attr in _OTHER_HEADS:  # the heads this tester builds, each a refusing stand-in
            head = getattr(self, attr, None)
            if head is not None:
                setattr(self, attr, stand_ins.get(head.__name__) or _not_provided(head.__name__, swapped.__name__))

    tester.__init__ = init
    test = getattr(module, f"{prefix}ModelTest")
    test.all_model_classes = (swapped,)
    return test


def swap_when_collected(test_module: str, test_file: str, swap_module):
    """The plugin's ``pytest_collection_finish``: ``swap_module(module)`` once ``test_module`` is
    collected, with ``PEER_SUITE_SWAP=1``; without it the baseline runs HF's own classes."""

    def pytest_collection_finish(session):
        if os.environ.get("PEER_SUITE_SWAP") != "1":
            return
        module = sys.modules.get(test_module)
        if module is None:
            raise RuntimeError(f"{test_module} was not collected: run pytest on {test_file}")
        swap_module(module)

    return pytest_collection_finish
