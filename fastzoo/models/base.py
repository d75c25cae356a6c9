"""What every fastzoo model shares: a config, a swappable attention backend, save/load."""
from __future__ import annotations

import dataclasses
import json
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from fastzoo.attention import AttnRequest, default_backend, get_backend
from fastzoo.errors import UnservedInputError
from fastzoo.models.config import ModelConfig  # noqa: F401  (each model file's config base)
from fastzoo.tracing import tracing

_SLOT_LOCK = threading.Lock()


class FastzooModel(nn.Module):
    """Base of the zoo's models. Subclasses set ``family`` and implement ``attention_needs``."""

    family: str = "?"
    config_class: type = ModelConfig
    model_name: str | None = None

    def adapt_checkpoint(self, state: dict, changed: set[str]) -> tuple[dict, list[str], list[str]]:
        """Fit a converted checkpoint to config fields the user changed on purpose
        (``changed``). Returns the state, the keys left freshly initialised, and notes."""
        return state, [], []

    def attention_needs(self) -> dict:
        """head_dim / causal / padding_mask / varlen this model asks of a backend."""
        return {}

    def attention_request(self, device: str | None = None, dtype: torch.dtype | None = None) -> AttnRequest:
        """What the model needs; device/dtype are those given, else the parameters' when not the default cpu/fp32
        (a meta device says nothing: the model gets its real device later, with ``to_empty``).

        Whether a backward will be asked is not known here (a fresh model is in train mode
        even for inference), so backends check that per call, before running. The attention
        dropout the layers are configured with is part of the request: a backend without
        dropout is refused for such a model, naming the config field to set to 0; so is a
        layer's ``sliding_window`` (backends without ``window`` are refused) and ``softcap``, and
        whether the layers run inside non-reentrant gradient checkpointing (:meth:`attention_checkpointed`).
        """
        from fastzoo.layers.attention import UsesAttention

        p = next(self.parameters(), None)
        if device is None and p is not None and p.device.type != "cpu":
            device = p.device.type
        if device == "meta":  # built without storage (big-model init): the real device comes with to_empty()
            device = None
        if dtype is None and p is not None and p.dtype != torch.float32:
            dtype = p.dtype
        layers = [m for m in self.modules() if isinstance(m, UsesAttention)]
        most = max(layers, key=lambda m: m.attn_dropout_p, default=None)
        dropout = {} if most is None else {"attn_dropout": most.attn_dropout_p, "attn_dropout_field": most.attn_dropout_field}
        window = {"window": True} if any(m.sliding_window is not None for m in layers) else {}
        softcap = {"softcap": True} if any(m.softcap is not None for m in layers) else {}
        return AttnRequest(device=device, dtype=dtype, checkpoint=self.attention_checkpointed(),
                           **{**dropout, **window, **softcap, **self.attention_needs()})

    def attention_checkpointed(self) -> bool:
        """Whether the attention layers run inside non-reentrant ``torch.utils.checkpoint`` (a family
        with gradient checkpointing says)."""
        return False

    def check_checkpointing(self, non_reentrant: bool) -> None:
        """A family's gradient-checkpointing switch asks this before it turns checkpointing on: a
        backend that cannot run inside the non-reentrant kind is refused here, by name
        (``BackendUnavailableError``), and nothing changes; ``set_attention`` refuses it the other
        way round."""
        backend = self.attention_backend
        if non_reentrant and backend is not None:
            backend.check(dataclasses.replace(self.attention_request(), checkpoint=True))

    def set_attention(self, name: str | None, *, device=None, dtype=None, **options) -> "FastzooModel":
        """Switch every attention layer to backend ``name`` (options are the backend's own; None: the
        default, SDPA unless it cannot serve this model, ``fastzoo.attention.default_backend``).

        The backend is built and checked against this model's needs first; nothing changes
        if it fails. The switch is one assignment to the slot all layers share, so threads
        sharing the model see either the old backend everywhere or the new one everywhere;
        a forward already running finishes on the backend it started with.
        """
        from fastzoo.layers.attention import UsesAttention

        layers = [m for m in self.modules() if isinstance(m, UsesAttention)]
        device = torch.device(device).type if device is not None else None
        if name is None:
            name = default_backend(self.attention_request(device=device, dtype=dtype)) if layers else "sdpa"
        backend = get_backend(name, **options)
        if not layers:
            return self  # no attention layers (a ResNet): nothing to check or switch
        backend.check(self.attention_request(device=device, dtype=dtype))
        slot = self._attention_slot()
        for m in layers:
            if m.slot is not slot:
                m.slot = slot
        slot.current = (name, backend)
        return self

    def _attention_slot(self):
        from fastzoo.layers.attention import AttentionSlot

        with _SLOT_LOCK:  # two threads' first set_attention must not make two slots
            slot = self.__dict__.get("_attn_slot")
            if slot is None:
                slot = self.__dict__["_attn_slot"] = AttentionSlot(None, None)
        return slot

    @property
    def attn_name(self) -> str | None:
        slot = self.__dict__.get("_attn_slot")
        return None if slot is None else slot.current[0]

    @property
    def attention_backend(self):
        """The backend this thread's forward runs on (the one current when it started), else the current one."""
        slot = self.__dict__.get("_attn_slot")
        return None if slot is None else slot.active[1]

    def __call__(self, *args, **kwargs):
        # one forward, one backend: a set_attention from another thread meanwhile applies from the next call
        slot = self.__dict__.get("_attn_slot")
        if slot is None or tracing():
            return super().__call__(*args, **kwargs)
        with slot.pinned():
            return super().__call__(*args, **kwargs)

    def extra_config(self) -> dict:
        """Keys config.json carries for other readers (timm's hub format for image classifiers)."""
        return {}

    def save_pretrained(self, path) -> Path:
        """Write ``config.json`` (the architecture) and ``model.safetensors`` (fastzoo keys),
        each replaced atomically (see :func:`write_pretrained`)."""
        meta = {"fastzoo_model": self.model_name, "family": self.family, **self.config.to_dict(), **self.extra_config()}
        return write_pretrained(path, meta, self.state_dict())


