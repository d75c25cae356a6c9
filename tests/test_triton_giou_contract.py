"""The Triton GIoU kernels on CPU: every dtype pair, mask form and reduction under Triton's
interpreter (TRITON_INTERPRET=1), against the fused op's CPU path; launches on the tensors'
own GPU; int64 offsets."""
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_every_dtype_pair_mask_and_reduction_in_the_interpreter():
    """One subprocess (the interpreter is chosen when triton is imported). The reference is the
    fused op's CPU path (the C++ kernel, or its vectorised form where no compiler is found):
    the same arithmetic, so a few ulp; bf16/fp16 gradients are stored in their dtype."""
    code = textwrap.dedent("""
        import itertools, torch
        from fastzoo.losses.kernels import giou_op, triton_giou
        g = torch.Generator().manual_seed(0)
        B, M = 3, 5
        mask = torch.arange(M)[None, :] < torch.tensor([0, 3, 5])[:, None]
        xy = torch.rand(B, M, 2, generator=g)
        p = torch.cat([xy, xy + 0.1 + torch.rand(B, M, 2, generator=g)], -1)
        xy = torch.rand(B, M, 2, generator=g)
        t = torch.cat([xy, xy + 0.1 + torch.rand(B, M, 2, generator=g)], -1)
        t[~mask] = torch.tensor([0.0, 0.0, -1.0, -1.0])  # padding as an inverted box (the mask-free form)
        dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        for pdt, tdt in itertools.product(dtypes, dtypes):
            a, b = p.to(pdt), t.to(tdt)
            ref = giou_op.giou_loss_fwd(a, b, 1e-7)
            out = triton_giou.forward(a.contiguous(), b.contiguous(), 1e-7)
            assert out.dtype == ref.dtype, (pdt, tdt, out.dtype, ref.dtype)
            tol = 1e-12 if ref.dtype == torch.float64 else 1e-6
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
            w = torch.linspace(-1, 2, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
            gtol = dict(rtol=2 ** -7, atol=1e-3) if torch.bfloat16 in (pdt, tdt) or torch.float16 in (pdt, tdt) else dict(rtol=1e-5, atol=tol)
            for x, y in zip(triton_giou.backward(w, a, b, 1e-7), giou_op.giou_loss_bwd(w, a, b, 1e-7)):
                assert x.dtype == y.dtype
                torch.testing.assert_close(x, y, **gtol)
            for m, red in itertools.product((mask, None), (0, 1, 2)):
                ref = giou_op.giou_loss_masked(a, b, m, 1e-7, red)
                out = triton_giou.masked_forward(a, b, m, 1e-7, red)
                assert out.dtype == ref.dtype and out.shape == ref.shape
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
                grad = torch.linspace(-1, 2, ref.numel(), dtype=ref.dtype).reshape(ref.shape)
                gref = giou_op.giou_loss_masked_bwd(grad, a, b, m, 1e-7, red, True, True)
                for x, y in zip(triton_giou.masked_backward(grad, a, b, m, 1e-7, red, True, True), gref):
                    assert x.dtype == y.dtype and torch.isfinite(x).all()
                    torch.testing.assert_close(x, y, **gtol)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@needs_triton
def test_a_launch_runs_on_its_tensors_gpu(monkeypatch):
    """Triton launches on the current GPU: a tensor on cuda:1 must be launched under cuda:1."""
    from fastzoo.losses.kernels import triton_giou

    entered, seen = [], []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.pop()

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append(list(entered))

    monkeypatch.setattr(torch.cuda, "device", Guard)
    triton_giou._launch(Kernel(), 10, torch.device("cuda", 1))
    assert seen == [[torch.device("cuda", 1)]]


@needs_triton
def test_offsets_are_int64():
    """Past 2^29 boxes the element offsets (row * 4) pass 2^31: every kernel takes its rows from
    block_rows, which is int64 (a static assert inside it; the interpreter test runs it)."""
    import ast

    tree = ast.parse((ROOT / "fastzoo/losses/kernels/triton_giou.py").read_text())
    kernels = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.endswith("_kernel")]
    assert kernels
    for f in kernels:
        src = ast.unparse(f)
        assert "block_rows(BLOCK)" in src and "program_id(0) * BLOCK" not in src, f.name
    assert "tl.int64" in ast.unparse(next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "block_rows"))
