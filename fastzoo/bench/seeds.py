"""The seeds' three tables on one GPU in one call (``benchmarks/gpu_suite.sh seeds``): the plan,
its projected time, and the suites that measure it.

The seed articles reported, on one H100 (:data:`SEED_FIGURES`): a ViT-B/16 training step going
from 370 ms to about 200 ms by the choice of attention kernel; packed sequences 2-3x faster than
padding for a GPT-2 training step; the fused GIoU kernel ahead of the plain loss at every box
count. Each part here times the same comparison, fastzoo against the original under the same
recipe (the harness's interleaved rounds), beside the same-run GEMM peak and HBM bandwidth
(:func:`fastzoo.bench.limits.measure`) and the seed's figure.

Sizes and step counts are set so that the whole stage fits :data:`STAGE_BUDGET_S` on one H100
from a cold start: :func:`plan` counts each part's work from the shapes (the specs' FLOP counts,
GIoU's bytes) and projects its GPU time from the H100's data-sheet peaks at a stated efficiency,
plus a fixed cost per case (build, parity pass) and per compiled case; ``--dry-run`` prints it
on a CPU without building a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

STAGE_BUDGET_S = 480  # the stage's whole time on one H100, cold start included (8 minutes)
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak (SXM data sheet)
H100_HBM_BYTES = 3.35e12  # HBM3 bandwidth (SXM data sheet)
STEP_EFFICIENCY = 0.35  # share of the bf16 peak a training step reaches (eager attention lower, the kernels higher)
BANDWIDTH_EFFICIENCY = 0.5  # share of HBM bandwidth a small elementwise loss reaches
COLD_START_S = 25.0  # imports (torch, timm, transformers), CUDA context, the same-run limits, per part
CASE_S = 4.0  # build a case from the original's weights, its parity pass
COMPILE_S = 45.0  # a compiled case's first step, forward and backward (flex's kernel, FA4's JIT)
# compile against torch and travel as no wheel (benchmarks/gpu_suite.sh): left out of the plan
NOT_CARRIED = ("fa2", "fa3", "te")
COMPILED = ("flex", "fa4")  # backends whose first step compiles on CUDA (flex's kernel, FA4's CuTe-DSL JIT)
WARMUP, ROUNDS = 3, 10  # per case; rounds interleaved across the group's cases (>= 5: a spread to judge)

SEED_FIGURES = {
    "vit": "ViT-B/16 training step on one H100: 370 ms -> ~200 ms from the attention kernel's choice",
    "gpt2": "GPT-2 training step: packed sequences 2-3x faster than padding",
    "giou": "GIoU loss: the fused kernel ahead of the per-sample loop and the concatenated loss at every box count",
}

VIT_BATCH = 128  # ViT-B/16 at 224: 197 tokens, bf16 autocast
GPT2_SEQS, GPT2_MAX_LEN = 16, 1024  # GPT-2 small, lengths uniform in [1, 1024]: about half the padded tokens are real
GIOU_BOXES = (4, 64)  # real boxes per image (max), 256 images x 256 slots


@dataclass
class Part:
    name: str
    what: str
    cases: list[str]
    flops_per_step: float = 0.0  # per case, one step (the slowest case's work: padded where it pads)
    bytes_per_step: float = 0.0
    compiled: list[str] = field(default_factory=list)

    def step_s(self) -> float:
        return (self.flops_per_step / (H100_BF16_FLOPS * STEP_EFFICIENCY)
                + self.bytes_per_step / (H100_HBM_BYTES * BANDWIDTH_EFFICIENCY))

    def projected_s(self) -> float:
        steps = (WARMUP + ROUNDS + 1) * len(self.cases)  # + 1: the parity pass
        return COLD_START_S + CASE_S * len(self.cases) + COMPILE_S * len(self.compiled) + steps * self.step_s()


def vit_backends(device_type: str = "cuda") -> list:
    """Every attention backend a ViT trains with on ``device_type`` (available or not: the stage runs
    those that load), sdpa's pinned kernels as (name, options); varlen only packs sequences."""
    from fastzoo.attention import backend_class, list_attention

    out = []
    for b in list_attention():
        caps = backend_class(b).capabilities
        if b not in ("varlen", *NOT_CARRIED) and device_type in caps.devices and device_type in caps.backward:
            out.append(b)
    out += [("sdpa", {"sdpa_backend": k}) for k in ("flash", "efficient", "cudnn", "math")]
    return out


def packing_backends(device_type: str = "cuda") -> list[str]:
    """The backends that serve packed sequences (varlen) and train on ``device_type``."""
    from fastzoo.attention import backend_class, list_attention

    return [b for b in list_attention() if (c := backend_class(b).capabilities).varlen and b not in NOT_CARRIED
            and device_type in c.devices and device_type in c.backward]


def label(backend) -> str:
    name, options = (backend, {}) if isinstance(backend, str) else backend
    return name + "".join(f" ({k}={v})" for k, v in options.items())


