"""The parity harness: it passes for correct backends, fails for wrong ones, and its CLI reports both."""
import json

import pytest
import torch
import torch.nn.functional as F

import fastzoo
from fastzoo.attention import _REGISTRY
from fastzoo.attention.base import BF16, FP32, Capabilities
from fastzoo.cli import main
from fastzoo.errors import BackendUnavailableError
from fastzoo.parity import FP32_GRAD_RTOL, FP32_OUT_ATOL, TINY, check_parity, parse_backend_spec

VIT = dict(overrides=TINY["vit"])


@pytest.fixture
def register():
    """Register test backends under fresh names and remove them afterwards."""
    added = []

    def _register(name, fn, caps):
        fastzoo.register_attention(name, fn, capabilities=caps)
        added.append(name)

    yield _register
    for name in added:
        _REGISTRY.pop(name, None)


CPU_FP32 = Capabilities(devices={"cpu": (FP32,)})


def _wrong_scale(q, k, v, ctx):  # forgets the 1/sqrt(d) scale
    return F.scaled_dot_product_attention(q, k, v, scale=1.0)


def _no_grad_through_keys(q, k, v, ctx):  # right forward, wrong backward: k and v get no gradient
    return F.scaled_dot_product_attention(q, k.detach(), v.detach(), scale=ctx.scale)


@pytest.mark.parametrize("backend,options", [("eager", {}), ("sdpa", {}), ("sdpa", {"sdpa_backend": "math"})])
def test_correct_backends_pass_with_gradients(backend, options):
    res = check_parity("vit_s16", backend, backend_options=options, **VIT)
    assert [c.name for c in res.comparisons] == ["logits", "grads"]
    assert res.passed, res.rows()
    # DESIGN.md: fp32 CPU logits within 1e-4; gradients within 1e-4 relative (observed ~1e-7 / ~1e-6).
    assert res.comparisons[0].err <= FP32_OUT_ATOL and res.comparisons[1].err <= FP32_GRAD_RTOL


def test_flex_on_cpu_is_checked_for_inference_and_says_why_not_gradients():
    res = check_parity("vit_s16", "flex", **VIT)
    assert res.passed and [c.name for c in res.comparisons] == ["logits"]
    assert any("no backward on cpu" in n for n in res.notes)


def test_low_precision_rule_uses_the_eager_peer_in_that_dtype():
    res = check_parity("vit_s16", "sdpa", dtype=torch.bfloat16, **VIT)
    logits = res.comparisons[0]
    assert logits.peer_err is not None and logits.peer_err > 0  # bf16 eager is itself inexact
    assert logits.bound == pytest.approx(3 * logits.peer_err + 1e-5)
    assert res.passed, res.rows()


def test_a_wrong_forward_fails(register):
    register("wrong_scale", _wrong_scale, CPU_FP32)
    res = check_parity("vit_s16", "wrong_scale", **VIT)
    assert not res.passed
    assert not res.comparisons[0].passed and res.comparisons[0].err > 10 * FP32_OUT_ATOL  # observed ~7e-3


def test_a_wrong_backward_fails_even_when_the_forward_is_right(register):
    register("no_kv_grad", _no_grad_through_keys, CPU_FP32)
    res = check_parity("vit_s16", "no_kv_grad", **VIT)
    logits, grads = res.comparisons
    assert logits.passed  # the forward is exact
    assert not grads.passed and grads.err > 0.1 and grads.worst  # observed ~1.0: gradients far off, named


def test_a_wrong_backend_fails_in_low_precision_too(register):
    register("wrong_scale_bf16", _wrong_scale, Capabilities(devices={"cpu": (BF16,)}))
    res = check_parity("vit_s16", "wrong_scale_bf16", dtype=torch.bfloat16, train=False, **VIT)
    assert not res.passed


def test_registered_function_backend_works_end_to_end(register):
    def mine(q, k, v, ctx):
        return F.scaled_dot_product_attention(q, k, v, scale=ctx.scale)

    register("parity_user_fn", mine, CPU_FP32)
    torch.manual_seed(0)
    ref = fastzoo.create("vit_s16", attn="eager", **TINY["vit"]).eval()
    model = fastzoo.create("vit_s16", attn="parity_user_fn", **TINY["vit"]).eval()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert (model(x) - ref(x)).abs().max() <= 1e-4  # DESIGN.md fp32 CPU tolerance
    assert check_parity("vit_s16", "parity_user_fn", **VIT).passed
    # its declaration is enforced like a built-in's: fp32-only, so bf16 is refused at create
    with pytest.raises(BackendUnavailableError, match="does not take bf16 on cpu"):
        fastzoo.create("vit_s16", attn="parity_user_fn", device="cpu", dtype=torch.bfloat16, **TINY["vit"])


def test_unavailable_backend_raises_like_create():
    if fastzoo.attention.backend_class("fa2").is_available():
        pytest.skip("fa2 is available here")
    with pytest.raises(BackendUnavailableError, match="fa2"):
        check_parity("vit_s16", "fa2", device="cpu", dtype=torch.bfloat16, **VIT)


def test_model_without_attention_is_refused_by_name():
    with pytest.raises(ValueError, match="no attention to check"):
        check_parity("resnet50", "sdpa")


def test_backend_spec_parsing():
    assert parse_backend_spec("sdpa") == ("sdpa", {})
    assert parse_backend_spec("sdpa:sdpa_backend=math") == ("sdpa", {"sdpa_backend": "math"})
    assert parse_backend_spec("flex:window=64:compile=False") == ("flex", {"window": 64, "compile": False})
    with pytest.raises(ValueError, match="key=value"):
        parse_backend_spec("sdpa:math")


def test_cli_check_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "parity.json"
    rc = main(["check", "vit_s16", "--tiny", "--attn", "sdpa", "sdpa:sdpa_backend=math", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| sdpa (sdpa_backend=math) | cpu | fp32 | grads |" in text
    data = json.loads(out.read_text())
    assert [r["passed"] for r in data["results"]] == [True, True]


def test_cli_check_exits_nonzero_on_failure_and_on_unavailable_named_backend(register, capsys):
    register("wrong_scale_cli", _wrong_scale, CPU_FP32)
    assert main(["check", "vit_s16", "--tiny", "--attn", "wrong_scale_cli"]) == 1
    assert "FAIL" in capsys.readouterr().out
    if not fastzoo.attention.backend_class("xformers").is_available():
        assert main(["check", "vit_s16", "--tiny", "--no-grad", "--attn", "xformers"]) == 1
        assert "unavailable: " in capsys.readouterr().out


def test_cli_list_markdown_is_the_bare_matrix(capsys):
    assert main(["list", "--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| backend |") and "verified" in lines[0] and "available here" not in lines[0]
    names = {line.split("|")[1].strip() for line in lines[2:]}
    assert {"eager", "sdpa", "flex", "fa2", "fa3", "te", "xformers"} <= names


def test_gpt2_padded_and_packed_against_the_padded_reference():
    res = check_parity("gpt2", "sdpa", overrides=TINY["gpt2"])
    names = [c.name for c in res.comparisons]
    assert names == ["logits (padded)", "grads (padded)", "logits (packed)", "grads (packed)"]
    assert res.passed, res.rows()
