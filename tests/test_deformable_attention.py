"""Multi-scale deformable attention (``fastzoo.attention.deformable``): the reference equals
transformers' ``MultiScaleDeformableAttention`` bit for bit; every kernel equals the reference within
the rule, values and gradients; bad input and kernels that cannot serve are refused by name;
``explain`` names the kernel that ran."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fastzoo.attention import deformable
from fastzoo.attention.deformable import multi_scale_deformable_attention as msda
from fastzoo.equivalence.rule import compare_grads, compare_outputs
from fastzoo.errors import BackendUnavailableError
from fastzoo.kernel_report import explain

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETED
# The fused kernels: the C++ one here; the Triton one on a GPU, or on CPU only in the subprocess that
# sets Triton's interpreter (test_triton_kernel_in_the_interpreter), which runs the tests named triton.
FUSED = ["cpu", pytest.param("triton", marks=pytest.mark.skipif(not (INTERPRETED or CUDA), reason="runs in its own "
                                                                 "subprocess under TRITON_INTERPRET=1"))]


def device_of(kernel: str) -> str:
    return "cuda" if kernel == "triton" and CUDA else "cpu"
GRAD_NAMES = ("value", "sampling_locations", "attention_weights")

# Four levels of different, odd sizes (one a single pixel), as a strided feature pyramid gives.
SHAPES = ((7, 9), (4, 5), (2, 3), (1, 1))


def inputs(B=2, Q=5, heads=3, D=4, P=3, shapes=SHAPES, dtype=torch.float32, spread=1.4, seed=0, device="cpu"):
    """value, spatial_shapes, level_start_index, sampling_locations, attention_weights, leaves
    requiring grad. Locations in [-0.2, 1.2] (``spread`` 1.4): some points fall outside the image,
    where sampling reads zeros."""
    g = torch.Generator().manual_seed(seed)
    shapes_L2 = torch.tensor(shapes, dtype=torch.int64)
    sizes = shapes_L2[:, 0] * shapes_L2[:, 1]
    start_L = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    L = len(shapes)
    to = dict(device=device, dtype=dtype)
    value = torch.randn(B, int(sizes.sum()), heads, D, generator=g).to(**to).requires_grad_()
    loc = (torch.rand(B, Q, heads, L, P, 2, generator=g) * spread - (spread - 1) / 2).to(**to).requires_grad_()
    weights = torch.rand(B, Q, heads, L, P, generator=g).softmax(-1).to(**to).requires_grad_()
    return value, shapes_L2.to(device), start_L.to(device), loc, weights


def transformers_msda(value, shapes_L2, start_L, loc, weights):
    from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention

    return MultiScaleDeformableAttention()(value, shapes_L2, shapes_L2.tolist(), start_L, loc, weights, 64)


def grads(fn, args, seed=1):
    """Output and the gradients of value, sampling locations and attention weights under a fixed
    random upstream gradient (not ones: a sum would hide a permuted output)."""
    out = fn(*args)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    leaves = (args[0], args[3], args[4])
    # materialize_grads: discrete sampling gives the locations no gradient (zeros, in both)
    return (out, *torch.autograd.grad(out, leaves, upstream, allow_unused=True, materialize_grads=True))


def test_reference_is_transformers_bit_for_bit():
    """Values and all three gradients identical: the reference is transformers' ops in their order."""
    args = inputs()
    ours = grads(lambda *a: msda(*a, impl="reference"), args)
    theirs = grads(transformers_msda, args)
    for name, a, b in zip(("out", "value", "locations", "weights"), ours, theirs):
        assert torch.equal(a, b), name


def test_points_outside_read_zeros():
    """A point entirely outside every level (location 2.0: more than a pixel past the edge) adds
    nothing: with all points there the output is exactly zero."""
    value, shapes, start, loc, w = inputs()
    far = torch.full_like(loc, 2.0)
    assert torch.equal(msda(value, shapes, start, far, w, impl="reference"),
                       torch.zeros(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3]))


