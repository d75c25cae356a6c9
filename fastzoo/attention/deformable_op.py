"""The fused multi-scale deformable attention kernels as ``torch.library`` ops with a hand-written backward.

Each fused kernel is a pair of ops, ``torch.ops.fastzoo.msda_<kernel>_forward(value, spatial_shapes,
level_start_index, points_per_level, sampling_locations, attention_weights) -> out`` and
``msda_<kernel>_backward(grad, ...) -> (grad_value, grad_sampling_locations, grad_attention_weights)``,
on the levels' points flattened (sampling_locations [B, Q, heads, K, 2], attention_weights
[B, Q, heads, K], K = sum of points_per_level [L]: RT-DETRv2's and D-FINE's layout, Deformable DETR's
reshaped), the forward's autograd
wired to the backward op and both given fake implementations, so eager autograd and
``torch.compile(fullgraph=True)`` run through them:

- ``cpu``: the C++ loops of ``deformable_cpu.cpp`` (built on first use by ``fastzoo.cpp_build``);
- ``triton``: the Triton kernels of ``triton_deformable.py`` (CUDA; on CPU tensors under Triton's
  interpreter), imported only when called.

The backward recomputes the bilinear corners from the saved inputs: nothing of size
[B, Q, heads, L, P, ...] is kept between the two directions.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor

from fastzoo.cpp_build import build, failure_text

_cpu_problem: str | None = None
_cpu_built = False


def cpu_problem() -> str | None:
    """Why the C++ kernel cannot run here (its build failed: no compiler or ninja), or None;
    the first call builds it (seconds, then cached by torch across processes)."""
    global _cpu_problem, _cpu_built
    if not _cpu_built:
        _cpu_built = True
        try:  # at::parallel_for over (batch, query) needs OpenMP in the extension
            build("fastzoo_msda_cpu", Path(__file__).with_name("deformable_cpu.cpp"),
                  extra_cflags=("-O3", "-fopenmp"), extra_ldflags=("-fopenmp",))
        except Exception as e:
            _cpu_problem = f"its C++ kernel did not build ({failure_text(e)}); install a C++ compiler and ninja"
            warnings.warn(f"fastzoo deformable attention on CPU: {_cpu_problem}", stacklevel=3)
    return _cpu_problem


def _cpu_forward(*args):
    return torch.ops.fastzoo_msda.forward(*args)


def _cpu_backward(*args):
    return torch.ops.fastzoo_msda.backward(*args)


def _triton_forward(*args):
    from fastzoo.attention import triton_deformable

    return triton_deformable.forward(*args)


def _triton_backward(*args):
    from fastzoo.attention import triton_deformable

    return triton_deformable.backward(*args)


def _define(kernel: str, forward, backward):
    """The op pair of one kernel, with its fake implementations and autograd."""

    @torch.library.custom_op(f"fastzoo::msda_{kernel}_forward", mutates_args=())
    def fwd(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, points_per_level: Tensor,
            sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
        return forward(value, spatial_shapes, level_start_index, points_per_level, sampling_locations,
                       attention_weights)

    @fwd.register_fake
    def _(value, spatial_shapes, level_start_index, points_per_level, sampling_locations, attention_weights):
        B, Q = sampling_locations.shape[:2]
        return value.new_empty((B, Q, value.shape[2] * value.shape[3]))

    @torch.library.custom_op(f"fastzoo::msda_{kernel}_backward", mutates_args=())
    def bwd(grad: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, points_per_level: Tensor,
            sampling_locations: Tensor, attention_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(backward(grad, value, spatial_shapes, level_start_index, points_per_level, sampling_locations,
                              attention_weights))

    @bwd.register_fake
    def _(grad, value, spatial_shapes, level_start_index, points_per_level, sampling_locations, attention_weights):
        return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward_rule(ctx, grad):
        value, shapes, start, points, loc, weights = ctx.saved_tensors
        g_value, g_loc, g_weights = bwd(grad.contiguous(), value, shapes, start, points, loc, weights)
        need = ctx.needs_input_grad
        return (g_value if need[0] else None, None, None, None, g_loc if need[4] else None,
                g_weights if need[5] else None)

    fwd.register_autograd(backward_rule, setup_context=setup_context)
    return fwd


msda_cpu = _define("cpu", _cpu_forward, _cpu_backward)
msda_triton = _define("triton", _triton_forward, _triton_backward)
