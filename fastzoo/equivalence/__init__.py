"""Equivalence: does a fastzoo model compute the same function as its original?

Three entry points, one rule:

- :func:`compare` takes a fastzoo model and the original (timm / Hugging Face / torchvision
  module, or a fastzoo twin) holding the same weights, runs the same inputs through both
  and compares the outputs and every parameter gradient. With ``layers=True`` it also hooks
  every module of both models, matched by module name (fastzoo's module names are the
  checkpoint's), and names the *first diverging layer*: in forward order the first module
  whose input still agrees with the original's but whose output does not; in backward order
  the first module whose output and the gradient arriving there agree, but whose input or
  own-parameter gradients do not. Each module's tensors are compared relative to the
  original's scale (fp32: 1e-4); the other model's activations are compared as they are
  made, so only one model's are held in memory.
- :func:`check` does all of that for a registered model and one attention backend: it builds
  the original library's model (eager attention, fp32) holding a full random state
  (:func:`draw_`: every bias, norm weight, BatchNorm statistic, layer scale and embedding drawn,
  :func:`describe` names it; a library's init of zero biases and unit norms hides bugs), the fastzoo model from
  it (``fastzoo.create(name, pretrained=original, attn=backend)``) and the inputs (images for
  ViT; a padded batch and the same sequences packed for GPT-2), and every normalisation alone against
  the original's same-named module on inputs of variance near its eps (:mod:`~fastzoo.equivalence.norms`:
  a post-norm model's activations never take it there). ``fastzoo check`` prints it.
- :func:`compare_cases` applies the rule to tensors a benchmark already computed.

The rule (every equivalence test, `fastzoo check` and the benchmarks apply it):

- fp32: ``max|ours - ref| <= 1e-4`` for outputs (or 16 fp32 units in the last place of the largest
  reference value, where that is coarser: outputs past 52); gradients by a relative error (below).
- fp16/bf16 (flash-attn's rule): ``max|ours - ref| <= 3 * max|peer - ref| + floor``, where
  the peer is the original run in the same dtype on the same device, on its reference kernels
  and on the kernels its users get, the worse of the two (:mod:`fastzoo.equivalence.rule` says
  why): a kernel may be as inexact as the original in that dtype, times three, and no worse.
  And the attention backend alone (:mod:`fastzoo.equivalence.oplevel`): its output and dq/dk/dv
  on bf16/fp16 q, k, v against fp64 attention on the same rounded values, within
  ``BOUND_MARGIN`` times the error measured for the correct kernel (largest and rms, in units of
  the dtype's rounding), where the model-level 3x cannot see a 1 % error.

The gradient error of one parameter is ``max|g - g_ref| / max(max|g_ref|, 1e-2 * G)``, with
``G`` the largest reference gradient of the model: relative, because gradient magnitudes
differ by orders between layers, with a floor so that gradients that are zero in exact
arithmetic (e.g. the key bias, which softmax ignores) do not divide rounding noise by
rounding noise; where every reference gradient is exactly zero (a loss constant in every
weight) there is no ``G``, and the scale is 1. The reported gradient error is the worst parameter's. A foreign original's
gradients are translated to fastzoo's names by the same converter that translates its
weights (:mod:`fastzoo.weights`), transposes included.

Packed outputs are compared token by token with the padded reference, so a packed run that
leaks attention across sequences fails. Models run in eval mode (no dropout) so that the
comparison is deterministic; gradients are still computed.
"""
from fastzoo.equivalence.check import (
    Result, check, compares_grads, example_inputs, has_attention, original, tiny_overrides,
)
from fastzoo.equivalence.compare import compare
from fastzoo.equivalence.layers import LayerDiff, LayerReport, logits_of
from fastzoo.equivalence.rule import (
    FP32_GRAD_RTOL, FP32_LAYER_RTOL, FP32_OUT_ATOL, FP32_OUT_ULPS, GRAD_SCALE_FLOOR, LOW_FACTOR, LOW_GRAD_FLOOR, LOW_OUT_FLOOR,
    Comparison, compare_cases, compare_errors, compare_grads, compare_grads_where_finite, compare_outputs,
    compare_loss, compare_outputs_where_finite, loss_rounding, curve_error, grad_error, nonfinite_difference,
)
from fastzoo.equivalence.weights import describe, draw_
from fastzoo.tasks import Inputs

__all__ = [
    "FP32_GRAD_RTOL", "FP32_LAYER_RTOL", "FP32_OUT_ATOL", "FP32_OUT_ULPS", "GRAD_SCALE_FLOOR", "LOW_FACTOR", "LOW_GRAD_FLOOR",
    "LOW_OUT_FLOOR", "Comparison", "Inputs", "LayerDiff", "LayerReport", "Result", "check", "compare", "compare_cases",
    "compare_errors", "compare_grads", "compare_grads_where_finite", "compare_loss", "loss_rounding", "compare_outputs",
    "compare_outputs_where_finite", "compares_grads", "curve_error", "example_inputs", "grad_error", "has_attention",
    "nonfinite_difference",
    "logits_of",
    "describe", "draw_", "original", "tiny_overrides",
]