@pytest.mark.parametrize("break_it, message", [
    (lambda a: (a[0][0],) + a[1:], "value_BSHD must have 4 dimensions"),
    (lambda a: (a[0], a[1].float()) + a[2:], "spatial_shapes_L2 must be an integer tensor"),
    (lambda a: (a[0], a[1][:3], a[2]) + a[3:], "level_start_index_L has 4 entries for 3 levels"),
    (lambda a: (a[0], a[1], a[2] + 1) + a[3:], "level_start_index_L must be [0, 63, 83, 89]"),
    (lambda a: (a[0][:, :-1],) + a[1:], "covers 90 tokens, value_BSHD has S=89"),
    (lambda a: a[:3] + (a[3][..., :1], a[4]), "sampling_locations_BQHLP2 must be [B=2, Q, heads=3, L=4, P, 2]"),
    (lambda a: a[:4] + (a[4][..., :2],), "attention_weights_BQHLP must be (2, 5, 3, 4, 3)"),
    (lambda a: a[:3] + (a[3].long(), a[4]), "sampling_locations_BQHLP2 must be floating point"),
    (lambda a: a[:3] + (a[3].double(), a[4]), "must share one dtype (as grid_sample's input and grid), got fp32, "
                                               "float64, fp32"),
], ids=["value-rank", "shapes-dtype", "start-count", "start-values", "tokens", "locations-shape",
        "weights-shape", "locations-dtype", "mixed-dtypes"])
