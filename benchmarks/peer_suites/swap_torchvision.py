"""pytest plugin: torchvision's own ``test/test_backbone_utils.py`` (feature extraction and
FPN backbones) on ResNet-50, with fastzoo's ``resnet50`` swapped in as a new user would.

Selection (both runs): the tests parametrized over ``model_name`` / ``backbone_name`` equal to
``resnet50``; everything else is deselected (other architectures: nothing of fastzoo's).

Swap (only with ``PEER_SUITE_SWAP=1``): ``torchvision.models.resnet50`` (where the tests look it
up: ``torchvision.models.__dict__`` and ``torchvision.models.resnet.__dict__``) becomes
``fastzoo.create("resnet50", **kwargs)``; ``pretrained=False`` / ``weights=None`` / ``progress``
are torchvision's loading options and mean "no weights"; anything else is passed on (fastzoo
refuses what it does not take). Test bodies and assertions are not touched.
"""
from __future__ import annotations

import os


class NotProvidedByFastzoo(NotImplementedError):
    """The test asked for something fastzoo does not offer."""


def fastzoo_resnet50(*, weights=None, progress=True, pretrained=False, **kwargs):
    import fastzoo

    if pretrained or weights is not None:
        raise NotProvidedByFastzoo("torchvision's weights= downloads; fastzoo loads pretrained= from a file or a live model")
    if kwargs.get("norm_layer") is not None:
        raise NotProvidedByFastzoo(f"norm_layer={getattr(kwargs['norm_layer'], '__name__', kwargs['norm_layer'])}: "
                                   "fastzoo's ResNet-50 has BatchNorm2d only")
    kwargs.pop("norm_layer", None)
    return fastzoo.create("resnet50", **kwargs)


def _name(item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("model_name", params.get("backbone_name"))


def pytest_collection_modifyitems(session, config, items):
    keep = [i for i in items if _name(i) == "resnet50"]
    config.hook.pytest_deselected(items=[i for i in items if _name(i) != "resnet50"])
    items[:] = keep


def pytest_collection_finish(session):
    if os.environ.get("PEER_SUITE_SWAP") != "1":
        return
    import torchvision.models
    import torchvision.models.resnet

    torchvision.models.resnet50 = fastzoo_resnet50
    torchvision.models.resnet.resnet50 = fastzoo_resnet50
