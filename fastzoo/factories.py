"""fastzoo's image classifiers in timm's and torchvision's model factories.

After ``import fastzoo``, config-driven pipelines reach fastzoo by name:

    timm.create_model("fastzoo_vit_base_patch16_224", pretrained=False, num_classes=10, drop_path_rate=0.1)
    timm.create_model("fastzoo_resnet50", pretrained=True, pretrained_cfg_overlay=dict(file="model.safetensors"))
    torchvision.models.get_model("fastzoo_resnet50", weights=None, num_classes=10)

Every registered name (aliases included) of a family whose task both factories build (the
task declares it: ``Task.factories``) is registered as ``fastzoo_<name>``; keyword
arguments are the model's overrides, in timm's field names. timm's ``pretrained=True`` loads
the local weights its pretrained config names (``file`` or ``state_dict``, e.g. from
``pretrained_cfg_overlay``); fastzoo never downloads, so a config naming only a hub or url is
refused. The model carries timm's resolved ``pretrained_cfg`` when one is passed.

Neither library is imported here: a library already imported is registered with at once, any
other right after the user's own import of it, by a finder on ``sys.meta_path`` that wraps
that library's loader (so ``import fastzoo`` costs a ``sys.modules`` look-up and one finder).
"""
from __future__ import annotations

import importlib.abc
import sys
import warnings
from collections.abc import Callable

from fastzoo.registry import create, get_entry, list_models

__all__ = ["PREFIX", "install", "names", "register_timm", "register_torchvision"]

PREFIX = "fastzoo_"


def names() -> list[str]:
    """fastzoo's names (aliases included) that the factories carry, without the prefix."""
    return [n for n in list_models() if get_entry(n).spec.task.factories]


# -- timm -------------------------------------------------------------------------------------
def _timm_build(name: str, pretrained: bool, pretrained_cfg, pretrained_cfg_overlay: dict | None, kwargs: dict):
    from timm.models import resolve_pretrained_cfg

    entry = get_entry(name)
    asked = pretrained_cfg is not None or pretrained_cfg_overlay is not None
    cfg = resolve_pretrained_cfg(entry.timm or name, pretrained_cfg=pretrained_cfg,
                                 pretrained_cfg_overlay=dict(pretrained_cfg_overlay or {})).to_dict() if asked else None
    source = None
    if pretrained:
        source = next((cfg[k] for k in ("state_dict", "file") if cfg and cfg.get(k) is not None), None)
        if source is None:
            raise ValueError(f"pretrained=True for {PREFIX}{name}: fastzoo loads local weights only (no hub, no url); "
                             f"name them with pretrained_cfg_overlay=dict(file='model.safetensors'), or pass "
                             f"pretrained=False and load with fastzoo.load_pretrained(model, source)")
    model = create(name, pretrained=source, **kwargs)
    if cfg is not None and hasattr(model, "pretrained_cfg"):
        model.pretrained_cfg = cfg
    return model


def _timm_entrypoint(name: str) -> Callable:
    def entrypoint(pretrained: bool = False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None,
                   **kwargs):
        return _timm_build(name, pretrained, pretrained_cfg, pretrained_cfg_overlay, kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = PREFIX + name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = f"fastzoo's {name}: {get_entry(name).description}"
    return entrypoint


def register_timm() -> None:
    """``fastzoo_<name>`` in timm's registry (``timm.list_models("fastzoo_*")``); idempotent."""
    from timm.models import is_model, register_model

    module = sys.modules[__name__]
    for name in names():
        if not is_model(PREFIX + name):
            entrypoint = _timm_entrypoint(name)
            setattr(module, entrypoint.__name__, entrypoint)  # timm lists it in this module's __all__
            register_model(entrypoint)


# -- torchvision ------------------------------------------------------------------------------
def _torchvision_builder(name: str) -> Callable:
    def builder(*, weights=None, progress: bool = True, **kwargs):
        if weights is not None:
            raise ValueError(f"weights={weights!r} for {PREFIX}{name}: fastzoo takes no torchvision weights enum; "
                             f"build with weights=None and load with fastzoo.load_pretrained(model, source) "
                             f"(a file, a directory or a live torchvision model)")
        return create(name, **kwargs)

    builder.__name__ = builder.__qualname__ = PREFIX + name
    builder.__module__ = __name__
    builder.__doc__ = f"fastzoo's {name}: {get_entry(name).description}"
    return builder


def register_torchvision() -> None:
    """``fastzoo_<name>`` in torchvision's model registry (``torchvision.models.list_models()``); idempotent."""
    from torchvision.models._api import BUILTIN_MODELS, register_model

    for name in names():
        if PREFIX + name not in BUILTIN_MODELS:
            register_model(PREFIX + name)(_torchvision_builder(name))


# -- when ---------------------------------------------------------------------------------------
REGISTER = {"timm": register_timm, "torchvision": register_torchvision}


def _register(library: str) -> None:
    try:
        REGISTER[library]()
    except Exception as e:  # the user's own import of the library must not fail because of fastzoo
        warnings.warn(f"fastzoo could not register its models with {library}: {type(e).__name__}: {e}", stacklevel=3)


_WATCHED: set[str] = set()  # libraries whose import registers fastzoo's models when it happens


class _ThenRegister(importlib.abc.Loader):
    """The library's own loader; once the library has run, its models are registered."""

    def __init__(self, loader, library: str):
        self.loader, self.library = loader, library

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # the library sees its own loader again
        _WATCHED.discard(self.library)
        _register(self.library)

    def __getattr__(self, attr):  # resources, source: the library's loader answers
        return getattr(self.loader, attr)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a library still to register with, it asks the other finders
    and wraps the loader they give."""

    def find_spec(self, fullname, path, target=None):
        # watched until imported, not until first looked up: ``importlib.util.find_spec("timm")`` (how
        # transformers asks whether timm is installed) finds without importing
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if finder is not self and find is not None else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _ThenRegister(spec.loader, fullname)
                return spec
            if spec is not None:
                return spec
        return None


def install() -> None:
    """Register with each library already imported; watch for the others' import."""
    later = set()
    for library in REGISTER:
        if library in sys.modules:
            _register(library)
        else:
            later.add(library)
    _WATCHED.update(later)
    if later and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
