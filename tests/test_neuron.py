"""AWS Neuron (Trainium / Inferentia2): the ``neuron`` attention backend and the NKI GIoU kernels.

Neither neuronxcc nor torch-neuronx nor a Neuron device is present here, so these tests check:
the refusal at create (naming the packages and the install command), that nothing imports a
Neuron package at ``import fastzoo`` / ``fastzoo list``, the declarations, the backend's pure
helpers (sequence padding), and the GIoU kernels' host-side plumbing (planar layout, padding,
tile loop) plus their shared tile arithmetic run with torch ops. The NKI code itself is only run
by the simulator test, which skips without neuronxcc.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

import fastzoo
from fastzoo.attention import AttnContext, AttnRequest, backend_class, get_backend
from fastzoo.attention.base import package_available
from fastzoo.attention.neuron import PAD_BIAS, pad_bias, padded_len, seq_tile_size
from fastzoo.errors import BackendUnavailableError
from fastzoo.losses.kernels import giou_op, nki_giou
from conftest import TINY

NEURON_MODULES = ("neuronxcc", "torch_neuronx", "torch_xla", "libneuronxla")
INSTALL = "pip install torch-neuronx neuronx-cc --extra-index-url=https://pip.repos.neuron.amazonaws.com"
ROOT = Path(__file__).resolve().parents[1]
has_neuron = backend_class("neuron").is_available()
has_neuronxcc = package_available("neuronxcc")


# -- the attention backend: refusal, imports, declarations ----------------------------------------
@pytest.mark.skipif(has_neuron, reason="a Neuron device is present: the refusal cannot be shown")
def test_create_refuses_naming_packages_and_install_command():
    with pytest.raises(BackendUnavailableError) as e:
        fastzoo.create("vit_b16", attn="neuron")
    msg = str(e.value)
    assert "'neuron'" in msg and INSTALL in msg
    if not has_neuronxcc:
        assert "neuronxcc" in msg and "torch_neuronx" in msg
    assert "runs on xla only" in msg and "Available on this machine: " in msg


@pytest.mark.skipif(has_neuron, reason="a Neuron device is present")
def test_refusal_leaves_the_model_unchanged():
    model = fastzoo.create("vit_s16", attn="eager", **TINY["vit"])
    with pytest.raises(BackendUnavailableError):
        model.set_attention("neuron")
    assert model.attn_name == "eager"


def test_import_list_and_giou_ops_import_no_neuron_package():
    code = (
        "import sys, fastzoo\n"
        "from fastzoo.cli import main\n"
        "main(['list'])\n"
        "from fastzoo.attention import backend_class\n"
        "backend_class('neuron').unavailable_reason()\n"
        "from fastzoo.losses.kernels import giou_op, nki_giou\n"
        "giou_op.kernel_path('xla')\n"
        f"loaded = [m for m in {NEURON_MODULES!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "neuron" in out.stdout  # `fastzoo list` shows the backend (with why it is unavailable)


def test_declarations():
    caps = backend_class("neuron").capabilities
    assert set(caps.devices) == {"xla"} and set(caps.devices["xla"]) == {torch.bfloat16, torch.float16}
    assert caps.backward == ("xla",) and caps.causal
    assert not caps.padding_mask and not caps.varlen and not caps.score_mod and not caps.compile
    assert caps.max_head_dim == 128  # flash_fwd asserts d <= 128
    assert caps.packages == ("neuronxcc", "torch_neuronx") and caps.install == INSTALL
    assert caps.verified == "not verified on hardware"


@pytest.mark.parametrize("req,words", [
    (AttnRequest(head_dim=256, device="xla", dtype=torch.bfloat16), "head dim <= 128"),
    (AttnRequest(head_dim=64, device="xla", dtype=torch.float32), "does not take fp32 on xla"),
    (AttnRequest(head_dim=64, device="cpu"), "does not run on cpu"),
    (AttnRequest(head_dim=64, device="xla", padding_mask=True), "no key-padding mask"),
    (AttnRequest(head_dim=64, device="xla", varlen=True), "no packed sequences"),
])
def test_impossible_requests_are_refused(req, words):
    with pytest.raises(BackendUnavailableError, match=words):
        get_backend("neuron").check(req)


def test_cpu_tensors_are_refused_per_call_before_any_kernel():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(BackendUnavailableError, match="got tensors on cpu"):
        get_backend("neuron")(q, q, q, AttnContext())


# -- the backend's sequence padding (pure torch) ----------------------------------------------------
@pytest.mark.parametrize("seqlen,padded,tile", [(197, 512, 512), (512, 512, 512), (1024, 1024, 1024),
                                                 (1025, 1536, 512), (4096, 4096, 2048), (3000, 3072, 1024)])
def test_sequence_padding_and_tile_size(seqlen, padded, tile):
    assert padded_len(seqlen) == padded
    assert seq_tile_size(padded) == tile  # FlashConfig.seq_tile_size: >= 512, divides the length


def test_pad_bias_hides_padded_keys_exactly():
    """The padding rule the backend relies on, shown with eager math on CPU (not the kernel):
    zero-padded tokens plus the [1, 1, P, P] bias give the unpadded attention on the real rows."""
    S, P, D = 5, 8, 4
    q, k, v = (torch.randn(2, 3, S, D) for _ in range(3))
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, P - S))  # noqa: E731
    bias = pad_bias(S, P, dtype=torch.float32, device="cpu")
    assert bias.shape == (1, 1, P, P) and (bias[..., :S] == 0).all() and (bias[..., S:] == PAD_BIAS).all()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ours = torch.nn.functional.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=bias)[:, :, :S]
    assert (ours - ref).abs().max() <= 1e-6  # fp32: exp(PAD_BIAS) underflows to exactly 0


# -- the NKI GIoU kernels: host-side plumbing and the shared tile arithmetic ------------------------
def _boxes(n, generator):
    xy = torch.rand(n, 2, generator=generator) * 10
    wh = torch.rand(n, 2, generator=generator) * 5
    wh[::7] = 0.0  # degenerate boxes
    return torch.cat([xy, xy + wh], -1)


def _pairs(n):
    g = torch.Generator().manual_seed(n)
    pred, target = _boxes(n, g), _boxes(n, g)
    target[::5] = pred[::5]  # identical boxes: ties in every max/min
    target[1::5, :2] = pred[1::5, :2]  # shared edges
    touch = pred[2::5].clone()
    touch[:, [0, 2]] += touch[:, 2:3] - touch[:, 0:1]  # touching boxes (zero-width intersection)
    target[2::5] = touch
    return pred, target


def _maxabs(x):
    return x.abs().max().item() if x.numel() else 0.0


def _host_tile_loop(body, n_outputs, planar, m, f):
    """The kernels' loop over column tiles (``nl.affine_range(m // f)`` with ``nl.ds(t * f, f)``),
    run on the host with torch tiles: the stand-in for the NKI tile body, to test the plumbing."""
    outs = [torch.empty(128, m) for _ in range(n_outputs)]
    for t in range(m // f):
        cols = slice(t * f, (t + 1) * f)
        results = body(*(x[..., cols] for x in planar))
        for out, r in zip(outs, results):
            out[:, cols] = r
    return outs


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 70_000])  # 70k > 128 * 512: several tiles + a padded tail
def test_nki_giou_host_plumbing_and_tile_arithmetic_match_the_closed_form(n):
    """Host-side plumbing (plan, planar layout, unit-box padding, tile loop, cutting the tail) and
    the kernels' tile arithmetic (tile_forward / tile_backward) run with torch ops on CPU, against
    giou_op's closed form and torchvision's loss. This does NOT run NKI: the simulator test does."""
    pred, target = _pairs(n)
    m, f = nki_giou.plan(n)
    assert m % f == 0 and f <= nki_giou.FMAX and 128 * m >= n
    assert 128 * (m - f) < n or n == 0  # no whole tile of padding
    p_4PM, t_4PM = nki_giou.to_planar(pred, m), nki_giou.to_planar(target, m)
    assert p_4PM.shape == (4, 128, m)
    torch.testing.assert_close(nki_giou.from_planar_boxes(p_4PM, n), pred, rtol=0, atol=0)  # a permutation

    ops, eps = nki_giou.TORCH_OPS, 1e-7
    unpack = lambda x_4PM: tuple(x_4PM.unbind(0))  # noqa: E731
    (loss_PM,) = _host_tile_loop(lambda p, t: (nki_giou.tile_forward(ops, unpack(p), unpack(t), eps),), 1, (p_4PM, t_4PM), m, f)
    grad_N = torch.rand(n, generator=torch.Generator().manual_seed(1))
    grad_PM = torch.zeros(128 * m)
    grad_PM[:n] = grad_N

    def bwd(g, p, t):
        gp, gt = nki_giou.tile_backward(ops, g, unpack(p), unpack(t), eps)
        return (*gp, *gt)

    grads = _host_tile_loop(bwd, 8, (grad_PM.reshape(128, m), p_4PM, t_4PM), m, f)
    assert torch.isfinite(loss_PM).all()  # the unit-box padding computes no NaN
    loss = nki_giou.from_planar(loss_PM, n)
    gp = nki_giou.from_planar_boxes(torch.stack(grads[:4]), n)
    gt = nki_giou.from_planar_boxes(torch.stack(grads[4:]), n)

    # The tile bodies are exact rewrites of giou_op's closed form (same op order; complementary tie
    # weights and "* -1.0" instead of "1 - t" and unary minus), so equal to the last bit.
    ref_gp, ref_gt = giou_op._backward_vectorised(grad_N, pred, target, eps)
    torch.testing.assert_close(loss, giou_op._forward_vectorised(pred, target, eps), rtol=0, atol=0)
    torch.testing.assert_close(gp, ref_gp, rtol=0, atol=0)
    torch.testing.assert_close(gt, ref_gt, rtol=0, atol=0)
    # and the loss is torchvision's (fp32, same formula and op order; test_giou ties the closed-form gradients to it)
    ref = torchvision.ops.generalized_box_iou_loss(pred, target, reduction="none", eps=eps)
    assert _maxabs(loss - ref) <= 1e-6


def test_nki_giou_tie_rules_are_autograd_s():
    """Identical boxes: every max/min ties, so autograd splits each gradient half-half; the tile
    backward (complementary tie weights) must give torchvision's exact values."""
    box = torch.tensor([[1.0, 2.0, 4.0, 6.0]])
    pr, tr = box.clone().requires_grad_(), box.clone().requires_grad_()
    torchvision.ops.generalized_box_iou_loss(pr, tr, reduction="sum").backward()
    gp, gt = nki_giou.tile_backward(nki_giou.TORCH_OPS, torch.ones(1), box.T.unbind(0), box.T.unbind(0), 1e-7)
    torch.testing.assert_close(torch.stack(gp, -1), pr.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.stack(gt, -1), tr.grad, rtol=1e-6, atol=0)


