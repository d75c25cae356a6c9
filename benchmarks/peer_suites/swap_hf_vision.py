"""pytest plugin: transformers' own ViT and ResNet model tests (``tests/models/vit/test_modeling_vit.py``,
``tests/models/resnet/test_modeling_resnet.py``) with fastzoo's models in the place of transformers'
classes, as a user coming from transformers would swap them in.

The swap is what such a user changes: ``ViTModel(config)`` / ``ViTForImageClassification(config)`` /
``ResNetModel(config)`` / ``ResNetForImageClassification(config)`` -> fastzoo's model of the same
transformers config (``fastzoo.create(<hub id>, **fields)``, the fields read from the config by the
family's transformers converter, so the model answers as that class: ``model(pixel_values=,
labels=)`` -> transformers' output class), with the attention backend named by
``config._attn_implementation``; ``from_pretrained(path)`` -> ``fastzoo.create(<hub id>,
pretrained=path)``. Classes fastzoo does not provide (``ViTForMaskedImageModeling``,
``ResNetBackbone``) are stand-ins that raise :class:`NotProvidedByFastzoo`; each test class's
``all_model_classes`` is the swapped classes. Test bodies are not touched. A stale name an older
copy of the ResNet test imports (``RESNET_PRETRAINED_MODEL_ARCHIVE_LIST``, used by its @slow hub
tests only; ``transformers.utils.cached_property``) is supplied, in both runs, so that the module
imports under the installed transformers.
The swap is made only with ``PEER_SUITE_SWAP=1``.
"""
from __future__ import annotations

import os
import sys

from hf_swap import NotProvidedByFastzoo, _attn_of, _not_provided, stand_in

_HUB = {"ViTModel": "google/vit-base-patch16-224-in21k", "ViTForImageClassification": "google/vit-base-patch16-224",
        "ResNetModel": "microsoft/resnet-50", "ResNetForImageClassification": "microsoft/resnet-50"}
_SUITES = {  # test module -> (its test classes, the classes swapped, the classes fastzoo does not provide)
    "tests.models.vit.test_modeling_vit": (("ViTModelTest",), ("ViTModel", "ViTForImageClassification"),
                                           ("ViTForMaskedImageModeling",)),
    "tests.models.resnet.test_modeling_resnet": (("ResNetModelTest", "ResNetBackboneTest"),
                                                 ("ResNetModel", "ResNetForImageClassification"), ("ResNetBackbone",)),
}


def build(arch: str):
    def make(config, **create_kwargs):
        import fastzoo
        from fastzoo.errors import CheckpointError
        from fastzoo.registry import get_entry

        cfg = config.to_dict()
        cfg["architectures"] = [arch]
        try:
            fields = get_entry(_HUB[arch]).spec.converter("hf").config_from_json(cfg)
        except CheckpointError as e:  # a config of a network fastzoo's does not compute
            raise NotProvidedByFastzoo(str(e)) from e
        return fastzoo.create(_HUB[arch], **{**_attn_of(config), **create_kwargs}, **fields)

    return make


def _fastzoo_class(arch: str):
    def cls():
        from fastzoo.models.resnet.model import ResNet
        from fastzoo.models.vit.model import VisionTransformer

        return ResNet if arch.startswith("ResNet") else VisionTransformer

    return cls


def swap(module, test_classes, swapped, not_provided) -> None:
    stands = tuple(stand_in(name, build(name), _fastzoo_class(name), _HUB[name]) for name in swapped)
    for cls in stands:
        setattr(module, cls.__name__, cls)
    for name in not_provided:
        setattr(module, name, _not_provided(name, ", ".join(swapped)))
    for name in test_classes:
        test = getattr(module, name)
        kept = tuple(c for c in stands if c.__name__ in {k.__name__ for k in test.all_model_classes})
        test.all_model_classes = kept or tuple(getattr(module, n) for n in not_provided)


def _stale_names() -> None:
    """Names the older ResNet test copy imports that transformers 5 removed (used by its @slow tests and
    as a decorator's base), supplied in both runs so that the module imports."""
    import functools

    import transformers.models.resnet.modeling_resnet as resnet
    import transformers.utils as utils

    if not hasattr(resnet, "RESNET_PRETRAINED_MODEL_ARCHIVE_LIST"):
        resnet.RESNET_PRETRAINED_MODEL_ARCHIVE_LIST = ["microsoft/resnet-50"]
    if not hasattr(utils, "cached_property"):
        utils.cached_property = functools.cached_property


def pytest_configure(config):
    _stale_names()


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":
        return
    found = [m for m in _SUITES if m in sys.modules]
    if not found:
        raise RuntimeError(f"none of {', '.join(_SUITES)} was collected")
    for name in found:
        swap(sys.modules[name], *_SUITES[name])


__all__ = ["NotProvidedByFastzoo", "build", "swap"]
