"""pytest plugin: timm's own ``tests/test_models.py`` on the two architectures fastzoo has
(``vit_base_patch16_224`` = fastzoo ``vit_b16``, ``resnet50``), with fastzoo's models swapped
in as a new user would.

Selection (both runs): the tests parametrized over a ``model_name`` whose architecture is one
of the two; of several pretrained tags of one architecture only the untagged name (else the
first tag) is kept. Everything else is deselected (other architectures: nothing of fastzoo's).

Swap (only with ``PEER_SUITE_SWAP=1``): the test module's ``create_model`` becomes
``fastzoo.create(<fastzoo name>, **kwargs)`` with timm's keyword names, which fastzoo takes
(``num_classes``, ``global_pool``, ``features_only``, ``out_indices``, ``feature_cls``;
``feature_cfg={"feature_cls": x}`` is timm's other spelling of ``feature_cls=x``).
``pretrained=True`` (a hub download) raises :class:`NotProvidedByFastzoo`. Test bodies and
assertions are not touched.
"""
from __future__ import annotations

import os
import sys

FASTZOO_NAMES = {"vit_base_patch16_224": "vit_b16", "resnet50": "resnet50"}


class NotProvidedByFastzoo(NotImplementedError):
    """The test asked for something fastzoo does not offer."""


def fastzoo_create_model(model_name, pretrained=False, pretrained_cfg=None, **kwargs):
    import fastzoo

    arch = model_name.split(".")[0]
    if arch not in FASTZOO_NAMES:
        raise NotProvidedByFastzoo(f"fastzoo has no {arch}")
    if pretrained:
        raise NotProvidedByFastzoo("pretrained=True downloads from the hub; fastzoo loads pretrained= from a file, "
                                   "directory or live model")
    if pretrained_cfg is not None:
        raise NotProvidedByFastzoo("pretrained_cfg=: fastzoo takes the checkpoint's own or the variant's default")
    feature_cfg = kwargs.pop("feature_cfg", None) or {}
    if feature_cfg:
        kwargs["feature_cls"] = feature_cfg.pop("feature_cls", kwargs.get("feature_cls"))
        if feature_cfg:
            raise NotProvidedByFastzoo(f"feature_cfg keys {sorted(feature_cfg)}")
    return fastzoo.create(FASTZOO_NAMES[arch], **kwargs)


def _model_name(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("model_name")


def pytest_collection_modifyitems(session, config, items):
    keep, drop, seen = [], [], {}
    for item in items:
        name = _model_name(item)
        arch = None if name is None else name.split(".")[0]
        if arch not in FASTZOO_NAMES:
            drop.append(item)
            continue
        seen.setdefault((item.originalname, arch), []).append(item)
    for group in seen.values():
        untagged = [i for i in group if "." not in _model_name(i)]
        first = untagged[0] if untagged else group[0]
        keep.append(first)
        drop.extend(i for i in group if i is not first)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":
        return
    module = sys.modules.get("tests.test_models") or sys.modules.get("test_models")
    if module is None:
        raise RuntimeError("timm's tests/test_models.py was not collected")
    module.create_model = fastzoo_create_model
