"""Whether a backend can run on this machine: its packages installed and importable, its
device present, the GPU generation it needs. Kept apart from the contract (:mod:`base`), which
says what a backend *can serve*; this module says what *this machine* has. Every answer is
cached per process: none of it changes while a process runs.
"""
from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import sys

import torch


def package_available(name: str) -> bool:
    """Whether module ``name`` (dotted: the submodule a backend calls) is installed, found
    without importing it or its parents (``importlib.util.find_spec`` would import the parents:
    a kernel library's ``__init__`` on a machine that cannot use it)."""
    parts = name.split(".")
    try:
        top = sys.modules.get(parts[0])
        spec = top.__spec__ if top is not None else importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None or spec.submodule_search_locations is None:
                return False
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
        return spec is not None
    except (ImportError, ValueError, AttributeError):
        return False


def unavailable(caps) -> str | None:
    """Why a backend with these capabilities (:class:`~fastzoo.attention.base.Capabilities`) cannot run on this machine at all, naming every
    missing piece (package with its install command, device, GPU generation), or None.

    Where nothing is missing it imports the packages once, to catch a wheel built for another
    torch or CUDA: a backend reported available really runs. A package is never imported on
    a machine that cannot use it. Cached: none of this changes within a process, and per-call
    kernel choice (``varlen``) asks it on every forward.
    """
    return _unavailable(caps.packages, caps.install, tuple(caps.devices), caps.min_cuda_capability, caps.kernels_loaded)


@functools.lru_cache(maxsize=None)
def _unavailable(packages, install, devices, min_cuda_capability, kernels_loaded=None) -> str | None:
    problems = []
    missing = [p for p in packages if not package_available(p)]
    if missing:
        how = f" (install: `{install}`)" if install else ""
        problems.append(f"needs the package(s) {', '.join(missing)}, which are not installed{how}")
    if not any(device_present(d) for d in devices):
        need = " or ".join(_DEVICE_WORDS.get(d, f"a {d} device") for d in devices)
        problems.append(f"runs on {'/'.join(devices)} only: needs {need}, and this machine has none")
    elif min_cuda_capability and set(devices) == {"cuda"} and torch.cuda.get_device_capability() < min_cuda_capability:
        need, cc = (".".join(map(str, v)) for v in (min_cuda_capability, torch.cuda.get_device_capability()))
        problems.append(f"needs a GPU of compute capability >= {need}; this one is {cc}")
    if not problems:
        for p in packages:
            try:
                importlib.import_module(p)
            except Exception as e:  # an extension built for another torch raises ImportError, OSError, RuntimeError...
                first = str(e).splitlines()[0] if str(e) else ""
                problems.append(f"has {p} installed, but it does not import ({type(e).__name__}: {first}); "
                                "reinstall it for this torch/CUDA")
    if not problems and kernels_loaded:
        module, attr = kernels_loaded.split(":")
        if not getattr(importlib.import_module(module), attr, False):
            problems.append(f"has {module} installed, but its compiled kernels do not load ({module}.{attr} is false: "
                            f"a wheel built for another torch/CUDA than torch {torch.__version__}); reinstall it for this torch/CUDA")
    return "; ".join(problems) or None


_DEVICE_WORDS = {"cuda": "a CUDA GPU", "xla": "an XLA device (AWS Trainium/Inferentia2 through torch-neuronx)"}


def device_present(device_type: str) -> bool:
    """Whether this machine has a device of ``device_type`` ("cpu", "cuda", "xla", ...)."""
    if device_type == "cpu":
        return True
    if device_type == "cuda":
        return torch.cuda.is_available()
    if device_type == "xla":  # torch has no torch.xla; torch_xla provides the device (not imported here: it is heavy)
        return package_available("torch_xla")
    mod = getattr(torch, device_type, None)
    return bool(mod is not None and getattr(mod, "is_available", lambda: False)())
