"""fastzoo.explain: the kernel each attention layer and loss really ran, from the profiler.

Everything here runs on CPU with PyTorch's own kernels: SDPA's automatic choice, its pinned
math and flash kernels, the eager reference, a fallback PyTorch forces (dropout in training
takes SDPA off its CPU flash kernel; NestedTensor SDPA has no causal kernel on CPU), and the
fused GIoU op.
"""
import pytest
import torch

import fastzoo
from fastzoo.kernel_report import KernelFallbackError, explain
from fastzoo.losses import giou_loss
from conftest import TINY

FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"
SDPA_CASES = [({}, FLASH_CPU), ({"sdpa_backend": "math"}, MATH), ({"sdpa_backend": "flash"}, FLASH_CPU)]


def vit_and_input():
    return fastzoo.create("vit_s16", attn="sdpa", **TINY["vit"]).eval(), torch.randn(2, 3, 32, 32)


def gpt2_and_input():
    model = fastzoo.create("gpt2", attn="sdpa", **TINY["gpt2"]).eval()
    ids = torch.randint(0, TINY["gpt2"]["vocab_size"], (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    return model, (ids,), {"attention_mask": mask}


@pytest.mark.parametrize("options,op", SDPA_CASES, ids=["auto", "math", "flash"])
def test_vit_sdpa_kernel_is_identified_per_layer_forward_and_backward(options, op):
    model, x = vit_and_input()
    model.set_attention("sdpa", **options)
    report = explain(model, x, backward=True)
    assert [r.where for r in report.rows] == ["blocks.0.attn", "blocks.1.attn"]
    for row in report.rows:
        assert row.executed == [op] and row.fallback is None and row.calls == 1
        assert row.executed_backward  # the backward ops of that very kernel, found by sequence number
    if op == FLASH_CPU:
        assert report.rows[0].executed_backward == [FLASH_CPU + "_backward"]


@pytest.mark.parametrize("options,op", SDPA_CASES, ids=["auto", "math", "flash"])
def test_gpt2_padded_sdpa_kernel_is_identified(options, op):
    model, args, kwargs = gpt2_and_input()
    model.set_attention("sdpa", **options)
    report = explain(model, *args, **kwargs)
    assert [r.executed for r in report.rows] == [[op], [op]]
    assert not report.fallbacks


def test_each_layer_is_attributed_its_own_kernel():
    model, x = vit_and_input()
    model.blocks[1].attn.backend = fastzoo.get_backend("eager")
    first, second = explain(model, x).rows
    assert first.executed == [FLASH_CPU]
    assert second.executed == ["aten::bmm", "aten::softmax"] and second.requested.startswith("eager")


def test_a_fallback_pytorch_forces_is_an_error_naming_the_reason():
    """GPT-2 in training mode has attn_pdrop=0.1: PyTorch's CPU flash kernel takes no dropout,
    so SDPA's automatic choice runs math."""
    model, args, kwargs = gpt2_and_input()
    model.train()
    with pytest.raises(KernelFallbackError, match="CPU flash kernel takes no dropout") as e:
        explain(model, *args, **kwargs)
    rows = e.value.explanation.rows
    assert all(r.executed == [MATH] for r in rows)


def test_allow_fallback_returns_the_report_with_the_reason():
    model, args, kwargs = gpt2_and_input()
    report = explain(model.train(), *args, allow_fallback=True, **kwargs)
    assert len(report.fallbacks) == 2 and "dropout_p=0.1" in report.fallbacks[0].fallback
    assert "fallback" in report.table() and "dropout" in report.table()


def test_nested_causal_on_cpu_is_reported_as_a_fallback_to_dense_sdpa():
    model = fastzoo.create("gpt2", attn="nested", **TINY["gpt2"]).eval()
    ids = torch.randint(0, 128, (1, 10))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    report = explain(model, ids, cu_seqlens=cu, max_seqlen=6, allow_fallback=True)
    assert all("no causal kernel on CPU" in r.fallback and r.executed == [FLASH_CPU] for r in report.rows)


def test_nested_non_causal_on_cpu_runs_jagged_sdpa_and_is_no_fallback():
    """ViT (one length, no mask) through jagged SDPA on CPU: SDPA's math kernel on the jagged views, which
    a dense call may also run, so the jagged tensors' construction is what shows the path ran."""
    model = fastzoo.create("vit_s16", attn="nested", **TINY["vit"]).train()
    report = explain(model, torch.randn(2, 3, 32, 32))
    assert report.rows and all(r.fallback is None and "aten::_nested_view_from_jagged" in r.executed for r in report.rows)
    assert any("_scaled_dot_product_attention_math" in op for r in report.rows for op in r.executed)


def test_backends_are_restored_after_explain_even_when_it_raises():
    model, args, kwargs = gpt2_and_input()
    before = [m.backend for m in model.modules() if hasattr(m, "backend")]
    with pytest.raises(KernelFallbackError):
        explain(model.train(), *args, **kwargs)
    assert [m.backend for m in model.modules() if hasattr(m, "backend")] == before


class BoxLoss(torch.nn.Module):
    def __init__(self, impl):
        super().__init__()
        self.impl = impl

    def forward(self, pred, target):
        return giou_loss(pred, target, reduction="sum", impl=self.impl)


def boxes():
    pred = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.2, 0.2, 0.6, 0.9]], requires_grad=True)
    target = torch.tensor([[0.1, 0.0, 1.0, 1.2], [0.2, 0.3, 0.5, 0.9]])
    return pred, target


