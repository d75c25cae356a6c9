"""Compiled FlexAttention on CPU against uncompiled, in plain PyTorch: the reproducer behind
flex's CPU refusal.

PyTorch's C++ (CPU) flex template was reported to give wrong results in about half of the
runs with torch 2.14.1. This file reduces that claim to what fastzoo relies on: flex compiled
with ``torch.compile`` equals flex run eagerly, for a causal mask and for a per-batch padding
mask whose captured tensor changes between calls (the forms fastzoo's masks take), on fresh
random inputs each call. It imports torch only, so it can go upstream as is.

    python -m fastzoo.attention.flex_cpu_repro      # prints the verdict and stores it

The verdict is stored per torch version under ``$FASTZOO_CACHE_DIR`` (default
``~/.cache/fastzoo``). fastzoo serves compiled flex on CPU only for a torch whose stored
verdict is ``correct``; with none, or ``wrong``, it refuses, naming this command. So the
refusal lifts itself on a torch where compiled and uncompiled flex agree, and stays where
they do not.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

TOL = 1e-4  # fp32: compiled and eager flex differ by summation order only (observed ~5e-7)


def run(trials: int = 3) -> dict:
    """Compare compiled and eager flex ``trials`` times per mask; the verdict and the errors."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 2, 2, 48, 16
    errors = {}
    for form in ("causal", "padding"):
        errors[form] = []
        for _ in range(trials):
            lengths = torch.randint(8, S + 1, (B,), generator=g)
            valid = torch.arange(S)[None, :] < lengths[:, None]  # captured by the mask: new values each call

            def mask_mod(b, h, q, k):
                return (q >= k) & valid[b, k] if form == "padding" else q >= k

            block_mask = create_block_mask(mask_mod, B if form == "padding" else None, None, S, S, device="cpu")
            q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
            real = valid[:, None, :, None] if form == "padding" else torch.ones(1, 1, S, 1, dtype=torch.bool)
            diff = (compiled(q, k, v, block_mask=block_mask) - flex_attention(q, k, v, block_mask=block_mask)) * real
            errors[form].append(float(diff.abs().max()))
    wrong = sum(e > TOL for errs in errors.values() for e in errs)
    runs = sum(len(errs) for errs in errors.values())
    return {"torch": torch.__version__, "verdict": "wrong" if wrong else "correct", "wrong": wrong, "runs": runs,
            "max_error": errors}


def cache_path() -> Path:
    root = Path(os.environ.get("FASTZOO_CACHE_DIR") or Path.home() / ".cache" / "fastzoo")
    return root / f"flex_cpu_compiled-torch-{torch.__version__}.json"


def stored_verdict() -> dict | None:
    """The verdict stored for this torch, or None (never run here, or unreadable)."""
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    result = run()
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, path)  # a reader never sees half a verdict
    print(json.dumps(result))
    return 0 if result["verdict"] == "correct" else 1


if __name__ == "__main__":
    sys.exit(main())
