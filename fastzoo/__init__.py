"""fastzoo: reference architectures equal to timm / Hugging Face / torchvision, with the
attention kernel picked by one word. See README.md and DESIGN.md."""
from fastzoo import data, errors
from fastzoo.attention import get_backend, list_attention, register_attention
from fastzoo.registry import create, list_models
from fastzoo.weights import export_state_dict, load_pretrained

__version__ = "0.1.0"

__all__ = [
    "create", "data", "errors", "export_state_dict", "get_backend", "list_attention",
    "list_models", "load_pretrained", "register_attention",
]
