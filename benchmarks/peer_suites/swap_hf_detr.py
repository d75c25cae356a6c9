"""pytest plugin: Hugging Face's own DETR tests (``tests/models/detr/test_modeling_detr.py``) with
fastzoo's DETR in the place of transformers' ``DetrForObjectDetection``, as a new user would swap it in.

``DetrForObjectDetection(config)`` -> ``fastzoo.create("detr", **fields)`` with the fields fastzoo
reads from a transformers ``DetrConfig`` (the converter's own reading: both backbone paths; a
backbone fastzoo does not build is refused by name) and the attention backend named by
``config._attn_implementation``; ``from_pretrained(path)`` -> ``fastzoo.create("detr", pretrained=path)``.
``DetrModel`` and ``DetrForSegmentation``, which fastzoo does not provide, are stand-ins that raise
:class:`NotProvidedByFastzoo` when built; the test class's ``all_model_classes`` is the swapped
detector alone. Test bodies and assertions are not touched. Only with ``PEER_SUITE_SWAP=1``.
"""
from __future__ import annotations

from hf_swap import NotProvidedByFastzoo, _attn_of, _not_provided, stand_in, swap_when_collected

_TEST_MODULE = "tests.models.detr.test_modeling_detr"


def build_fastzoo_detr(config, **create_kwargs):
    """``fastzoo.create("detr", ...)`` from a ``transformers.DetrConfig``."""
    import fastzoo
    from fastzoo.errors import CheckpointError
    from fastzoo.models.detr.convert import HF

    try:
        fields = HF.config_from_json(config.to_dict())
    except CheckpointError as e:
        raise NotProvidedByFastzoo(str(e)) from None
    return fastzoo.create("detr", **{**_attn_of(config), **create_kwargs}, **fields)


def _fastzoo_detr():
    from fastzoo.models.detr import DetrForObjectDetection

    return DetrForObjectDetection


FastzooDetrForObjectDetection = stand_in("DetrForObjectDetection", build_fastzoo_detr, _fastzoo_detr, "detr")


def swap(module) -> None:
    for name in ("DetrModel", "DetrForSegmentation"):
        setattr(module, name, _not_provided(name, "DetrForObjectDetection"))
    module.DetrForObjectDetection = FastzooDetrForObjectDetection
    test = module.DetrModelTest
    test.all_model_classes = (FastzooDetrForObjectDetection,)
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout (see run.py)


pytest_collection_finish = swap_when_collected(_TEST_MODULE, "tests/models/detr/test_modeling_detr.py", swap)
