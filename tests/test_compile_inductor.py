"""torch.compile's default backend (inductor) on the image models, on the CPU.

tests/test_peer_api.py::test_compile_fullgraph proves dynamo captures each forward whole
(``backend="eager"``); this runs the code inductor generates from it, once per family at a
tiny size. Inductor's CPU code is C++: without a compiler the test is skipped, saying so.
The first run on a machine compiles (tens of seconds); inductor caches the result on disk.
"""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_of

import fastzoo


def _cpp_compiler() -> str | None:
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        return get_cpp_compiler()
    except Exception:  # torch raises its own error types per platform when no compiler is found
        return None


@pytest.mark.skipif(_cpp_compiler() is None, reason="inductor's CPU backend needs a C++ compiler (g++/clang++); none found")
@pytest.mark.parametrize("name", ["vit_s16", "resnet50"])
def test_inductor_fullgraph_computes_eagers_logits(name):
    """fp32 CPU, 1e-4 (fastzoo.equivalence's rule): inductor fuses and reorders float ops, so not bit for bit."""
    torch.manual_seed(0)
    m = fastzoo.create(name, **tiny_of(name)).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        out, ref = compiled(x), m(x)
    assert (out - ref).abs().max().item() <= 1e-4
