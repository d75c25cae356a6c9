"""fastzoo.equivalence: a fastzoo model against the original library's model (timm's ViT,
Hugging Face's GPT-2) on the same weights and inputs. It passes for correct backends, fails
for wrong ones, names the first layer where the two models part, and its CLI reports all of it."""
import copy
import importlib
import json

import pytest
import torch
import torch.nn.functional as F

import fastzoo
from fastzoo.attention import _REGISTRY
from fastzoo.attention.base import BF16, FP32, Capabilities
from fastzoo.cli import main
from fastzoo.errors import BackendUnavailableError
from fastzoo import equivalence
from fastzoo.cli import parse_backend_spec
from conftest import TINY
from fastzoo.equivalence import FP32_GRAD_RTOL, FP32_LAYER_RTOL, FP32_OUT_ATOL
from fastzoo.equivalence import check as check_parity

VIT = dict(overrides=TINY["vit"])
NORMS = "normalisations at variance ~eps"  # equivalence.norms' comparison


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
    assert [c.name for c in res.comparisons] == ["logits", "grads", NORMS]
    assert res.passed, res.rows()
    # fastzoo.equivalence: fp32 CPU logits within 1e-4; gradients within 1e-4 relative (observed ~1e-7 / ~1e-6).
    assert res.comparisons[0].err <= FP32_OUT_ATOL and res.comparisons[1].err <= FP32_GRAD_RTOL


def test_flex_on_cpu_is_checked_for_inference_and_says_why_not_gradients():
    res = check_parity("vit_s16", "flex", **VIT)
    assert res.passed and [c.name for c in res.comparisons] == ["logits", NORMS]
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
    logits, grads, norms = res.comparisons
    assert logits.passed and norms.passed  # the forward is exact
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
    assert (model(x) - ref(x)).abs().max() <= 1e-4  # fastzoo.equivalence's fp32 CPU tolerance
    assert check_parity("vit_s16", "parity_user_fn", **VIT).passed
    # its declaration is enforced like a built-in's: fp32-only, so bf16 is refused at create
    with pytest.raises(BackendUnavailableError, match="does not take bf16 on cpu"):
        fastzoo.create("vit_s16", attn="parity_user_fn", device="cpu", dtype=torch.bfloat16, **TINY["vit"])


def test_unavailable_backend_raises_like_create():
    if fastzoo.attention.backend_class("fa2").is_available():
        pytest.skip("fa2 is available here")
    with pytest.raises(BackendUnavailableError, match="fa2"):
        check_parity("vit_s16", "fa2", device="cpu", dtype=torch.bfloat16, **VIT)


def test_model_without_an_original_is_refused_by_name(monkeypatch):
    """A family registered without an original (a user's own) cannot be checked, and is told so."""
    import dataclasses
    import importlib
    import types

    module = importlib.import_module("fastzoo.equivalence.check")
    spec = dataclasses.replace(module.get_entry("detr").spec, family="mydet", original=None)
    monkeypatch.setattr(module, "get_entry", lambda name: types.SimpleNamespace(spec=spec))
    with pytest.raises(ValueError, match="mydet_tiny.*no original to check against"):
        check_parity("mydet_tiny", "sdpa")


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
    assert names == ["logits (padded)", "grads (padded)", "logits (packed)", "grads (packed)", NORMS]
    assert res.passed, res.rows()


# -- the first diverging layer ---------------------------------------------------------------------
def _scaled_backward(q, k, v, ctx):  # exact forward; the backward scales every gradient by 1.5
    o = F.scaled_dot_product_attention(q, k, v, scale=ctx.scale)
    return o.detach() + 1.5 * (o - o.detach())


def _vit_pair():
    original = equivalence.original("vit_s16", **TINY["vit"])
    return fastzoo.create("vit_s16", attn="eager", pretrained=original).eval(), original


def test_correct_backend_has_no_diverging_layer_and_every_layer_within_tolerance():
    res = check_parity("vit_s16", "sdpa", layers=True, **VIT)
    report = res.layers["images"]
    assert report.first is None, report.rows()
    assert {"blocks.0.attn", "blocks.1.mlp.fc1", "head"} <= {d.name for d in report.layers}  # matched by name
    # fp32: every layer's output and gradients within 1e-4 of the original's scale (observed <1e-6)
    errs = [e for d in report.layers for e in (d.output_err, d.grad_out_err, d.grad_in_err) if e is not None]
    assert errs and max(errs) <= FP32_LAYER_RTOL


