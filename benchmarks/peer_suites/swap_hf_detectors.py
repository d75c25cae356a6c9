"""pytest plugin: Hugging Face's own RT-DETR, RT-DETRv2, D-FINE and RF-DETR tests
(``tests/models/<folder>/test_modeling_<folder>.py``) with fastzoo's detector in the place of transformers'
``RTDetrForObjectDetection`` / ``RTDetrV2ForObjectDetection`` / ``DFineForObjectDetection`` /
``RfDetrForObjectDetection``, as a new user would swap it in.

``<Prefix>ForObjectDetection(config)`` -> ``fastzoo.create(name, **fields)`` with the fields the family's converter
reads from the transformers config (what fastzoo does not build is refused by name) and the attention backend
named by ``config._attn_implementation``; ``from_pretrained(path)`` -> ``fastzoo.create(name, pretrained=path)``.
The test module's other model classes (``RTDetrModel``, ``DFineModel``, ``RfDetrModel``...), which
fastzoo does not provide, are stand-ins that raise :class:`NotProvidedByFastzoo` when built; the test class's
``all_model_classes`` is the swapped detector alone. Test bodies and assertions are not touched.
Only with ``PEER_SUITE_SWAP=1``.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from hf_swap import NotProvidedByFastzoo, _attn_of, _not_provided, stand_in


@dataclass(frozen=True)
class Family:
    prefix: str  # transformers' class prefix: <prefix>ForObjectDetection, <prefix>ModelTest
    name: str  # the fastzoo variant created (the config's fields decide every size)
    package: str  # fastzoo.models.<package>: its convert.HF and its detector class
    not_provided: tuple[str, ...]  # the test module's other model classes
    fastzoo_class: str = ""  # fastzoo's class, where it is not <prefix>ForObjectDetection (one class serves RT-DETR v1 and v2)


FAMILIES = {"tests.models.rt_detr.test_modeling_rt_detr": Family("RTDetr", "rtdetr_r50vd", "rt_detr", ("RTDetrModel",)),
            "tests.models.rt_detr_v2.test_modeling_rt_detr_v2": Family(
                "RTDetrV2", "rtdetr_v2_r50vd", "rt_detr", ("RTDetrV2Model",), "RTDetrForObjectDetection"),
            "tests.models.d_fine.test_modeling_d_fine": Family("DFine", "dfine_small_coco", "d_fine", ("DFineModel",)),
            "tests.models.rf_detr.test_modeling_rf_detr": Family(
                "RfDetr", "rf_detr_base", "rf_detr", ("RfDetrModel", "RfDetrForInstanceSegmentation"))}


def detector_class(family: Family):
    return getattr(importlib.import_module(f"fastzoo.models.{family.package}"),
                   family.fastzoo_class or f"{family.prefix}ForObjectDetection")


def builder(family: Family):
    """``build(config, **create_kwargs)``: fastzoo's detector from the family's transformers config."""

    def build(config, **create_kwargs):
        import fastzoo
        from fastzoo.errors import CheckpointError

        convert = importlib.import_module(f"fastzoo.models.{family.package}.convert")
        try:
            fields = convert.HF.config_from_json(config.to_dict())
        except CheckpointError as e:
            raise NotProvidedByFastzoo(str(e)) from None
        return fastzoo.create(family.name, **{**_attn_of(config), **create_kwargs}, **fields)

    return build


STAND_INS = {f.prefix: stand_in(f"{f.prefix}ForObjectDetection", builder(f), lambda f=f: detector_class(f), f.name)
             for f in FAMILIES.values()}


def swap(module, family: Family) -> None:
    detector = STAND_INS[family.prefix]
    for name in family.not_provided:
        setattr(module, name, _not_provided(name, detector.__name__))
    setattr(module, detector.__name__, detector)
    test = getattr(module, f"{family.prefix}ModelTest")
    test.all_model_classes = (detector,)
    test.pipeline_model_mapping = {}  # pipelines are stubbed out of this checkout


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":
        return
    found = [name for name in FAMILIES if name in sys.modules]
    if not found:
        raise RuntimeError(f"none of {sorted(FAMILIES)} was collected: run pytest on one of their files")
    for name in found:
        swap(sys.modules[name], FAMILIES[name])
