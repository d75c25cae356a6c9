"""Multi-scale deformable attention (``fastzoo.attention.deformable``): the reference equals
transformers' ``MultiScaleDeformableAttention`` bit for bit; every kernel equals the reference within
the rule, values and gradients; bad input and kernels that cannot serve are refused by name;
``explain`` names the kernel that ran."""
import pytest
import torch
from torch import nn

from fastzoo.attention import deformable
from fastzoo.attention.deformable import multi_scale_deformable_attention as msda
from fastzoo.errors import BackendUnavailableError
from fastzoo.kernel_report import explain

# Four levels of different, odd sizes (one a single pixel), as a strided feature pyramid gives.
SHAPES = ((7, 9), (4, 5), (2, 3), (1, 1))


def inputs(B=2, Q=5, heads=3, D=4, P=3, shapes=SHAPES, dtype=torch.float32, spread=1.4, seed=0):
    """value, spatial_shapes, level_start_index, sampling_locations, attention_weights, leaves
    requiring grad. Locations in [-0.2, 1.2] (``spread`` 1.4): some points fall outside the image,
    where sampling reads zeros."""
    g = torch.Generator().manual_seed(seed)
    shapes_L2 = torch.tensor(shapes, dtype=torch.int64)
    sizes = shapes_L2[:, 0] * shapes_L2[:, 1]
    start_L = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    L = len(shapes)
    value = torch.randn(B, int(sizes.sum()), heads, D, generator=g).to(dtype).requires_grad_()
    loc = (torch.rand(B, Q, heads, L, P, 2, generator=g) * spread - (spread - 1) / 2).to(dtype).requires_grad_()
    weights = torch.rand(B, Q, heads, L, P, generator=g).softmax(-1).to(dtype).requires_grad_()
    return value, shapes_L2, start_L, loc, weights


def transformers_msda(value, shapes_L2, start_L, loc, weights):
    from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention

    return MultiScaleDeformableAttention()(value, shapes_L2, shapes_L2.tolist(), start_L, loc, weights, 64)


def grads(fn, args, seed=1):
    """Output and the gradients of value, sampling locations and attention weights under a fixed
    random upstream gradient (not ones: a sum would hide a permuted output)."""
    out = fn(*args)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    leaves = (args[0], args[3], args[4])
    return (out, *torch.autograd.grad(out, leaves, upstream))


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
], ids=["value-rank", "shapes-dtype", "start-count", "start-values", "tokens", "locations-shape",
        "weights-shape", "locations-dtype"])
def test_bad_input_is_refused_naming_the_argument(break_it, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        msda(*break_it(inputs()), impl="reference")


def test_unknown_impl_is_refused_with_the_known_ones():
    with pytest.raises(KeyError, match="'referense'.*reference"):
        msda(*inputs(), impl="referense")


def test_reference_refuses_an_integer_dtype_by_name():
    """Capabilities are checked before the call: a dtype no kernel declares is refused, naming what serves."""
    kernel = deformable.KERNELS["reference"]
    assert deformable.serves(kernel, torch.device("cpu"), torch.int32, False) == \
        "takes fp32/bf16/fp16/float64 on cpu, not int32"


class Seam(nn.Module):
    """A module around the seam, for ``explain`` (which runs a module)."""

    def __init__(self, impl):
        super().__init__()
        self.impl = impl

    def forward(self, *args):
        return msda(*args, impl=self.impl)


def test_explain_names_the_reference_kernel_forward_and_backward():
    report = explain(Seam("reference"), *inputs(), backward=True)
    (row,) = report.rows
    assert (row.kind, row.where, row.requested) == ("deformable", "multi_scale_deformable_attention", "impl=reference")
    assert row.executed == ["aten::grid_sampler_2d"] and row.calls == 1 and row.fallback is None
    assert row.executed_backward == ["aten::grid_sampler_2d_backward"]