@contextmanager
def statistics_kept_on_error(model: nn.Module):
    """BatchNorm's running statistics put back as they were when the block raises, so that a call refused after
    its forward (a detector's label values, checked with the set loss's one host read) changes nothing: one copy
    on the device per call, for the layers in train mode (none in eval mode)."""
    stats = [t for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
             and m.track_running_stats for t in (m.running_mean, m.running_var, m.num_batches_tracked)]
    saved = [torch.empty_like(t) for t in stats]
    if stats:
        torch._foreach_copy_(saved, stats)
    try:
        yield
    except Exception:
        if stats:
            torch._foreach_copy_(stats, saved)
        raise


def refuse_inputs(model: str, unserved: dict, unknown: dict, why: str = "") -> None:
    """The rule every forward keeps: no input is silently ignored. ``unserved``: keywords of the
    original's signature this model does not serve, refused when given a value (not None / False);
    ``unknown``: keywords the original's signature does not have, refused whatever their value.
    :class:`~fastzoo.errors.UnservedInputError` (a ``ValueError``) naming the first one (``why``: what
    the model serves instead)."""
    for name, value in unserved.items():
        if value is not None and value is not False:
            raise UnservedInputError(f"{name}=: fastzoo's {model} does not serve it{'; ' + why if why else ''}")
    for name in unknown:
        raise UnservedInputError(f"{name}=: {model}.forward() has no such keyword (the original's signature has none "
                                 f"either)")


def write_pretrained(path, config: dict, state: dict, weights_format: str = "fastzoo") -> Path:
    """``config.json`` + ``model.safetensors`` in directory ``path`` (other files there are
    kept, as Hugging Face's ``save_pretrained`` keeps a tokenizer's). Both are written to
    temporary files first and renamed in only once both are complete, so a failure (a full
    disk, a kill) leaves the previous pair. A shard index left by an earlier sharded save is
    removed with its shards: readers prefer an index, which would shadow the new weights.
    ``weights_format`` goes in the safetensors metadata (transformers wants ``"pt"``)."""
    from safetensors.torch import save_file

    from fastzoo import files
    from fastzoo.weights import stale_shard_files, untied

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file; save_pretrained writes a directory")
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):  # temporaries of a writer killed before its rename
        for stale in path.glob(f".{name}.*{files.TMP_SUFFIX}"):
            stale.unlink(missing_ok=True)
    tensors = untied({k: v.detach().contiguous().cpu() for k, v in state.items()})
    with files.atomic_path(path / "config.json") as config_tmp, files.atomic_path(path / "model.safetensors") as weights_tmp:
        save_file(tensors, str(weights_tmp), metadata={"format": weights_format})
        config_tmp.write_text(json.dumps(config, indent=2))
    for stale in stale_shard_files(path):
        stale.unlink(missing_ok=True)
    return path