def plan() -> list[Part]:
    """The three parts at the stage's sizes, their work counted from the shapes."""
    from fastzoo.models.decoder.spec import gpt2_flops
    from fastzoo.models.vit.spec import flops as vit_flops
    from fastzoo.registry import get_entry

    vit = get_entry("vit_b16")
    vit_cfg = vit.spec.config_class.from_dict(dict(vit.config))
    backends = vit_backends()
    vit_part = Part("vit", f"ViT-B/16 training step, {VIT_BATCH} images at 224, bf16 autocast, per attention backend",
                    ["timm (fp32, eager)", "timm (bf16 autocast)"] + [f"fastzoo {label(b)}" for b in backends],
                    flops_per_step=vit_flops(vit_cfg, batch=VIT_BATCH, train=True),
                    compiled=[label(b) for b in backends if b in COMPILED])
    gpt2 = get_entry("gpt2")
    gpt2_cfg = gpt2.spec.config_class.from_dict(dict(gpt2.config))
    padded_tokens = GPT2_SEQS * GPT2_MAX_LEN
    packers = packing_backends()
    gpt2_part = Part("gpt2", f"GPT-2 small training step (labels=), {GPT2_SEQS} sequences of 1-{GPT2_MAX_LEN} tokens, "
                     "bf16 autocast: padded vs packed per backend that serves packing",
                     ["transformers (padded, sdpa)", "fastzoo sdpa (padded)"] + [f"fastzoo {b} (packed)" for b in packers],
                     flops_per_step=gpt2_flops(gpt2_cfg, tokens=padded_tokens, attended=GPT2_SEQS * GPT2_MAX_LEN**2),
                     compiled=[b for b in packers if b in COMPILED])
    slots, images = 256, 256
    giou_part = Part("giou", f"GIoU loss fwd+bwd, {images} images x {slots} slots at 1-{'/'.join(map(str, GIOU_BOXES))} "
                     "real boxes per image: per_sample / concat / padded / kernel",
                     [f"{mode}, <= {n} boxes" for n in GIOU_BOXES for mode in ("per_sample", "concat", "padded", "kernel")],
                     bytes_per_step=images * slots * 4 * 4 * 2 * 3)  # pred, target, grad; fp32 boxes
    return [vit_part, gpt2_part, giou_part]


def dry_run_text(parts: list[Part] | None = None) -> str:
    """The plan as a table: each part's cases, work per step and projected H100 time; the total
    against :data:`STAGE_BUDGET_S`."""
    from fastzoo.bench.limits import si
    from fastzoo.text import markdown_table

    parts = parts if parts is not None else plan()
    rows = [{"part": p.name, "what": p.what, "cases": len(p.cases), "compiled": len(p.compiled),
             "work per step": si(p.flops_per_step, "FLOP") if p.flops_per_step else si(p.bytes_per_step, "B"),
             "projected step": f"{p.step_s() * 1e3:.3g} ms", "projected part": f"{p.projected_s():.0f} s",
             "seed's figure": SEED_FIGURES[p.name]} for p in parts]
    total = sum(p.projected_s() for p in parts)
    verdict = "fits" if total <= STAGE_BUDGET_S else "DOES NOT FIT"
    return (markdown_table(rows) + f"\n\nprojected total on one H100: {total:.0f} s of the stage's {STAGE_BUDGET_S} s "
            f"({verdict}); {WARMUP} warm-up + {ROUNDS} interleaved rounds per case; per part {COLD_START_S:.0f} s cold "
            f"start, {CASE_S:.0f} s per case, {COMPILE_S:.0f} s per compiled case; steps at {STEP_EFFICIENCY:.0%} of "
            f"{si(H100_BF16_FLOPS, 'FLOP/s')} bf16 and {BANDWIDTH_EFFICIENCY:.0%} of {si(H100_HBM_BYTES, 'B/s')} HBM\n")


def fits(parts: list[Part] | None = None) -> bool:
    parts = parts if parts is not None else plan()
    return sum(p.projected_s() for p in parts) <= STAGE_BUDGET_S


def suite(part: str, device: torch.device):
    """The harness suite that measures ``part`` on ``device`` (with the same-run limits)."""
    from fastzoo.attention import backend_class
    from fastzoo.bench import limits
    from fastzoo.bench.recipes import Recipe
    from fastzoo.models.spec import Workload
    from fastzoo.registry import get_entry

    bf16 = [Recipe("bf16 autocast")]
    loads = lambda b: backend_class(b if isinstance(b, str) else b[0]).is_available()  # noqa: E731
    if part == "vit":
        from fastzoo.bench.image_classification import image_classification_suite

        s = image_classification_suite(get_entry("vit_b16"), [Workload("ViT-B/16 224", batch=VIT_BATCH)],
                                       backends=[b for b in vit_backends(device.type) if loads(b)], recipes=bf16,
                                       device=device)
    elif part == "gpt2":
        from fastzoo.bench.causal_lm import causal_lm_suite

        s = causal_lm_suite(get_entry("gpt2"), Workload("GPT-2 small", batch=GPT2_SEQS, max_len=GPT2_MAX_LEN),
                            backends=["sdpa"] + [b for b in packing_backends(device.type) if loads(b)],
                            modes=("train",), recipes=bf16, steps=("labels",), device=device)
    elif part == "giou":
        from fastzoo.bench.giou import GIoUSetting, giou_suite

        suites = [giou_suite(GIoUSetting(f"256 images x 256 slots, 1-{n} real", 256, 256, n), device=device)
                  for n in GIOU_BOXES]
        s = suites[0]
        s.groups = [g for x in suites for g in x.groups]
    else:
        raise ValueError(f"part={part!r}: choose one of vit, gpt2, giou")
    s.limits = limits.measure(device, dtypes=(torch.bfloat16, torch.float32))
    s.interleave = True
    s.config["seed's figure"] = SEED_FIGURES[part]
    return s