def test_a_perturbed_weight_is_found_in_exactly_its_layer():
    ours, original = _vit_pair()
    with torch.no_grad():
        ours.blocks[1].mlp.fc1.weight[0, 0] += 0.1  # one weight of one layer, fastzoo side only
    comps, report = equivalence.compare(ours, original, (torch.randn(2, 3, 32, 32),), layers=True)
    assert not comps[0].passed
    assert report.first.name == "blocks.1.mlp.fc1"
    assert report.first_forward is report.first
    before = [d for d in report.layers[: report.layers.index(report.first)]]
    assert before and not any(d.forward_diverges for d in before)  # everything upstream still agrees


def test_a_parameter_lost_in_the_port_fails_the_gradients_and_a_tied_head_does_not():
    """GPT-2's head is tied to its token embedding (one parameter, two names on both sides): the
    correct port passes with gradients; a bias the port lost (its original has it) is a gradient on
    one side only, which fails by name even where the forward cannot tell (a forward-only check does)."""
    from fastzoo.equivalence.check import original
    ref = original("gpt2", **TINY["gpt2"])
    ids = torch.randint(0, TINY["gpt2"]["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    ours = fastzoo.create("gpt2", pretrained=copy.deepcopy(ref), attn="eager").eval()
    assert all(c.passed for c in equivalence.compare(ours, ref, (ids,))[0])
    ours.transformer.h[1].mlp.c_fc.bias = None
    logits, grads = equivalence.compare(ours, ref, (ids,))[0]
    assert not grads.passed and grads.err == float("inf") and "'transformer.h.1.mlp.c_fc.bias'" in grads.worst, grads


def test_a_backend_wrong_in_one_layer_is_named_by_the_forward_report(register):
    register("wrong_scale_layer", _wrong_scale, CPU_FP32)
    ours, original = _vit_pair()
    ours.blocks[1].attn.backend = fastzoo.get_backend("wrong_scale_layer")  # one layer only
    comps, report = equivalence.compare(ours, original, (torch.randn(2, 3, 32, 32),), layers=True)
    assert not comps[0].passed and report.first.name == "blocks.1.attn"


def test_when_only_the_gradients_diverge_the_backward_report_names_the_layer(register):
    register("scaled_backward", _scaled_backward, CPU_FP32)
    ours, original = _vit_pair()
    ours.blocks[1].attn.backend = fastzoo.get_backend("scaled_backward")
    logits, grads = equivalence.compare(ours, original, (torch.randn(2, 3, 32, 32),), layers=True)[0]
    report = equivalence.compare(ours, original, (torch.randn(2, 3, 32, 32),), layers=True)[1]
    assert logits.passed and not grads.passed  # the outputs are exact, the gradients are not
    assert report.first_forward is None
    assert report.first.name == report.first_backward.name == "blocks.1.attn"
    # block 1's attention receives the right gradient and sends on a wrong one
    assert report.first.grad_out_err <= FP32_LAYER_RTOL < report.first.grad_in_err


def test_gpt2_layers_are_matched_with_hugging_face_by_module_name():
    original = equivalence.original("gpt2", **TINY["gpt2"])
    ours = fastzoo.create("gpt2", attn="sdpa", pretrained=original).eval()
    with torch.no_grad():
        ours.transformer.h[1].mlp.c_fc.weight[0, 0] += 0.1
    ids = torch.randint(0, TINY["gpt2"]["vocab_size"], (2, 16))
    comps, report = equivalence.compare(ours, original, equivalence.Inputs((ids,)), layers=True)
    assert not comps[0].passed
    assert report.first.name == "transformer.h.1.mlp.c_fc"


def test_cli_check_layers_prints_the_per_layer_table(capsys):
    assert main(["check", "vit_s16", "--tiny", "--attn", "sdpa", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "Layers of sdpa (images): no layer diverges" in out
    assert "| blocks.1.attn |" in out


def test_cli_check_layers_names_the_first_diverging_layer(register, capsys):
    register("wrong_scale_cli_layers", _wrong_scale, CPU_FP32)
    assert main(["check", "vit_s16", "--tiny", "--no-grad", "--attn", "wrong_scale_cli_layers", "--layers"]) == 1
    assert "first diverging layer: blocks.0.attn" in capsys.readouterr().out


def test_cli_check_of_a_model_without_attention_passes_no_backend(capsys):
    """ResNet has no attention layer: the table compares the model once (no attention rows), and for
    each backend asked for by name says only what is true here ("not available here" with the
    reason, else "no attention layer"), never "pass"; a backend asked for by name that cannot run
    here fails the check."""
    from fastzoo.attention import backend_class, list_attention
    from fastzoo.cli import main

    assert main(["check", "resnet18", "--tiny", "--no-grad"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| backend")}
    assert list(rows) == ["none (resnet18 has no attention layer)"] and "| pass |" in rows[list(rows)[0]]
    assert main(["check", "resnet18", "--tiny", "--no-grad", "--attn", *list_attention()]) in (0, 1)
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| backend")}
    for name in list_attention():
        here = backend_class(name).unavailable_reason() is None
        assert "pass" not in rows[name].split("|")[-2], rows[name]
        assert ("no attention layer" if here else "not available here") in rows[name], rows[name]
    missing = next((n for n in list_attention() if backend_class(n).unavailable_reason()), None)
    if missing is not None:
        assert main(["check", "resnet18", "--tiny", "--no-grad", "--attn", missing]) == 1
        assert "not available here" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_detr_is_checked_on_the_inputs_its_task_declares(backend):
    """The detection task's example inputs (images with pixel masks of different widths, then the same
    with boxes as labels) make DETR checkable like any family: logits, the set loss and every gradient
    behind each within fp32's 1e-4."""
    from fastzoo import equivalence

    res = equivalence.check("detr", backend, overrides=equivalence.tiny_overrides("detr"), batch=3)
    assert [c.name for c in res.comparisons] == ["logits", "grads", "loss (set loss)", "grads (set loss)", NORMS]
    assert all(c.err <= 1e-4 for c in res.comparisons), res.rows()  # fp32 rule


def test_a_normalisation_eps_the_outputs_cannot_see_fails_by_name(monkeypatch):
    """DETR is post-norm: its LayerNorms read residual sums of O(1), where an eps of 1e-6 for 1e-5 moves the
    outputs below fp32's bound. The per-normalisation probe (inputs of variance ~eps) fails it and names
    the module; the outputs alone pass."""
    module = importlib.import_module("fastzoo.equivalence.check")  # the module (the package re-exports check)
    create = module.create
    target = "model.encoder.layers.0.self_attn_layer_norm"

    def create_with_wrong_eps(*args, **kwargs):
        model = create(*args, **kwargs)
        model.get_submodule(target).eps = 1e-6  # transformers' DETR: 1e-5
        return model

    monkeypatch.setattr(module, "create", create_with_wrong_eps)
    res = equivalence.check("detr", "sdpa", overrides=equivalence.tiny_overrides("detr"), train=False)
    by_name = {c.name: c for c in res.comparisons}
    assert by_name["logits"].passed and by_name["loss (set loss)"].passed  # the outputs cannot see it
    norms = by_name[NORMS]
    # a normalisation of std-1e-3 rows moves by ~50 %: far past fp32's 1e-4 (observed ~1)
    assert not norms.passed and norms.err > 100 * FP32_OUT_ATOL and norms.worst == target, res.rows()


@pytest.mark.parametrize("name", ["deformable_detr", "rtdetr_r18vd", "dfine_small_coco", "rf_detr_nano"])
@pytest.mark.parametrize("backend,options", [("eager", {}), ("sdpa", {}), ("sdpa", {"sdpa_backend": "math"})])
def test_fastzoo_check_passes_every_detector_where_fp32_rounding_is_the_originals_own(name, backend, options):
    """The detectors' tiny configs through ``fastzoo check`` (train: outputs, set loss, every gradient). Where the
    fixed tolerance fails, the original's own fp32 rounding is measured and the rule judges with it: a Deformable
    DETR input projection's bias, under a GroupNorm of one channel per group, has a gradient that is 0 in exact
    arithmetic (fastzoo's eager 2.9e-4 of the scale from transformers' eager, whose own SDPA run is 7.5e-5 away and
    fp64 run ~0), and RF-DETR's boxes amplify rounding (transformers' own SDPA logits 7.6e-3 from its eager)."""
    res = equivalence.check(name, backend, backend_options=options, overrides=equivalence.tiny_overrides(name))
    assert [c.name for c in res.comparisons] == ["logits", "grads", "loss (set loss)", "grads (set loss)", NORMS]
    assert res.passed, res.rows()


def test_the_measured_rounding_does_not_pass_a_wrong_backward_on_a_detector(monkeypatch):
    """The measure widens a bound only to the original's own fp32 error: RF-DETR whose attention passes half
    the gradient to its keys and values (the forward the same up to rounding) still fails, on the gradients, by
    orders of magnitude."""
    from fastzoo.layers.attention import UsesAttention

    def half_backward(t):
        return t * 0.5 + (t * 0.5).detach()

    attend = UsesAttention.attend
    monkeypatch.setattr(UsesAttention, "attend", lambda self, q, k, v, ctx, scale=None:
                        attend(self, q, half_backward(k), half_backward(v), ctx, scale))
    res = equivalence.check("rf_detr_nano", "sdpa", overrides=equivalence.tiny_overrides("rf_detr_nano"))
    by_name = {c.name: c for c in res.comparisons}
    assert by_name["logits"].passed  # the forward is right
    grads = by_name["grads"]
    assert not grads.passed and grads.err > 10 * grads.bound and grads.peer_err is not None, res.rows()