def test_bad_input_is_refused_naming_the_argument(break_it, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        msda(*break_it(inputs()), impl="reference")


@pytest.mark.parametrize("impl, reads", [("reference", 3), ("cpu", 2)])
def test_host_sizes_give_the_same_result_and_no_host_read(impl, reads):
    """``spatial_shapes_list`` (the level sizes on the host) changes nothing in the values and gradients,
    and the call then reads nothing back from the device (counted as the benchmarks count: without the
    list, the CPU input check reads the level sizes and starts, and the reference the sizes again)."""
    from fastzoo.bench.set_loss import host_reads

    args = inputs()
    ours = grads(lambda *a: msda(*a, impl=impl, spatial_shapes_list=SHAPES), args)
    ref = grads(lambda *a: msda(*a, impl=impl), args)
    for name, a, b in zip(("out", "value", "locations", "weights"), ours, ref):
        assert torch.equal(a, b), name
    assert host_reads(lambda: msda(*args, impl=impl, spatial_shapes_list=SHAPES)) == 0
    assert host_reads(lambda: msda(*args, impl=impl)) == reads  # what the list saves


@pytest.mark.parametrize("sizes, message", [
    (SHAPES[:3], "spatial_shapes_list must be 4 (height, width) pairs of positive ints"),
    (((7, 9), (4, 5), (2, 3), (0, 1)), "spatial_shapes_list must be 4 (height, width) pairs of positive ints"),
    (((7, 9), (4, 5), (2, 3), (1, 2)), "spatial_shapes_list .* covers 91 tokens, value_BSHD has S=90"),
])
def test_bad_host_sizes_are_refused_naming_them(sizes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        msda(*inputs(), impl="reference", spatial_shapes_list=sizes)


def test_unknown_impl_is_refused_with_the_known_ones():
    with pytest.raises(KeyError, match="'referense'.*reference"):
        msda(*inputs(), impl="referense")


# Shapes beyond the default: one level; a wide level of one row; D and P of 1; many points far outside; width 32.
CASES = {
    "4-levels": {},
    "1-level": dict(shapes=((5, 6),)),
    "thin-levels": dict(shapes=((1, 11), (9, 1), (3, 2)), D=1, P=1, Q=4),
    "mostly-outside": dict(spread=3.0, P=4, heads=2, D=5),
    "head-width-32": dict(D=32, heads=2, Q=3),  # the C++ kernel's compiled-width path (d_model 256, 8 heads)
}


def fp32_comparisons(ours, ref):
    """The fp32 rule (fastzoo.equivalence.rule): output within 1e-4, each gradient within 1e-4 of the
    gradients' scale."""
    return [compare_outputs("out", ours[0], ref[0]),
            compare_grads("grads", dict(zip(GRAD_NAMES, ours[1:])), dict(zip(GRAD_NAMES, ref[1:])))]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kernel", FUSED)
def test_fused_kernel_equals_the_reference_in_fp32(kernel, case):
    args = inputs(**CASES[case], device=device_of(kernel))
    ours = grads(lambda *a: msda(*a, impl=kernel), args)
    ref = grads(lambda *a: msda(*a, impl="reference"), args)
    for c in fp32_comparisons(ours, ref):
        assert c.passed, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kernel", FUSED)
def test_fused_kernel_in_low_precision_within_the_rule(kernel, dtype):
    """flash-attn's rule against the reference in fp64: at most 3x the error of transformers' own path
    run in the same dtype (the fused kernels compute in fp32, so they are well inside it)."""
    args = inputs(dtype=dtype, device=device_of(kernel))
    exact_args = [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]
    ref = grads(lambda *a: msda(*a, impl="reference"), exact_args)
    peer = grads(lambda *a: msda(*a, impl="reference"), args)
    ours = grads(lambda *a: msda(*a, impl=kernel), args)
    assert ours[0].dtype == dtype and all(g.dtype == dtype for g in ours[1:])
    out = compare_outputs("out", ours[0], ref[0], peer=peer[0])
    grad = compare_grads("grads", dict(zip(GRAD_NAMES, ours[1:])), dict(zip(GRAD_NAMES, ref[1:])),
                         peer=dict(zip(GRAD_NAMES, peer[1:])))
    assert out.passed and grad.passed, (out, grad)


# RT-DETRv2 / D-FINE: each level its own number of points, the points flattened.
POINTS = [2, 3, 1, 4]


def flat_inputs(dtype=torch.float32, device="cpu", **kw):
    """The points of ``inputs(P=max)`` cut to POINTS per level and flattened: [B, Q, heads, K(, 2)]."""
    value, shapes, start, loc, w = inputs(P=max(POINTS), dtype=dtype, device=device, **kw)
    keep = lambda t: torch.cat([t[:, :, :, l, :p] for l, p in enumerate(POINTS)], dim=3).detach()  # noqa: E731
    return value, shapes, start, keep(loc).requires_grad_(), keep(w).requires_grad_()


def transformers_v2(value, shapes, start, loc, w, method="default"):
    from transformers.models.d_fine.modeling_d_fine import multi_scale_deformable_attention_v2

    return multi_scale_deformable_attention_v2(value, [tuple(s) for s in shapes.tolist()], loc, w, POINTS, method)


@pytest.mark.parametrize("method", ["default", "discrete"])
def test_reference_with_points_per_level_is_transformers_v2_bit_for_bit(method):
    """RT-DETRv2's / D-FINE's function: output and gradients identical (discrete: no gradient reaches the
    locations, in either)."""
    args = flat_inputs()
    ours = grads(lambda *a: msda(*a, impl="reference", points_per_level=POINTS, method=method), args)
    theirs = grads(lambda *a: transformers_v2(*a, method=method), args)
    for name, a, b in zip(("out",) + GRAD_NAMES, ours, theirs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kernel", FUSED)
def test_fused_kernel_with_points_per_level_equals_the_reference_in_fp32(kernel):
    args = flat_inputs(device=device_of(kernel))
    ours = grads(lambda *a: msda(*a, impl=kernel, points_per_level=POINTS), args)
    ref = grads(lambda *a: msda(*a, impl="reference", points_per_level=POINTS), args)
    for c in fp32_comparisons(ours, ref):
        assert c.passed, c


def test_discrete_sampling_is_refused_by_the_fused_kernels_and_auto_takes_the_reference():
    args = flat_inputs()
    with pytest.raises(BackendUnavailableError, match="impl='cpu' samples bilinearly only; method='discrete'"):
        msda(*args, impl="cpu", points_per_level=POINTS, method="discrete")
    assert torch.equal(msda(*args, points_per_level=POINTS, method="discrete"),
                       msda(*args, impl="reference", points_per_level=POINTS, method="discrete"))


@pytest.mark.parametrize("points, message", [
    ([2, 3, 1], "points_per_level must be 4 positive ints"),
    ([2, 3, 0, 5], "points_per_level must be 4 positive ints"),
    ([2, 3, 1, 3], "sampling_locations_BQHLP2 must be [B=2, Q, heads=3, K=9, 2]"),
])
def test_bad_points_per_level_is_refused_naming_it(points, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        msda(*flat_inputs(), impl="reference", points_per_level=points)


def test_unknown_method_is_refused_naming_it():
    with pytest.raises(ValueError, match="method must be one of default, discrete"):
        msda(*inputs(), method="bilinear")


def test_cpu_kernel_gives_the_same_bits_on_any_number_of_threads():
    """Threads split the forward by (batch, query) and the backward by (batch, head); 2 images x 3
    heads over 4 threads puts one image's heads on two threads. Each value row is still summed by
    one thread in query order, so the result is the one-thread result, bit for bit."""
    args = inputs(B=2, heads=3, Q=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads(lambda *a: msda(*a, impl="cpu"), args)
        torch.set_num_threads(4)
        four = grads(lambda *a: msda(*a, impl="cpu"), args)
    finally:
        torch.set_num_threads(before)
    for name, a, b in zip(("out",) + GRAD_NAMES, one, four):
        assert torch.equal(a, b), name


def test_cpu_kernel_passes_gradcheck_in_fp64():
    """Its hand-written backward against finite differences (fp64, a tiny case; locations kept off
    the pixel grid, where bilinear sampling has a kink)."""
    value, shapes, start, loc, w = inputs(B=1, Q=2, heads=2, D=3, P=2, shapes=((3, 4), (2, 1)), dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda v, l, a: msda(v, shapes, start, l, a, impl="cpu"), (value, loc, w),
                                    eps=1e-6, atol=1e-7)


def test_cpu_kernel_compiles_in_one_graph():
    """torch.compile(fullgraph=True) through the seam: the op's fake implementation and autograd
    trace; forward and gradients equal eager's bit for bit (the same kernel runs)."""
    args = inputs()
    fn = lambda *a: msda(*a, impl="cpu")  # noqa: E731
    eager = grads(fn, args)
    compiled = grads(torch.compile(fn, fullgraph=True, backend="aot_eager"), args)
    for name, a, b in zip(("out",) + GRAD_NAMES, eager, compiled):
        assert torch.equal(a, b), name


def test_auto_picks_the_fused_cpu_kernel():
    args = inputs()
    assert torch.equal(msda(*args), msda(*args, impl="cpu"))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs Triton on CPU tensors")
def test_triton_on_cpu_is_refused_by_name_with_what_serves():
    with pytest.raises(BackendUnavailableError, match=r"impl='triton' runs on cuda only \(on CPU only under Triton's "
                       r"interpreter, TRITON_INTERPRET=1\).*this machine serves: reference, cpu"):
        msda(*inputs(), impl="triton")


def test_triton_refuses_fp64_by_name():
    args = inputs(dtype=torch.float64)
    with pytest.raises(BackendUnavailableError, match="takes fp32/bf16/fp16 on cuda, not float64"):
        deformable._kernel_name("triton", "cuda", torch.float64, True)
    assert deformable._kernel_name("auto", "cpu", torch.float64, True) == "cpu"  # the C++ kernel takes fp64
    assert torch.equal(msda(*args), msda(*args, impl="cpu"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this is the test that starts the interpreter run")
def test_triton_kernel_in_the_interpreter():
    """Every test above marked with the Triton kernel, in one subprocess under Triton's CPU interpreter
    (it is chosen when triton is imported)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton"],
                       capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


class Seam(nn.Module):
    """A module around the seam, for ``explain`` (which runs a module)."""

    def __init__(self, impl):
        super().__init__()
        self.impl = impl

    def forward(self, *args):
        return msda(*args, impl=self.impl)


@pytest.mark.parametrize("impl, forward, backward", [
    ("reference", "aten::grid_sampler_2d", "aten::grid_sampler_2d_backward"),
    ("cpu", "fastzoo_msda::forward", "fastzoo_msda::backward"),
    ("auto->cpu", "fastzoo_msda::forward", "fastzoo_msda::backward"),
    pytest.param("triton", "fastzoo::msda_triton_forward", "fastzoo::msda_triton_backward",
                 marks=FUSED[1].marks),
])
def test_explain_names_the_kernel_forward_and_backward(impl, forward, backward):
    report = explain(Seam(impl.partition("->")[0]), *inputs(device=device_of(impl)), backward=True)
    (row,) = report.rows
    assert (row.kind, row.where, row.requested) == ("deformable", "multi_scale_deformable_attention", f"impl={impl}")
    assert row.executed == [forward] and row.calls == 1 and row.fallback is None
    assert row.executed_backward == [backward]
