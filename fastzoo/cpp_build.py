"""fastzoo's C++ kernels built on first use (``torch.utils.cpp_extension.load``), in one place.

A kernel's module (the fused GIoU loss, the fused deformable attention) calls :func:`build` once
and falls back, with a warning from :func:`failure_text`, when it raises. The build needs a C++
compiler and ninja; it is cached in torch's extensions directory under the kernel's name keyed by
torch's version, the C++ compiler, Python and the source file (its path and text: ninja rebuilds
for another path) (:func:`build_name`), so environments and checkouts that share the directory
never rebuild each other's, and later processes only load it (:func:`is_built` says
whether a first use will compile, so that a script can announce the wait).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path


def build_name(name: str, source: Path) -> str:
    """``name`` with a key of torch's version, the C++ compiler (``$CXX`` and its ``--version``), Python
    and ``source`` (its path and text)."""
    import torch

    source = Path(source).resolve()
    text = hashlib.sha256(source.read_bytes()).hexdigest()
    return f"{name}_{_key(torch.__version__, os.environ.get('CXX', 'c++'), sys.version, str(source), text)}"


@cache
def _key(torch_version: str, cxx: str, python: str, source: str, text: str) -> str:
    try:
        compiler = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        compiler = ""  # no compiler: the build fails and says so
    return hashlib.sha256("\n".join((torch_version, cxx, compiler, python, source, text)).encode()).hexdigest()[:16]


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported without its import-time notice on a machine without
    CUDA ("No CUDA runtime is found, using CUDA_HOME=..."), which says nothing about a CPU build."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension as cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _directory(keyed: str) -> Path:
    return Path(_cpp_extension().get_default_build_root()) / keyed


def is_built(name: str, source: Path) -> bool:
    """Whether the kernel ``name`` of ``source`` is in the build cache for this torch, compiler and Python."""
    keyed = build_name(name, source)
    return (_directory(keyed) / f"{keyed}.so").is_file()


def build(name: str, source: Path, *, extra_cflags: tuple[str, ...] = (), extra_ldflags: tuple[str, ...] = ()) -> None:
    """Compile and load ``source`` as the torch library ``name`` (its ``TORCH_LIBRARY`` registrations
    become ``torch.ops``); raises whatever the build raises."""
    if shutil.which("ninja") is None:  # the PyPI ninja wheel puts it beside python, maybe not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    keyed = build_name(name, source)
    directory = _directory(keyed)
    directory.mkdir(parents=True, exist_ok=True)
    _cpp_extension().load(keyed, sources=[str(source)], build_directory=str(directory), extra_cflags=list(extra_cflags),
         extra_ldflags=list(extra_ldflags), is_python_module=False)


def failure_text(e: Exception) -> str:
    """A failed build in one warning-sized text: a build log ends with its cause."""
    why = str(e) if len(str(e)) < 800 else f"{str(e)[:300]} ... {str(e)[-500:]}"
    return f"{type(e).__name__}: {why}"
