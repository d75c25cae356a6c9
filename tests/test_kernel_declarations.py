"""What backends declare about themselves, against what their kernels really do.

``fastzoo.explain`` asks each backend what its kernels look like in a profiler trace; the
capability rule is one function; availability probes import the module the backend calls.
Each test fails on a mis-declaration a GPU user would otherwise meet first.
"""
import ast
import re
from pathlib import Path

import pytest
import torch

import fastzoo
from fastzoo.attention import AttnContext, backend_class, get_backend, list_attention
from fastzoo.attention.base import unavailable
from fastzoo.kernel_report import _attention_ops, _ran_as_asked

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = [n for n in list_attention() if backend_class(n).__module__.startswith("fastzoo.attention.")]


def _qkv(device="cpu", dtype=torch.float32, S=4, D=16):
    q = torch.zeros(1, 2, S, D, device=device, dtype=dtype)
    return q, q, AttnContext()


# -- explain asks the backends ----------------------------------------------------------------------
def test_kernel_report_names_no_backend():
    """A new built-in backend must not need an edit of kernel_report to be explained."""
    tree = ast.parse((ROOT / "fastzoo/kernel_report.py").read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    named = sorted(strings & set(BUILTIN))
    assert not named, f"kernel_report names backends {named}: ask the backend (kernel_ops / kernel_profile)"


@pytest.mark.parametrize("name", [n for n in BUILTIN if n != "eager"])
def test_every_builtin_backend_declares_its_kernel_ops(name):
    cls = backend_class(name)
    assert cls.kernel_ops, f"{name} declares no kernel_ops: explain could not tell its kernel from a fallback"
    assert re.compile(cls.kernel_ops)
    assert _attention_ops().search("x") is None  # the union recognises kernels, not any op


def test_eager_is_checked_as_plain_ops():
    profile = get_backend("eager").kernel_profile(*_qkv())
    assert profile.checked and profile.ops is None
    assert _ran_as_asked(profile, ["aten::bmm", "aten::softmax"]) is None
    assert _ran_as_asked(profile, ["aten::_scaled_dot_product_flash_attention_for_cpu"])


@pytest.mark.parametrize("op", ["aten::_efficient_attention_forward", "aten::_efficient_attention_backward"])
def test_xformers_cutlass_kernel_is_its_own(op):
    """xFormers runs fp32 (and fp16/bf16 without its flash op) through the CUTLASS kernel that
    PyTorch also ships: aten::_efficient_attention_forward is xFormers' kernel, not a fallback."""
    profile = get_backend("xformers").kernel_profile(*_qkv())
    assert _attention_ops().search(op)
    assert _ran_as_asked(profile, [op]) is None


def test_sdpa_math_fallback_says_why():
    q, k, ctx = _qkv()
    profile = get_backend("sdpa").kernel_profile(q, k, AttnContext(dropout_p=0.1))
    assert "takes no dropout" in _ran_as_asked(profile, ["aten::_scaled_dot_product_attention_math"])
    assert _ran_as_asked(profile, ["aten::_scaled_dot_product_flash_attention_for_cpu"]) is None


def test_a_user_backend_is_reported_unchecked(monkeypatch):
    import fastzoo.attention as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    fastzoo.register_attention("mine_profile", lambda q, k, v, ctx: q)
    assert not get_backend("mine_profile").kernel_profile(*_qkv()).checked