def test_giou_fused_kernel_is_identified_forward_and_backward():
    from fastzoo.losses.kernels import giou_op

    report = explain(BoxLoss("kernel"), *boxes(), backward=True, allow_fallback=True)
    (row,) = report.rows
    assert row.kind == "loss" and row.where == "giou_loss" and row.requested == "giou_loss impl=kernel"
    compiled = giou_op.kernel_path("cpu") == "cpu-cpp"
    assert row.executed == [f"fastzoo::giou_loss_fwd ({'compiled kernel' if compiled else 'vectorised closed form'})"]
    assert row.executed_backward == ["fastzoo::giou_loss_bwd"]
    assert (row.fallback is None) == compiled  # a C++ kernel that could not be built is a fallback, named


@pytest.mark.parametrize("mask_form", [True, False], ids=["mask", "from-target"])
def test_giou_padded_kernel_is_identified_in_both_forms(mask_form):
    """The from-target form reads validity through its own op (fastzoo::giou_valid_rows) inside the
    padded op: still the compiled kernel, not mistaken for the vectorised fallback."""
    from fastzoo.losses import giou_loss_padded
    from fastzoo.losses.giou import PAD_BOX
    from fastzoo.losses.kernels import giou_op

    pred, target = boxes()
    target = torch.cat([target, torch.tensor([PAD_BOX])])[None]
    pred = torch.cat([pred.detach(), torch.rand(1, 4)])[None].requires_grad_()
    mask = torch.tensor([[True, True, False]]) if mask_form else None
    report = explain(torch.nn.Identity(), pred, backward=True, allow_fallback=True,
                     loss=lambda p: giou_loss_padded(p, target, mask, impl="kernel"))
    (row,) = report.rows
    compiled = giou_op.kernel_path("cpu") == "cpu-cpp"
    assert row.executed[0] == f"fastzoo::giou_loss_masked ({'compiled kernel' if compiled else 'vectorised closed form'})"
    assert row.executed_backward == ["fastzoo::giou_loss_masked_bwd"]
    assert (row.fallback is None) == compiled


def test_giou_torch_impl_runs_no_fused_op_and_is_no_fallback():
    (row,) = explain(BoxLoss("torch"), *boxes()).rows
    assert row.requested == "giou_loss impl=torch"
    assert not any(n.startswith("fastzoo::") for n in row.executed) and row.fallback is None


def test_a_loss_passed_to_explain_is_reported_beside_the_layers():
    model, x = vit_and_input()
    target = torch.tensor([[0.1, 0.0, 1.0, 1.2], [0.2, 0.3, 0.5, 0.9]])
    report = explain(model, x, backward=True, allow_fallback=True,
                     loss=lambda logits: giou_loss(logits[:, :4].sigmoid().cumsum(-1), target, reduction="sum"))
    assert [r.kind for r in report.rows] == ["attention", "attention", "loss"]


def test_check_explain_prints_the_kernel_table(capsys):
    from fastzoo.cli import main

    rc = main(["check", "vit_s16", "--tiny", "--attn", "sdpa:sdpa_backend=math", "--explain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Kernels of sdpa:sdpa_backend=math:" in out
    assert f"| blocks.0-1.attn | sdpa (sdpa_backend=math): {MATH} | {MATH} |" in out


def test_check_explain_fails_on_a_fallback_unless_allowed(capsys):
    from fastzoo.cli import main

    args = ["check", "gpt2", "--tiny", "--attn", "nested", "--no-grad", "--explain"]
    assert main(args) == 1
    assert "Kernels of nested: FALLBACK" in capsys.readouterr().out
    assert main(args + ["--allow-fallback"]) == 0
    assert "no causal kernel on CPU" in capsys.readouterr().out


def test_readme_recipe():
    """README "Attention backends": the explain snippet as written (ViT-S/16, batch 2)."""
    model = fastzoo.create("vit_s16", attn="sdpa")
    report = fastzoo.explain(model, torch.randn(2, 3, 224, 224), backward=True)
    assert "| blocks.0-11.attn | sdpa: a fused SDPA kernel" in str(report)
    assert all(r.executed == [FLASH_CPU] for r in report.rows)


@pytest.mark.parametrize("impl,forward,backward", [
    ("fused", "_FusedLinearCrossEntropy", "_FusedLinearCrossEntropyBackward"),
    ("reference", "aten::cross_entropy_loss", "aten::nll_loss_backward"),
])
def test_linear_cross_entropy_kernel_is_identified(impl, forward, backward):
    from fastzoo.losses import linear_cross_entropy

    class LMHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(50, 16))

        def forward(self, hidden, target):
            return linear_cross_entropy(hidden, self.weight, target, impl=impl)

    (row,) = explain(LMHead(), torch.randn(8, 16), torch.randint(0, 50, (8,)), backward=True).rows
    assert row.where == "linear_cross_entropy" and row.requested == f"linear_cross_entropy impl={impl}"
    assert row.executed == [forward] and backward in row.executed_backward
