"""Multi-scale deformable attention, forward + backward, at Deformable DETR's sizes.

An 800 x 800 image's feature pyramid at strides 8, 16, 32, 64 (100x100, 50x50, 25x25, 13x13:
13,294 tokens), 8 heads of 32 (d_model 256), 4 levels x 4 points: the encoder (every token a
query) and the decoder (300 queries). The peer is transformers' ``MultiScaleDeformableAttention``
(its pure-PyTorch ``grid_sample`` path, what transformers runs on CPU); the cases are the fused
kernels of :mod:`fastzoo.attention.deformable` (C++ on CPU, Triton on CUDA). Each step is the
attention's forward and its backward (gradients of the value, the sampling locations and the
attention weights under a fixed upstream gradient); parity against transformers in fp32 (the
rule's 1e-4) gates each case. Cases are timed interleaved in rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fastzoo.attention.deformable import multi_scale_deformable_attention
from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.machine import load_average

GRADS = ("value", "sampling_locations", "attention_weights")


@dataclass(frozen=True)
class DeformableSetting:
    name: str
    batch: int = 1
    image: int = 800  # square image side, pixels
    strides: tuple[int, ...] = (8, 16, 32, 64)
    decoder_queries: int = 300
    heads: int = 8
    head_dim: int = 32
    points: int = 4

    def levels(self) -> list[tuple[int, int]]:
        side = [-(-self.image // s) for s in self.strides]  # a stride-s convolution's output side, ceil
        return [(n, n) for n in side]

    def tokens(self) -> int:
        return sum(h * w for h, w in self.levels())

    def describe(self) -> str:
        levels = ", ".join(f"{h}x{w}" for h, w in self.levels())
        return (f"batch {self.batch}, {self.image}x{self.image} image at strides {self.strides} ({levels}: "
                f"{self.tokens()} tokens), {self.heads} heads x {self.head_dim}, {len(self.strides)} levels x "
                f"{self.points} points")


TARGET_SETTING = DeformableSetting("Deformable DETR, 800x800")
QUICK_SETTING = DeformableSetting("Deformable DETR sizes, 400x400 image", image=400, decoder_queries=100)


def reference_points(s: DeformableSetting, queries: int, encoder: bool, g: torch.Generator) -> Tensor:
    """[queries, 2] (x, y) in [0, 1]: the encoder's are its tokens' pixel centres, level by level (Deformable
    DETR's ``get_reference_points``, every valid ratio 1); the decoder's are spread over the image."""
    if not encoder:
        return torch.rand(queries, 2, generator=g)
    points = []
    for h, w in s.levels():
        y, x = torch.meshgrid(torch.linspace(0.5, h - 0.5, h) / h, torch.linspace(0.5, w - 0.5, w) / w, indexing="ij")
        points.append(torch.stack([x.reshape(-1), y.reshape(-1)], -1))
    return torch.cat(points)


def make_inputs(s: DeformableSetting, queries: int, device, dtype, *, encoder: bool, seed: int = 0) -> tuple:
    """value, spatial_shapes, level_start_index, sampling_locations, attention_weights as the model makes
    them: each query's reference point plus offsets of a few pixels on each level (Deformable DETR's
    ``reference_points + sampling_offsets / (W, H)``, offsets ~ N(0, 2 px); some fall past the edges),
    attention weights softmaxed over levels x points; and a fixed upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    levels = s.levels()
    shapes = torch.tensor(levels, dtype=torch.int64)
    sizes = shapes[:, 0] * shapes[:, 1]
    start = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    L = len(levels)
    value = torch.randn(s.batch, s.tokens(), s.heads, s.head_dim, generator=g)
    ref = reference_points(s, queries, encoder, g)
    offsets = torch.randn(s.batch, queries, s.heads, L, s.points, 2, generator=g) * 2.0
    loc = ref[None, :, None, None, None, :] + offsets / shapes.flip(-1)[None, None, None, :, None, :]
    weights = torch.randn(s.batch, queries, s.heads, L * s.points, generator=g).softmax(-1)
    weights = weights.view(s.batch, queries, s.heads, L, s.points)
    upstream = torch.randn(s.batch, queries, s.heads * s.head_dim, generator=g)
    to = dict(device=device, dtype=dtype)
    return (value.to(**to), shapes.to(device), start.to(device), loc.to(**to), weights.to(**to)), upstream.to(**to)


