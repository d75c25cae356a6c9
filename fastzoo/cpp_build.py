"""fastzoo's C++ kernels built on first use (``torch.utils.cpp_extension.load``), in one place.

A kernel's module (the fused GIoU loss, the fused deformable attention) calls :func:`build` once
and falls back, with a warning from :func:`failure_text`, when it raises. The build needs a C++
compiler and ninja; it is cached in torch's extensions directory, so later processes only load it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def build(name: str, source: Path, *, extra_cflags: tuple[str, ...] = (), extra_ldflags: tuple[str, ...] = ()) -> None:
    """Compile and load ``source`` as the torch library ``name`` (its ``TORCH_LIBRARY`` registrations
    become ``torch.ops``); raises whatever the build raises."""
    if shutil.which("ninja") is None:  # the PyPI ninja wheel puts it beside python, maybe not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load

    load(name, sources=[str(source)], extra_cflags=list(extra_cflags), extra_ldflags=list(extra_ldflags),
         is_python_module=False)


def failure_text(e: Exception) -> str:
    """A failed build in one warning-sized text: a build log ends with its cause."""
    why = str(e) if len(str(e)) < 800 else f"{str(e)[:300]} ... {str(e)[-500:]}"
    return f"{type(e).__name__}: {why}"
