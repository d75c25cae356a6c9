"""Shared base of the backends whose kernel lives in a third-party CUDA library.

Such a backend needs the library *and* a suitable GPU. :meth:`LibraryBackend.unavailable_reason`
names every missing piece at once (package with its install command, no CUDA device,
GPU too old), and, on a machine where everything is present, imports the library once to
catch a wheel built for another torch or CUDA: a backend reported available really runs.
The library is never imported on a machine that cannot use it.

:meth:`LibraryBackend.forward` maps the contract onto the two entry points these libraries
share, an equal-length ``[B, S, H, D]`` call (:meth:`dense`) and a packed ``[T, H, D]`` call
with ``cu_seqlens`` (:meth:`varlen`): packed batches go to ``varlen`` directly, a
key-padding mask is turned into packed sequences (:mod:`fastzoo.attention.packing`), and
anything else goes to ``dense``.
"""
from __future__ import annotations

import functools
import importlib

import torch

from fastzoo.attention.base import AttentionBackend, package_available
from fastzoo.attention.packing import from_THD, max_seqlen_of, repad, to_THD, unpad
from fastzoo.errors import BackendUnavailableError


@functools.lru_cache(maxsize=None)
def import_error(module: str) -> str | None:
    """Why ``import module`` fails here (first line of the error), or None if it imports."""
    try:
        importlib.import_module(module)
    except Exception as e:  # an extension built for another torch raises ImportError, OSError, RuntimeError...
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


class LibraryBackend(AttentionBackend):
    """A CUDA-only backend backed by the packages in ``capabilities.packages``."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        caps = cls.capabilities
        problems = []
        missing = [p for p in caps.packages if not package_available(p)]
        if missing:
            problems.append(
                f"needs the package(s) {', '.join(missing)}, which are not installed (install: `{caps.install}`)"
            )
        if not torch.cuda.is_available():
            problems.append("needs a CUDA GPU, and this machine has none")
        elif caps.min_cuda_capability and torch.cuda.get_device_capability() < caps.min_cuda_capability:
            need = ".".join(map(str, caps.min_cuda_capability))
            cc = ".".join(map(str, torch.cuda.get_device_capability()))
            problems.append(f"needs a GPU of compute capability >= {need}; this one is {cc}")
        if not problems:
            for p in caps.packages:
                err = import_error(p)
                if err:
                    problems.append(f"has {p} installed, but it does not import ({err}); reinstall it for this torch/CUDA")
        return "; ".join(problems) or None

    def check(self, req) -> None:
        super().check(req)  # declarations against the request; missing package or device
        reason = self.unavailable_reason()  # what only an import shows (a wheel built for another torch)
        if reason:
            raise BackendUnavailableError(self._message([reason]))

    # -- compute: route the contract's three cases to the library's two entry points -------------
    def dense(self, q_BSHD, k_BSHD, v_BSHD, *, causal: bool, scale: float | None, dropout_p: float):
        """Equal-length batch in the ``[B, S, H, D]`` layout these libraries share."""
        raise NotImplementedError

    def varlen(self, q_THD, k_THD, v_THD, cu_seqlens, max_seqlen: int, *, causal, scale, dropout_p):
        """Packed sequences: ``[T, H, D]`` tokens, ``cu_seqlens`` [N+1] int32 offsets."""
        raise NotImplementedError

    def forward(self, q_BHSD, k_BHSD, v_BHSD, ctx):
        kw = dict(causal=ctx.causal, scale=ctx.scale, dropout_p=ctx.dropout_p)
        if ctx.cu_seqlens is not None:
            if ctx.key_padding_mask is not None:
                raise ValueError(f"{self.name}: give packed sequences (cu_seqlens) or a key_padding_mask, not both")
            cu_seqlens = ctx.cu_seqlens.to(device=q_BHSD.device, dtype=torch.int32)
            max_seqlen = max_seqlen_of(cu_seqlens, ctx.max_seqlen)
            o_THD = self.varlen(to_THD(q_BHSD), to_THD(k_BHSD), to_THD(v_BHSD), cu_seqlens, max_seqlen, **kw)
            return from_THD(o_THD)
        q_BSHD, k_BSHD, v_BSHD = (x.transpose(1, 2) for x in (q_BHSD, k_BHSD, v_BHSD))
        if ctx.key_padding_mask is not None:
            # The kernels take no mask: attend over the real tokens only, packed, and scatter back.
            info, (q_THD, k_THD, v_THD) = unpad(ctx.key_padding_mask, q_BSHD, k_BSHD, v_BSHD)
            o_THD = self.varlen(q_THD, k_THD, v_THD, info.cu_seqlens, info.max_seqlen, **kw)
            return repad(o_THD, info).transpose(1, 2)
        return self.dense(q_BSHD, k_BSHD, v_BSHD, **kw).transpose(1, 2)
