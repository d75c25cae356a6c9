"""pytest plugin: Hugging Face's own Deformable DETR tests
(``tests/models/deformable_detr/test_modeling_deformable_detr.py``) with fastzoo's Deformable DETR in the
place of transformers' ``DeformableDetrForObjectDetection``, as a new user would swap it in.

``DeformableDetrForObjectDetection(config)`` -> ``fastzoo.create("deformable_detr", **fields)`` with the
fields fastzoo reads from a transformers ``DeformableDetrConfig`` (the converter's own reading; what fastzoo
does not build is refused by name) and the attention backend named by ``config._attn_implementation``;
``from_pretrained(path)`` -> ``fastzoo.create("deformable_detr", pretrained=path)``. ``DeformableDetrModel``,
which fastzoo does not provide, is a stand-in that raises :class:`NotProvidedByFastzoo` when built; the test
class's ``all_model_classes`` is the swapped detector alone. Test bodies and assertions are not touched.
Only with ``PEER_SUITE_SWAP=1``.
"""
from __future__ import annotations

from hf_swap import NotProvidedByFastzoo, _attn_of, _not_provided, stand_in, swap_when_collected

_TEST_MODULE = "tests.models.deformable_detr.test_modeling_deformable_detr"


def build_fastzoo_deformable_detr(config, **create_kwargs):
    """``fastzoo.create("deformable_detr", ...)`` from a ``transformers.DeformableDetrConfig``."""
    import fastzoo
    from fastzoo.errors import CheckpointError
    from fastzoo.models.deformable_detr.convert import HF

    try:
        fields = HF.config_from_json(config.to_dict())
    except CheckpointError as e:
        raise NotProvidedByFastzoo(str(e)) from None
    return fastzoo.create("deformable_detr", **{**_attn_of(config), **create_kwargs}, **fields)


def _fastzoo_deformable_detr():
    from fastzoo.models.deformable_detr import DeformableDetrForObjectDetection

    return DeformableDetrForObjectDetection


FastzooDeformableDetrForObjectDetection = stand_in(
    "DeformableDetrForObjectDetection", build_fastzoo_deformable_detr, _fastzoo_deformable_detr, "deformable_detr")


def swap(module) -> None:
    module.DeformableDetrModel = _not_provided("DeformableDetrModel", "DeformableDetrForObjectDetection")
    module.DeformableDetrForObjectDetection = FastzooDeformableDetrForObjectDetection
    test = module.DeformableDetrModelTest
    test.all_model_classes = (FastzooDeformableDetrForObjectDetection,)
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout


pytest_collection_finish = swap_when_collected(
    _TEST_MODULE, "tests/models/deformable_detr/test_modeling_deformable_detr.py", swap)
