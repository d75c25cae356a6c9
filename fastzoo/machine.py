"""The machine a result was measured on, as every benchmark and accuracy run records it: the
results folder's name (``cpu-2core``, the GPU's name), the library versions, the load average."""
from __future__ import annotations

import os
import platform

import torch


def device_name(device: torch.device | str) -> str:
    """Folder name for results: "cpu-2core" or the GPU's name ("NVIDIA-H100-80GB-HBM3")."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-")
    return f"{device.type}-{os.cpu_count()}core"


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "torchvision", "timm", "transformers", "fastzoo"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            if pkg == "fastzoo":
                import fastzoo

                out[pkg] = fastzoo.__version__
    return out


def load_average() -> float:
    """The 1-minute load average (on a shared machine, how many others wanted the cores)."""
    return os.getloadavg()[0]
