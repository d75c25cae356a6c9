"""fastzoo: reference architectures equal to timm / Hugging Face / torchvision, with the
attention kernel picked by one word. See README.md and ARCHITECTURE.md.

``fastzoo.losses`` and ``fastzoo.data`` (with ``fastzoo.data.boxes``) come with
``import fastzoo``; ``fastzoo.train`` (torch.distributed, checkpoint I/O: ~1 s more to
import) is loaded on first use of the attribute. No kernel library is imported here, nor timm
or torchvision: their factories learn fastzoo's names when the user imports them (``factories``)."""
import importlib

from fastzoo import data, errors, factories, losses
from fastzoo.attention import get_backend, list_attention, register_attention
from fastzoo.kernel_report import explain
from fastzoo.registry import create, export_state_dict, list_models, load_pretrained

__version__ = "0.1.0"

factories.install()  # fastzoo_<name> in timm's and torchvision's factories, once the user imports them

__all__ = [
    "create", "data", "errors", "explain", "export_state_dict", "get_backend", "list_attention",
    "list_models", "load_pretrained", "losses", "register_attention", "train",
]


def __getattr__(name: str):
    if name == "train":  # PEP 562: imported on first access, then a plain attribute
        return importlib.import_module("fastzoo.train")
    raise AttributeError(f"module 'fastzoo' has no attribute {name!r}")