def transformers_msda(value, shapes, start, loc, weights, levels: list[tuple[int, int]]) -> Tensor:
    """The peer, as transformers' Deformable DETR calls it (the level sizes as a Python list)."""
    from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention

    return MultiScaleDeformableAttention()(value, shapes, levels, start, loc, weights, 64)


def attention_step(fn, args: tuple, upstream: Tensor, items: int) -> Step:
    """Forward + backward of ``fn(value, shapes, start, locations, weights)`` on fresh leaves."""
    leaves = [args[i].clone().requires_grad_(True) for i in (0, 3, 4)]
    value, loc, weights = leaves

    def run():
        for t in leaves:
            t.grad = None
        out = fn(value, args[1], args[2], loc, weights)
        out.backward(upstream)
        return out

    def outputs():
        out = run()
        return {"output": out.detach().float(), **{f"grad:{n}": t.grad.float().clone() for n, t in zip(GRADS, leaves)}}

    return Step(run=run, items=items, outputs=outputs)


def group(s: DeformableSetting, part: str, queries: int, device, dtype) -> Group:
    args, upstream = make_inputs(s, queries, device, dtype, encoder=part == "encoder")
    levels = s.levels()
    peer = lambda *a: transformers_msda(*a, levels=levels)  # noqa: E731

    def reference():
        a32 = tuple(t.float() if t.is_floating_point() else t for t in args)
        return attention_step(peer, a32, upstream.float(), queries).outputs()

    def case(label, fn, **kw):
        return Case(label, lambda: attention_step(fn, args, upstream, queries * s.batch), **kw)

    fused = "triton" if torch.device(device).type == "cuda" else "cpu"
    cases = [case("transformers MultiScaleDeformableAttention (grid_sample)", peer, peer=True, reference=True),
             case(f"fastzoo impl={fused}", lambda *a: multi_scale_deformable_attention(*a, impl=fused))]
    # the sizes, not the setting's name: --set image=... changes them
    sizes = f"{s.image}x{s.image} image, batch {s.batch}, {s.heads}x{s.head_dim}, {len(s.strides)}x{s.points} points"
    return Group(f"{sizes} | {part}: {queries} queries, fwd+bwd", cases, reference=reference, unit="queries/s")


def deformable_suite(setting: DeformableSetting = TARGET_SETTING, *, device="cpu", dtype=torch.float32) -> Suite:
    """The encoder's and the decoder's call of the attention at ``setting``'s sizes."""
    device = torch.device(device)
    config = {"sizes": setting.describe(), "step": "forward + backward (value, locations and weights gradients)",
              "peer": "transformers' MultiScaleDeformableAttention (grid_sample path)",
              "threads": torch.get_num_threads(), "load average (1 min) when built": f"{load_average():.2f}",
              "timing": "cases interleaved in rounds"}
    groups = [group(setting, "encoder", setting.tokens(), device, dtype),
              group(setting, "decoder", setting.decoder_queries, device, dtype)]
    return Suite("deformable_attention", groups, config=config, dtype=dtype, device=device, interleave=True)


BATCH_FIELD = "batch"  # the setting's field --batch-size sets


def cli_suite(setting, *, device, dtype) -> Suite:
    """``fastzoo bench deformable_attention`` with ``TARGET_SETTING`` changed by ``--set`` / ``--batch-size``."""
    return deformable_suite(setting, device=device, dtype=dtype)
