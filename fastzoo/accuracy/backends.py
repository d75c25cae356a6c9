"""Accuracy parity across attention backends: one initialisation fine-tuned with each.

Speed is worthless if a kernel changes what a model learns. A small vision transformer (``MODEL``
at the size ``SMALL`` gives it) learns a synthetic task (which quadrant of a noisy image is
brighter) for a few hundred steps from identical weights, data and data order, once per attention
backend: ``fastzoo bench vit_s16 --parity-train``. It is
an accuracy run (:mod:`fastzoo.accuracy.runs`) built here instead of read from a file, so it is
judged by the same rule: eager in fp32 is the first arm (the reference); in low precision (bf16
on a GPU) eager in that dtype is the precision's peer, and every backend in it may differ from
the fp32 reference by ``LOW_FACTOR`` times the peer's difference plus the fp32 tolerance
(:mod:`fastzoo.equivalence`).
"""
from __future__ import annotations

import torch

from fastzoo.accuracy.config import Arm, Data, Optim, RunConfig, Tolerance
from fastzoo.accuracy.report import AccuracyReport
from fastzoo.accuracy.runs import run
from fastzoo.equivalence import FP32_GRAD_RTOL
from fastzoo.text import dtype_name

MODEL = "vit_s16"  # the model --parity-train fine-tunes, at the size SMALL gives it
# Small enough to train a few hundred steps on a 2-core CPU in well under a minute (timm's names).
SMALL = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=4, global_pool="avg",
                 class_token=False)
TOLERANCE = Tolerance(
    train_loss=0.05,  # free-running fp32 curves: rounding differences compound over the run, within this
    eval_loss=0.05,
    eval_metric=0.02,  # a few held-out images flipping near the decision boundary
    same_weights_loss=1e-5,  # from the reference's weights, one batch: the same function, to rounding
    same_weights_grad=FP32_GRAD_RTOL,
)


def backend_parity_config(backends: list[str], *, steps: int = 300, batch_size: int = 32, lr: float = 1e-3,
                          dtype: torch.dtype = torch.float32, seed: int = 0, held_out: int = 512) -> RunConfig:
    """The run: eager in fp32 first, then (low precision) eager in ``dtype``, then every other backend in ``dtype``."""
    if steps < 1:
        raise ValueError(f"steps={steps}: train at least one step")
    amp = None if dtype == torch.float32 else dtype_name(dtype)
    arms = [Arm("eager", attn="eager")] + ([Arm(f"eager {amp}", attn="eager", amp=amp)] if amp else [])
    arms += [Arm(b if amp is None else f"{b} {amp}", attn=b, amp=amp) for b in backends if b != "eager"]
    return RunConfig(
        name="parity_train", task="quadrant", model=MODEL, overrides=dict(SMALL), arms=arms,
        data=Data(img_size=SMALL["img_size"], n_train=steps * batch_size, n_test=held_out),
        optim=Optim(batch_size=batch_size, lr=lr), steps=steps, eval_every=max(1, steps // 5), tolerance=TOLERANCE,
        seed=seed, description=f"{MODEL} with " + ", ".join(f"{k}={v}" for k, v in SMALL.items())
        + " on the quadrant task: one initialisation, every attention backend",
    )


def train_parity(backends: list[str], *, device="cpu", progress: bool = True, **settings) -> AccuracyReport:
    """Fine-tune the small MODEL with each backend from one initialisation (``settings``: see
    :func:`backend_parity_config`; default dtype bf16 on a GPU, fp32 on a CPU)."""
    device = torch.device(device)
    settings.setdefault("dtype", torch.bfloat16 if device.type == "cuda" else torch.float32)
    if settings["dtype"] not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype={settings['dtype']}: --parity-train runs in fp32 or bf16")
    return run(backend_parity_config(backends, **settings), device=device, progress=progress)
