"""The attention registry: one word picks a kernel.

Built-in backends are named here by import path and imported on first use, so that
``import fastzoo`` never imports a kernel library. Users add their own with
:func:`register_attention`.
"""
from __future__ import annotations

import importlib
from typing import Callable

from fastzoo.attention.availability import unavailable
from fastzoo.attention.base import (
    AttentionBackend,
    AttnContext,
    AttnRequest,
    Capabilities,
    FUNCTION_DEFAULT_CAPABILITIES,
    FunctionBackend,
)
from fastzoo.errors import UnknownBackendError

_BUILTIN = {
    "eager": "fastzoo.attention.eager:EagerBackend",
    "sdpa": "fastzoo.attention.sdpa:SdpaBackend",
    "flex": "fastzoo.attention.flex:FlexBackend",
    "fa2": "fastzoo.attention.flash:Fa2Backend",
    "fa3": "fastzoo.attention.flash:Fa3Backend",
    "fa4": "fastzoo.attention.fa4:Fa4Backend",
    "te": "fastzoo.attention.te:TeBackend",
    "xformers": "fastzoo.attention.xformers:XformersBackend",
    "nested": "fastzoo.attention.nested:NestedBackend",
    "varlen": "fastzoo.attention.varlen:VarlenBackend",
    "neuron": "fastzoo.attention.neuron:NeuronBackend",
}
_REGISTRY: dict[str, type[AttentionBackend] | str] = dict(_BUILTIN)


def register_attention(
    name: str,
    backend: type[AttentionBackend] | Callable,
    *,
    capabilities: Capabilities | None = None,
    overwrite: bool = False,
) -> None:
    """Add a backend under ``name``.

    ``backend`` is an :class:`AttentionBackend` subclass, or a function
    ``fn(q_BHSD, k_BHSD, v_BHSD, ctx) -> o_BHSD``. A function registered without
    ``capabilities`` gets :data:`~fastzoo.attention.base.FUNCTION_DEFAULT_CAPABILITIES`:
    cpu and cuda, fp32/bf16/fp16, and none of causal, padding mask, packed sequences,
    score_mod or dropout, since a function that ignores ``ctx`` would silently drop them.
    A model that needs one of those (GPT-2 needs causal) is then refused at ``create`` /
    ``set_attention``; declare what the function honours with ``capabilities=Capabilities(...)``.
    """
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"attention backend {name!r} is already registered; pass overwrite=True to replace it")
    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        if capabilities is not None:
            backend = type(backend.__name__, (backend,), {"capabilities": capabilities})
        _REGISTRY[name] = type(backend.__name__, (backend,), {"name": name})
        return
    if not callable(backend):
        raise TypeError(f"backend must be an AttentionBackend subclass or a function, got {type(backend).__name__}")
    if capabilities is None:
        capabilities = FUNCTION_DEFAULT_CAPABILITIES
    _REGISTRY[name] = type(
        f"{name}Backend", (FunctionBackend,), {"name": name, "capabilities": capabilities, "fn": staticmethod(backend)}
    )


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise UnknownBackendError(name, _REGISTRY)
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module, cls = entry.split(":")
        entry = _REGISTRY[name] = getattr(importlib.import_module(module), cls)
    return entry


def get_backend(name: str, **options) -> AttentionBackend:
    """A configured backend instance; options are the backend's own (see ``fastzoo list``)."""
    return backend_class(name)(**options)


def list_attention(available_only: bool = False) -> list[str]:
    names = sorted(_REGISTRY)
    if available_only:
        names = [n for n in names if backend_class(n).is_available()]
    return names


AttentionBackend.available_here = staticmethod(lambda: list_attention(available_only=True))

# What a model gets when no backend is named: SDPA, or where SDPA cannot serve the model
# (soft-capped scores: Gemma 2) the first of these that can.
DEFAULT_BACKENDS = ("sdpa", "varlen", "eager")


def default_backend(req: AttnRequest) -> str:
    """The backend a model gets when none is named (:data:`DEFAULT_BACKENDS`); "sdpa" when none
    of them serves ``req``, whose refusal then names what is missing."""
    return next((name for name in DEFAULT_BACKENDS if not get_backend(name).problems(req)), DEFAULT_BACKENDS[0])


__all__ = [
    "AttentionBackend", "AttnContext", "AttnRequest", "Capabilities",
    "backend_class", "capability_matrix", "default_backend", "get_backend", "list_attention", "register_attention",
]


MATRIX_COLUMNS = ("backend", "available here", "devices: dtypes", "causal", "padding mask", "varlen",
                  "kv cache", "gqa", "window", "softcap", "score_mod", "dropout", "backward", "checkpoint", "compile",
                  "head dim", "verified")


def capability_matrix() -> list[dict]:
    """One row per backend and per variant its options pick (``sdpa_backend=``, varlen's ``impl=``),
    from the backends' own declarations (README and `fastzoo list`)."""
    rows = []
    for name in list_attention():
        cls = backend_class(name)
        for options in ({}, *cls.variants):
            label = name + "".join(f" ({k}={v})" for k, v in options.items())
            rows.append(_matrix_row(label, cls(**options)))
    return rows


def _matrix_row(label: str, backend: AttentionBackend) -> dict:
    caps = backend.capabilities  # an instance may declare what this machine serves (varlen's automatic pick)
    reason = unavailable(caps)
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    head = f"<= {caps.max_head_dim}" if caps.max_head_dim else "any"
    if caps.head_dim_multiple > 1:
        head += f", multiple of {caps.head_dim_multiple}"
    for device, least, multiple in caps.head_dim_on:
        head += "; on " + device + ": " + ", ".join(w for w in (f">= {least}" if least > 1 else "",
                                                               f"multiple of {multiple}" if multiple > 1 else "") if w)
    return {
        "backend": label,
        "available here": "yes" if reason is None else f"no: {reason}",
        "devices: dtypes": caps.dtypes_text(),
        "causal": yes(caps.causal),
        "padding mask": "yes" if caps.padding_mask else "unpadded by the model" if caps.varlen else "no",
        "varlen": yes(caps.varlen),
        "kv cache": yes(caps.kv_cache),
        "gqa": "native" if caps.gqa else "k/v repeated",
        "window": yes(caps.window),
        "softcap": yes(caps.softcap),
        "score_mod": yes(caps.score_mod),
        "dropout": yes(caps.dropout),
        "backward": "/".join(caps.backward) or "no",
        "checkpoint": "yes" if caps.checkpoint else "reentrant only",
        "compile": yes(caps.compile),
        "head dim": head,
        "verified": caps.verified,
    }
