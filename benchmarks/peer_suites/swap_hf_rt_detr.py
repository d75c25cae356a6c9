"""pytest plugin: Hugging Face's own RT-DETR and RT-DETRv2 tests (``tests/models/rt_detr/test_modeling_rt_detr.py``,
``tests/models/rt_detr_v2/test_modeling_rt_detr_v2.py``) with fastzoo's RT-DETR in the place of transformers'
``RTDetrForObjectDetection`` / ``RTDetrV2ForObjectDetection``, as a new user would swap it in.

``RTDetr[V2]ForObjectDetection(config)`` -> ``fastzoo.create("rtdetr[_v2]_r50vd", **fields)`` with the fields
fastzoo reads from a transformers ``RTDetrConfig`` / ``RTDetrV2Config`` (the converter's own reading; what fastzoo
does not build is refused by name) and the attention backend named by ``config._attn_implementation``;
``from_pretrained(path)`` -> ``fastzoo.create(..., pretrained=path)``. ``RTDetr[V2]Model``, which fastzoo does
not provide, is a stand-in that raises :class:`NotProvidedByFastzoo` when built; the test class's
``all_model_classes`` is the swapped detector alone. Test bodies and assertions are not touched.
Only with ``PEER_SUITE_SWAP=1``.
"""
from __future__ import annotations

import os
import sys

from hf_swap import NotProvidedByFastzoo, _attn_of, _not_provided, stand_in

# test module -> (transformers' class prefix, fastzoo's name for that version)
VERSIONS = {"tests.models.rt_detr.test_modeling_rt_detr": ("RTDetr", "rtdetr_r50vd"),
            "tests.models.rt_detr_v2.test_modeling_rt_detr_v2": ("RTDetrV2", "rtdetr_v2_r50vd")}


def build_fastzoo_rt_detr(config, **create_kwargs):
    """fastzoo's RT-DETR (v1 or v2, as the config's ``model_type``) from a transformers ``RTDetrConfig`` /
    ``RTDetrV2Config``."""
    import fastzoo
    from fastzoo.errors import CheckpointError
    from fastzoo.models.rt_detr.convert import HF

    try:
        fields = HF.config_from_json(config.to_dict())
    except CheckpointError as e:
        raise NotProvidedByFastzoo(str(e)) from None
    name = "rtdetr_v2_r50vd" if fields["model_type"] == "rt_detr_v2" else "rtdetr_r50vd"
    return fastzoo.create(name, **{**_attn_of(config), **create_kwargs}, **fields)


def _fastzoo_rt_detr():
    from fastzoo.models.rt_detr import RTDetrForObjectDetection

    return RTDetrForObjectDetection


STAND_INS = {prefix: stand_in(f"{prefix}ForObjectDetection", build_fastzoo_rt_detr, _fastzoo_rt_detr, name)
             for prefix, name in VERSIONS.values()}


def swap(module, prefix: str) -> None:
    detector = STAND_INS[prefix]
    setattr(module, f"{prefix}Model", _not_provided(f"{prefix}Model", detector.__name__))
    setattr(module, detector.__name__, detector)
    test = getattr(module, f"{prefix}ModelTest")
    test.all_model_classes = (detector,)
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":
        return
    found = [name for name in VERSIONS if name in sys.modules]
    if not found:
        raise RuntimeError(f"none of {sorted(VERSIONS)} was collected: run pytest on one of their files")
    for name in found:
        swap(sys.modules[name], VERSIONS[name][0])
