"""Multi-scale deformable attention (Zhu et al., "Deformable DETR", arXiv:2010.04159) behind one seam.

Each query reads, per head, ``P`` bilinearly sampled points on each of ``L`` feature levels and
sums them with its attention weights::

    out[b, q, h*D:(h+1)*D] = sum_{l, p} w[b, q, h, l, p] * bilinear(value_l[b, :, h, :], loc[b, q, h, l, p])

Shapes and meaning are transformers' (``MultiScaleDeformableAttention`` of Deformable DETR,
RT-DETR): ``value_BSHD`` [B, S, heads, D] is every level's ``H_l * W_l`` tokens concatenated,
``spatial_shapes_L2`` [L, 2] int64 ``(H_l, W_l)``, ``level_start_index_L`` [L] where each level
starts in S, ``sampling_locations_BQHLP2`` [B, Q, heads, L, P, 2] ``(x, y)`` in [0, 1] of the level
(0 and 1 are the outer edges of the first and last pixels), ``attention_weights_BQHLP``
[B, Q, heads, L, P] already softmaxed; the output is [B, Q, heads * D]. Sampling is
``grid_sample``'s: bilinear, ``align_corners=False``, zeros outside the image.

RT-DETRv2 and D-FINE (transformers' ``multi_scale_deformable_attention_v2``) give each level its own
number of points: with ``points_per_level=[P_0, ..., P_{L-1}]`` the levels' points are flattened,
``sampling_locations_BQHLP2`` [B, Q, heads, K, 2] and ``attention_weights_BQHLP`` [B, Q, heads, K],
``K = sum P_l``, level 0's points first. RT-DETRv2's ``method="discrete"`` reads the nearest pixel
(no interpolation, no gradient to the locations); only the reference serves it.

``spatial_shapes_list``: the same level sizes on the host, ``[(H_l, W_l), ...]`` (transformers' name for
them), where the caller has them (a model knows its feature maps' sizes): then neither the input check
nor the reference reads ``spatial_shapes_L2`` back from the device, so a call costs no host read.

A word picks the kernel (``impl=``), each declared as an attention backend is (devices and dtypes,
backward, the ops it shows in a profile) and refused by name where it cannot serve:

- ``"reference"``: transformers' pure-PyTorch path, op for op (``grid_sample`` per level);
- ``"cpu"``: the fused C++ kernel (``deformable_op.py``), forward and backward;
- ``"triton"``: the Triton kernel for CUDA (``triton_deformable.py``);
- ``"auto"``: the fused kernel of the tensors' device where it serves the call, else the reference.

Each call runs inside a ``fastzoo.deformable`` profiler range, so ``fastzoo.explain`` names the
kernel that ran (:func:`kernel_ops`).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import math

import torch
from torch import Tensor, nn

from fastzoo.attention.availability import package_available, unavailable
from fastzoo.attention.base import FLOATS, Capabilities
from fastzoo.errors import BackendUnavailableError, UnknownBackendError
from fastzoo.kernel_ranges import kernel_range
from fastzoo.text import dtype_name

RANGE_KIND = "deformable"  # the profiler range's kind (fastzoo.kernel_ranges)
SEAM = "multi_scale_deformable_attention"  # the range's name: explain's row


@dataclass(frozen=True)
class DeformableKernel:
    """One implementation of the seam, declared: ``capabilities`` (devices -> dtypes, devices with a
    backward, packages), ``kernel_ops`` (a regex of the ops its calls show in a profile, forward and
    backward) and ``run`` ("module:function", imported on first use: the reference takes the seam's
    positional arguments, a fused op the levels' points flattened with ``points_per_level`` after
    ``level_start_index``, as ``deformable_op.py`` says); ``ready``: "module:function" saying why it
    cannot run on this machine beyond its packages (a C++ build that failed), or None."""

    name: str
    capabilities: Capabilities
    kernel_ops: str
    run: str
    ready: str | None = None

    def problem_here(self) -> str | None:
        """Why this machine cannot run it at all (packages, device, build), or None."""
        missing = unavailable(self.capabilities)
        if missing is None and self.ready:
            module, _, attr = self.ready.partition(":")
            missing = getattr(importlib.import_module(module), attr)()
        return missing

    def function(self):
        module, _, attr = self.run.partition(":")
        return getattr(importlib.import_module(module), attr)


def _caps(devices, backward, **more) -> Capabilities:
    return Capabilities(devices=devices, backward=backward, causal=False, padding_mask=False, dropout=False, **more)


KERNELS: dict[str, DeformableKernel] = {
    k.name: k for k in (
        # transformers' pure-PyTorch path: grid_sample per level, then the weighted sum
        DeformableKernel(
            "reference",
            _caps({"cpu": FLOATS + (torch.float64,), "cuda": FLOATS + (torch.float64,)}, ("cpu", "cuda"),
                  verified="cpu (equal to transformers bit for bit)"),
            kernel_ops=r"^aten::grid_sampler_2d(_backward)?$", run="fastzoo.attention.deformable:reference"),
        # fused C++ loops (deformable_cpu.cpp): bilinear sampling and the weighted sum in one pass,
        # hand-written backward; bf16/fp16 computed in fp32
        DeformableKernel(
            "cpu",
            _caps({"cpu": FLOATS + (torch.float64,)}, ("cpu",), verified="cpu"),
            kernel_ops=r"^fastzoo_msda::(forward|backward)$", run="fastzoo.attention.deformable_op:msda_cpu",
            ready="fastzoo.attention.deformable_op:cpu_problem"),
        # Triton kernels (triton_deformable.py): one program per (batch, query, head), its points one
        # vector; hand-written backward, value gradient by fp32 atomics; bf16/fp16 computed in fp32
        DeformableKernel(
            "triton",
            _caps({"cuda": FLOATS}, ("cuda",), packages=("triton",), install="pip install triton",
                  verified="Triton's CPU interpreter (TRITON_INTERPRET=1); GPU: benchmarks/gpu_suite.sh"),
            kernel_ops=r"^fastzoo::msda_triton_(forward|backward)$", run="fastzoo.attention.deformable_op:msda_triton"),
    )
}


def kernel_ops() -> str:
    """The ops of every declared kernel, one regex (what ``fastzoo.explain`` counts as this seam's kernels)."""
    return "|".join(f"(?:{k.kernel_ops})" for k in KERNELS.values())


def _sizes(spatial_shapes_L2: Tensor, spatial_shapes_list) -> list[tuple[int, int]]:
    """The level sizes on the host: the caller's list, else read from the tensor (a host read)."""
    if spatial_shapes_list is not None:
        return [(int(h), int(w)) for h, w in spatial_shapes_list]
    return [(int(h), int(w)) for h, w in spatial_shapes_L2.tolist()]


def reference(value_BSHD: Tensor, spatial_shapes_L2: Tensor, level_start_index_L: Tensor,
              sampling_locations_BQHLP2: Tensor, attention_weights_BQHLP: Tensor, spatial_shapes_list=None) -> Tensor:
    """transformers' ``MultiScaleDeformableAttention.forward`` (Deformable DETR, RT-DETR), op for op,
    so its values and gradients are transformers' bit for bit. Reads the level sizes to the host unless
    ``spatial_shapes_list`` gives them."""
    B, _, heads, D = value_BSHD.shape
    _, Q, _, L, P, _ = sampling_locations_BQHLP2.shape
    sizes = _sizes(spatial_shapes_L2, spatial_shapes_list)
    value_levels = value_BSHD.split([h * w for h, w in sizes], dim=1)
    grids_BQHLP2 = 2 * sampling_locations_BQHLP2 - 1
    sampled = []
    for level, (h, w) in enumerate(sizes):
        value_NDhw = value_levels[level].flatten(2).transpose(1, 2).reshape(B * heads, D, h, w)
        grid_NQP2 = grids_BQHLP2[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(nn.functional.grid_sample(value_NDhw, grid_NQP2, mode="bilinear", padding_mode="zeros",
                                                 align_corners=False))  # [B*heads, D, Q, P]
    weights_N1QK = attention_weights_BQHLP.transpose(1, 2).reshape(B * heads, 1, Q, L * P)
    out_NDQ = (torch.stack(sampled, dim=-2).flatten(-2) * weights_N1QK).sum(-1).view(B, heads * D, Q)
    return out_NDQ.transpose(1, 2).contiguous()


def reference_v2(value_BSHD: Tensor, spatial_shapes_L2: Tensor, sampling_locations_BQHK2: Tensor,
                 attention_weights_BQHK: Tensor, points_per_level: list[int], method: str = "default",
                 spatial_shapes_list=None) -> Tensor:
    """transformers' ``multi_scale_deformable_attention_v2`` (RT-DETRv2, D-FINE), op for op: each level
    its own number of points, the points flattened; ``method`` "default" (bilinear) or "discrete"."""
    B, _, heads, D = value_BSHD.shape
    _, Q, _, K, _ = sampling_locations_BQHK2.shape
    sizes = _sizes(spatial_shapes_L2, spatial_shapes_list)
    value_levels = value_BSHD.permute(0, 2, 3, 1).flatten(0, 1).split([h * w for h, w in sizes], dim=-1)
    grids_BQHK2 = 2 * sampling_locations_BQHK2 - 1 if method == "default" else sampling_locations_BQHK2
    grids = grids_BQHK2.permute(0, 2, 1, 3, 4).flatten(0, 1).split(points_per_level, dim=-2)
    sampled = []
    for level, (h, w) in enumerate(sizes):
        value_NDhw = value_levels[level].reshape(B * heads, D, h, w)
        if method == "default":
            sampled.append(nn.functional.grid_sample(value_NDhw, grids[level], mode="bilinear", padding_mode="zeros",
                                                     align_corners=False))
            continue
        coord = (grids[level] * torch.tensor([[w, h]], device=value_BSHD.device) + 0.5).to(torch.int64)
        coord = torch.stack([coord[..., 0].clamp(0, w - 1), coord[..., 1].clamp(0, h - 1)], dim=-1)
        coord = coord.reshape(B * heads, Q * points_per_level[level], 2)
        rows = torch.arange(coord.shape[0], device=value_BSHD.device).unsqueeze(-1).repeat(1, coord.shape[1])
        picked = value_NDhw[rows, :, coord[..., 1], coord[..., 0]]
        sampled.append(picked.transpose(1, 2).reshape(B * heads, D, Q, points_per_level[level]))
    weights_N1QK = attention_weights_BQHK.permute(0, 2, 1, 3).reshape(B * heads, 1, Q, K)
    out_NDQ = (torch.concat(sampled, dim=-1) * weights_N1QK).sum(-1).view(B, heads * D, Q)
    return out_NDQ.transpose(1, 2).contiguous()


METHODS = ("default", "discrete")


def check_inputs(value_BSHD: Tensor, spatial_shapes_L2: Tensor, level_start_index_L: Tensor,
                 sampling_locations_BQHLP2: Tensor, attention_weights_BQHLP: Tensor,
                 points_per_level: list[int] | None = None, spatial_shapes_list=None) -> None:
    """ValueError naming the argument whose rank, size, dtype or device disagrees with the others.
    The level sizes are checked against S from ``spatial_shapes_list`` where given (no host read), else
    from the tensors only on the CPU (elsewhere that would be a host sync)."""
    flat = points_per_level is not None  # the levels' points flattened: one dimension fewer
    named = {"value_BSHD": (value_BSHD, 4), "spatial_shapes_L2": (spatial_shapes_L2, 2),
             "level_start_index_L": (level_start_index_L, 1),
             "sampling_locations_BQHLP2": (sampling_locations_BQHLP2, 5 if flat else 6),
             "attention_weights_BQHLP": (attention_weights_BQHLP, 4 if flat else 5)}
    for name, (t, rank) in named.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
        if t.device != value_BSHD.device:
            raise ValueError(f"{name} is on {t.device}, value_BSHD on {value_BSHD.device}: put them on one device")
    for name in ("value_BSHD", "sampling_locations_BQHLP2", "attention_weights_BQHLP"):
        if not named[name][0].is_floating_point():
            raise ValueError(f"{name} must be floating point, got {named[name][0].dtype}")
    if not value_BSHD.dtype == sampling_locations_BQHLP2.dtype == attention_weights_BQHLP.dtype:
        raise ValueError(f"value_BSHD, sampling_locations_BQHLP2 and attention_weights_BQHLP must share one dtype "
                         f"(as grid_sample's input and grid), got {dtype_name(value_BSHD.dtype)}, "
                         f"{dtype_name(sampling_locations_BQHLP2.dtype)}, {dtype_name(attention_weights_BQHLP.dtype)}")
    for name in ("spatial_shapes_L2", "level_start_index_L"):
        if named[name][0].is_floating_point() or named[name][0].is_complex():
            raise ValueError(f"{name} must be an integer tensor, got {named[name][0].dtype}")
    B, S, heads, _ = value_BSHD.shape
    L = spatial_shapes_L2.shape[0]
    if spatial_shapes_L2.shape[1] != 2:
        raise ValueError(f"spatial_shapes_L2 must be [L, 2] (height, width) per level, got {tuple(spatial_shapes_L2.shape)}")
    if level_start_index_L.shape[0] != L:
        raise ValueError(f"level_start_index_L has {level_start_index_L.shape[0]} entries for {L} levels (spatial_shapes_L2)")
    loc = sampling_locations_BQHLP2
    if flat:
        if len(points_per_level) != L or not all(isinstance(p, int) and p > 0 for p in points_per_level):
            raise ValueError(f"points_per_level must be {L} positive ints (one per level of spatial_shapes_L2), "
                             f"got {points_per_level}")
        K = sum(points_per_level)
        if loc.shape[0] != B or loc.shape[2] != heads or loc.shape[3] != K or loc.shape[4] != 2:
            raise ValueError(f"with points_per_level, sampling_locations_BQHLP2 must be [B={B}, Q, heads={heads}, "
                             f"K={K}, 2] (every level's points), got {tuple(loc.shape)}")
    elif loc.shape[0] != B or loc.shape[2] != heads or loc.shape[3] != L or loc.shape[5] != 2:
        raise ValueError(f"sampling_locations_BQHLP2 must be [B={B}, Q, heads={heads}, L={L}, P, 2], "
                         f"got {tuple(loc.shape)}")
    if attention_weights_BQHLP.shape != loc.shape[:-1]:
        raise ValueError(f"attention_weights_BQHLP must be {tuple(loc.shape[:-1])} (sampling_locations_BQHLP2 "
                         f"without its last dimension), got {tuple(attention_weights_BQHLP.shape)}")
    if spatial_shapes_list is not None:
        sizes = list(spatial_shapes_list)
        pair = lambda hw: (isinstance(hw, (tuple, list)) and len(hw) == 2  # noqa: E731
                           and all(isinstance(n, (int, torch.SymInt)) and n > 0 for n in hw))
        if len(sizes) != L or not all(pair(hw) for hw in sizes):
            raise ValueError(f"spatial_shapes_list must be {L} (height, width) pairs of positive ints (one per level "
                             f"of spatial_shapes_L2), got {sizes}")
        if sum(h * w for h, w in sizes) != S:
            raise ValueError(f"spatial_shapes_list {sizes} covers {sum(h * w for h, w in sizes)} tokens, "
                             f"value_BSHD has S={S}")
    elif value_BSHD.device.type == "cpu" and not _traced():
        sizes = spatial_shapes_L2.tolist()
        if any(h <= 0 or w <= 0 for h, w in sizes):
            raise ValueError(f"spatial_shapes_L2 must hold positive (height, width) per level, got {sizes}")
        if sum(h * w for h, w in sizes) != S:
            raise ValueError(f"spatial_shapes_L2 {sizes} covers {sum(h * w for h, w in sizes)} tokens, "
                             f"value_BSHD has S={S}")
        starts = [0]
        for h, w in sizes[:-1]:
            starts.append(starts[-1] + h * w)
        if level_start_index_L.tolist() != starts:
            raise ValueError(f"level_start_index_L must be {starts} (each level's first token for spatial_shapes_L2 "
                             f"{sizes}), got {level_start_index_L.tolist()}")


def _traced() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _needs_backward(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def serves(kernel: DeformableKernel, device: torch.device, dtype: torch.dtype, backward: bool) -> str | None:
    """Why ``kernel`` cannot run this call (device, dtype, backward, packages missing here), or None."""
    caps = kernel.capabilities
    dev = device.type
    interpreted = kernel.name == "triton" and dev == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        dev = "cuda"  # Triton's interpreter runs its kernels on CPU tensors (tests)
    if dev not in caps.devices:
        hint = " (on CPU only under Triton's interpreter, TRITON_INTERPRET=1)" if kernel.name == "triton" else ""
        return f"runs on {'/'.join(caps.devices)} only{hint}, the tensors are on {device.type}"
    if dtype not in caps.devices[dev]:
        return f"takes {'/'.join(dtype_name(d) for d in caps.devices[dev])} on {dev}, not {dtype_name(dtype)}"
    if backward and dev not in caps.backward:
        return f"has no backward on {dev} (the inputs require grad)"
    if interpreted:
        return None if package_available("triton") else "needs the package triton (pip install triton)"
    return kernel.problem_here()


def available(device: torch.device, dtype: torch.dtype, backward: bool) -> list[str]:
    """The kernels that would serve such a call on this machine."""
    return [name for name, k in KERNELS.items() if serves(k, device, dtype, backward) is None]


_FUNCTIONS: dict = {}  # kernel name -> its function, filled by _kernel_name (a traced call reads a dict)


@torch.compiler.assume_constant_result  # under torch.compile: decided (and a C++ kernel built) at trace time
def _kernel_name(impl: str, device_type: str, dtype: torch.dtype, backward: bool) -> str:
    """The kernel ``impl`` names for a call of this device, dtype and direction; "auto": the fused
    kernel of the device where it serves, else the reference. Refused by name, saying what serves."""
    device = torch.device(device_type)
    if impl == "auto":
        fused = "triton" if device_type == "cuda" else "cpu"
        impl = fused if fused in KERNELS and serves(KERNELS[fused], device, dtype, backward) is None else "reference"
    if impl not in KERNELS:
        raise UnknownBackendError(impl, {**KERNELS, "auto": None})
    kernel = KERNELS[impl]
    why = serves(kernel, device, dtype, backward)
    if why is not None:
        here = available(device, dtype, backward)
        raise BackendUnavailableError(
            f"multi-scale deformable attention impl={impl!r} {why}; for {dtype_name(dtype)} on {device_type}"
            f"{' with a backward' if backward else ''} this machine serves: {', '.join(here) or 'none'}")
    _FUNCTIONS.setdefault(impl, kernel.function())
    return impl


def multi_scale_deformable_attention(value_BSHD: Tensor, spatial_shapes_L2: Tensor, level_start_index_L: Tensor,
                                     sampling_locations_BQHLP2: Tensor, attention_weights_BQHLP: Tensor, *,
                                     impl: str = "auto", points_per_level: list[int] | None = None,
                                     method: str = "default", spatial_shapes_list=None) -> Tensor:
    """Multi-scale deformable attention -> out [B, Q, heads * D] (shapes and meaning: the module
    docstring). ``impl``: "reference" | "cpu" | "triton" | "auto". ``points_per_level``: each level's
    number of points, the points flattened (RT-DETRv2, D-FINE); ``method``: "default" | "discrete";
    ``spatial_shapes_list``: the level sizes on the host (no host read), as the module docstring says."""
    args = (value_BSHD, spatial_shapes_L2, level_start_index_L, sampling_locations_BQHLP2, attention_weights_BQHLP)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)} (transformers' decoder_method), got {method!r}")
    if points_per_level is not None:
        points_per_level = list(points_per_level)
    check_inputs(*args, points_per_level, spatial_shapes_list)
    if method == "discrete" and impl not in ("auto", "reference"):
        raise BackendUnavailableError(f"multi-scale deformable attention impl={impl!r} samples bilinearly only; "
                                      "method='discrete' (RT-DETRv2's nearest pixel) runs on impl='reference'")
    backward = _needs_backward(value_BSHD, sampling_locations_BQHLP2, attention_weights_BQHLP)
    name = _kernel_name("reference" if method == "discrete" else impl, value_BSHD.device.type, value_BSHD.dtype,
                        backward)
    with kernel_range(RANGE_KIND, SEAM, f"{impl}->{name}" if impl == "auto" else impl):
        if name == "reference" and points_per_level is None and method == "default":
            return reference(*args, spatial_shapes_list)
        B, Q, heads = sampling_locations_BQHLP2.shape[:3]
        if points_per_level is None:  # Deformable DETR's [.., L, P, ..]: every level P points, flattened
            points_per_level = [sampling_locations_BQHLP2.shape[4]] * spatial_shapes_L2.shape[0]
        loc_BQHK2 = sampling_locations_BQHLP2.reshape(B, Q, heads, -1, 2)
        weights_BQHK = attention_weights_BQHLP.reshape(B, Q, heads, -1)
        if name == "reference":
            return reference_v2(value_BSHD, spatial_shapes_L2, loc_BQHK2, weights_BQHK, points_per_level, method,
                                spatial_shapes_list)
        points_L = torch.tensor(points_per_level, dtype=torch.int64, device=value_BSHD.device)
        return _FUNCTIONS[name](value_BSHD, spatial_shapes_L2, level_start_index_L, points_L, loc_BQHK2, weights_BQHK)


def initial_offsets(heads: int, levels: int, points: int) -> torch.Tensor:
    """transformers' initial sampling offsets (the ``sampling_offsets`` bias, flattened ``[heads, levels,
    points, 2]``): head ``h`` looks along the angle ``2 pi h / heads``, point ``p`` at ``p + 1`` cells."""
    thetas = torch.arange(heads, dtype=torch.float32) * (2.0 * math.pi / heads)
    grid = torch.stack([thetas.cos(), thetas.sin()], -1)
    grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(heads, 1, 1, 2).repeat(1, levels, points, 1)
    return (grid * torch.arange(1, points + 1, dtype=torch.float32).view(1, 1, -1, 1)).view(-1)