def test_giou_kernel_path_on_xla_without_neuronxcc():
    expected = "nki" if has_neuronxcc else "xla-vectorised"
    assert giou_op.kernel_path("xla") == expected
    assert fastzoo.losses.kernel_path("xla") == expected


@pytest.mark.skipif(not has_neuronxcc, reason="needs neuronxcc (the NKI compiler and its CPU simulator); not installed here")
def test_nki_giou_simulator_matches_torchvision():
    """The NKI kernels themselves in neuronxcc's CPU simulator (nki.simulate_kernel, numpy in/out)."""
    from neuronxcc import nki

    n, eps = 300, 1e-7
    pred, target = _pairs(n)
    m, _ = nki_giou.plan(n)
    p_4PM, t_4PM = (nki_giou.to_planar(x, m).numpy() for x in (pred, target))
    fwd, bwd = nki_giou.kernels()
    loss = nki_giou.from_planar(torch.from_numpy(nki.simulate_kernel(fwd, p_4PM, t_4PM, eps)), n)
    grad_PM = torch.zeros(128 * m)
    grad_PM[:n] = 1.0
    gp_4PM, gt_4PM = nki.simulate_kernel(bwd, grad_PM.reshape(128, m).numpy(), p_4PM, t_4PM, eps)
    ref_gp, ref_gt = giou_op._backward_vectorised(torch.ones(n), pred, target, eps)
    ref = torchvision.ops.generalized_box_iou_loss(pred, target, reduction="none", eps=eps)
    assert _maxabs(loss - ref) <= 1e-4  # fp32, fastzoo.equivalence's rule; the simulator approximates the hardware's arithmetic
    # gradients reach ~1/eps for degenerate pairs: relative, as in test_giou's fp32 comparisons
    torch.testing.assert_close(nki_giou.from_planar_boxes(torch.from_numpy(gp_4PM), n), ref_gp, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(nki_giou.from_planar_boxes(torch.from_numpy(gt_4PM), n), ref_gt, rtol=1e-4, atol=1e-5)
