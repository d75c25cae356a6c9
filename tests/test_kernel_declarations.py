"""What backends declare about themselves, against what their kernels really do.

``fastzoo.explain`` asks each backend what its kernels look like in a profiler trace; the
capability rule is one function; availability probes import the module the backend calls.
Each test fails on a mis-declaration a GPU user would otherwise meet first.
"""
import ast
import re
import sys
from pathlib import Path

import pytest
import torch

import fastzoo
from fastzoo.attention import AttnContext, backend_class, get_backend, list_attention
from fastzoo.kernel_report import _attention_ops, _ran_as_asked

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = [n for n in list_attention() if backend_class(n).__module__.startswith("fastzoo.attention.")]


def _qkv(device="cpu", dtype=torch.float32, S=4, D=16):
    q = torch.zeros(1, 2, S, D, device=device, dtype=dtype)
    return q, q, AttnContext()


# -- explain asks the backends ----------------------------------------------------------------------
def test_kernel_report_names_no_backend():
    """A new built-in backend must not need an edit of kernel_report to be explained."""
    tree = ast.parse((ROOT / "fastzoo/kernel_report.py").read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    named = sorted(strings & set(BUILTIN))
    assert not named, f"kernel_report names backends {named}: ask the backend (kernel_ops / kernel_profile)"


@pytest.mark.parametrize("name", [n for n in BUILTIN if n != "eager"])
def test_every_builtin_backend_declares_its_kernel_ops(name):
    cls = backend_class(name)
    assert cls.kernel_ops, f"{name} declares no kernel_ops: explain could not tell its kernel from a fallback"
    assert re.compile(cls.kernel_ops)
    assert _attention_ops().search("x") is None  # the union recognises kernels, not any op


def test_eager_is_checked_as_plain_ops():
    profile = get_backend("eager").kernel_profile(*_qkv())
    assert profile.checked and profile.ops is None
    assert _ran_as_asked(profile, ["aten::bmm", "aten::softmax"]) is None
    assert _ran_as_asked(profile, ["aten::_scaled_dot_product_flash_attention_for_cpu"])


@pytest.mark.parametrize("op", ["aten::_efficient_attention_forward", "aten::_efficient_attention_backward"])
def test_xformers_cutlass_kernel_is_its_own(op):
    """xFormers runs fp32 (and fp16/bf16 without its flash op) through the CUTLASS kernel that
    PyTorch also ships: aten::_efficient_attention_forward is xFormers' kernel, not a fallback."""
    profile = get_backend("xformers").kernel_profile(*_qkv())
    assert _attention_ops().search(op)
    assert _ran_as_asked(profile, [op]) is None


def test_sdpa_math_fallback_says_why():
    q, k, ctx = _qkv()
    profile = get_backend("sdpa").kernel_profile(q, k, AttnContext(dropout_p=0.1))
    assert "takes no dropout" in _ran_as_asked(profile, ["aten::_scaled_dot_product_attention_math"])
    assert _ran_as_asked(profile, ["aten::_scaled_dot_product_flash_attention_for_cpu"]) is None


def test_a_user_backend_is_reported_unchecked(monkeypatch):
    import fastzoo.attention as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    fastzoo.register_attention("mine_profile", lambda q, k, v, ctx: q)
    assert not get_backend("mine_profile").kernel_profile(*_qkv()).checked


# -- installing: the gpu extra builds nothing ---------------------------------------------------
def _extra(name):
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]


def _dist(req):
    return re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")


SOURCE_BUILDS = {"flash-attn", "transformer-engine", "transformer-engine-torch"}  # setup.py imports torch


def test_gpu_extra_installs_without_compiling():
    """flash-attn 2 and Transformer Engine compile against the installed torch (build isolation
    cannot import it, and flash-attn's C++17 build fails on torch 2.14's C++20 headers):
    `pip install -e ".[gpu]"` would fail. They are installed by hand, as their refusals say."""
    dists = {_dist(r) for r in _extra("gpu")}
    assert not dists & SOURCE_BUILDS, dists & SOURCE_BUILDS
    assert "flash-attn-4" in dists  # FlashAttention that installs: a pure-Python wheel
    for name in ("fa2", "te"):
        assert "--no-build-isolation" in backend_class(name).capabilities.install


def test_fa2_refusal_says_which_torch_it_builds_against():
    install = backend_class("fa2").capabilities.install
    assert "C++20" in install and "fa4" in install


def test_fa3_says_it_has_no_pypi_distribution():
    install = backend_class("fa3").capabilities.install
    assert "git clone" in install and "no PyPI distribution" in install


def test_flash_attn_compile_support_is_declared_from_2_7():
    """flash-attn registers its kernels as torch.library custom ops from 2.7 (not 2.6)."""
    for path in ("fastzoo/attention/flash.py", "pyproject.toml"):
        text = (ROOT / path).read_text()
        assert not re.search(r"flash-attn\s*>=\s*2\.6|>= 2\.6 registers", text), path


# -- availability probes import what the backend calls ------------------------------------------
@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Make importable stubs: a package that imports while the submodule a backend calls is absent."""
    def make(*dotted):
        for name in dotted:
            d = tmp_path.joinpath(*name.split("."))
            d.mkdir(parents=True, exist_ok=True)
            (d / "__init__.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path))
        tops = {name.split(".")[0] for name in dotted}
        for mod in [m for m in sys.modules if m.split(".")[0] in tops]:  # an installed one already imported
            monkeypatch.delitem(sys.modules, mod)
        from fastzoo.attention import availability

        availability._unavailable.cache_clear()
        return tmp_path

    yield make
    from fastzoo.attention import availability

    availability._unavailable.cache_clear()


@pytest.mark.parametrize("name,present,called", [
    ("te", ["transformer_engine"], "transformer_engine.pytorch"),  # the top package imports, .pytorch does not
    ("xformers", ["xformers"], "xformers.ops"),
    ("fa2", ["flash_attn.cute"], "flash_attn.flash_attn_interface"),  # flash-attn-4 alone: a bare flash_attn namespace
])
def test_probe_names_the_module_the_backend_calls(fake_packages, name, present, called):
    fake_packages(*present)
    reason = backend_class(name).unavailable_reason()
    assert reason and f"needs the package(s) {called}" in reason


# -- cuDNN attention's limits --------------------------------------------------------------------
def test_sdpa_cudnn_refuses_gpt2_dropout_that_is_no_multiple_of_1_16():
    cudnn = get_backend("sdpa", sdpa_backend="cudnn")
    req = dict(head_dim=64, causal=True, device="cuda", dtype=torch.bfloat16, attn_dropout_field="attn_pdrop")
    from fastzoo.attention import AttnRequest

    assert any("1/16" in p and "attn_pdrop=0.1" in p for p in cudnn.problems(AttnRequest(attn_dropout=0.1, **req)))
    assert not any("1/16" in p for p in cudnn.problems(AttnRequest(attn_dropout=0.125, **req)))


def test_sdpa_cudnn_refuses_a_key_length_of_1_per_call():
    q = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(fastzoo.errors.BackendUnavailableError, match="key length of 1"):
        get_backend("sdpa", sdpa_backend="cudnn")(q, q, q, AttnContext())


# -- head-dim limits that hold on one device ------------------------------------------------------
@pytest.mark.parametrize("name,opts,head_dim,words", [
    ("varlen", {"impl": "torch"}, 20, "divisible by 8"),  # aten's FlashAttention varlen does not pad
    ("nested", {}, 20, "divisible by 8 on cuda"),  # jagged SDPA's fused kernels
    ("flex", {}, 8, ">= 16 on cuda"),  # the Triton template
])
def test_head_dim_limits_on_cuda_are_declared(name, opts, head_dim, words):
    from fastzoo.attention import AttnRequest

    backend = get_backend(name, **opts)
    assert any(words in p for p in backend.problems(AttnRequest(head_dim=head_dim, device="cuda", dtype=torch.bfloat16)))
    assert not any("head dim" in p for p in backend.problems(AttnRequest(head_dim=64, device="cuda", dtype=torch.bfloat16)))
    if "cpu" in backend.capabilities.devices:  # the limit is the CUDA kernel's: CPU is not refused
        assert not any("head dim" in p for p in backend.problems(AttnRequest(head_dim=head_dim, device="cpu")))


# -- a GPT-2 KV cache is checked on the model's device --------------------------------------------
def test_gpt2_kv_cache_check_uses_the_models_device(monkeypatch):
    """sdpa's flash kernel takes a KV cache's bottom-right mask on CPU, not on CUDA: the check
    before generating must ask with the model's device, not with none."""
    from fastzoo.equivalence import tiny_overrides

    model = fastzoo.create("gpt2", attn="sdpa", attn_options={"sdpa_backend": "flash"}, **tiny_overrides("gpt2"))
    model.check_kv_cache()  # CPU: served
    real = model.attention_request
    monkeypatch.setattr(model, "attention_request", lambda **kw: real(device="cuda", dtype=torch.bfloat16))
    with pytest.raises(fastzoo.errors.BackendUnavailableError, match="KV cache"):
        model.check_kv_cache()


def test_availability_imports_no_kernel_library_on_a_machine_that_cannot_use_it():
    """Finding a probe's submodule (xformers.ops, flash_attn.flash_attn_interface) must not import
    its parent package: a kernel library's __init__ loads CUDA extensions."""
    import subprocess

    code = ("import sys\nfrom fastzoo.attention import capability_matrix\ncapability_matrix()\n"
            "loaded = [m for m in ('xformers', 'flash_attn', 'flash_attn_interface', 'transformer_engine') if m in sys.modules]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


# -- losses declare their kernels the same way ------------------------------------------------------
def test_kernel_report_and_bench_name_no_loss():
    """A new loss must not need an edit of explain or `fastzoo bench` to be explained or benchmarked."""
    from fastzoo.losses import losses

    names = {"matcher"} | {n for loss in losses() for n in (loss.name, *loss.functions)}
    for path in ("fastzoo/kernel_report.py", "fastzoo/bench/cli.py", "fastzoo/bench/tour.py"):
        tree = ast.parse((ROOT / path).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        named = sorted(strings & names)
        assert not named, f"{path} names losses {named}: read the loss declarations"


@pytest.mark.parametrize("name", ["giou", "linear_ce", "lm"])
def test_every_builtin_loss_declares_its_kernel_ops_and_impls(name):
    from fastzoo.kernel_report import _kernel_ops
    from fastzoo.losses import get_loss

    loss = get_loss(name)
    assert loss.kernel_ops and re.compile(loss.kernel_ops) and loss.impls and loss.functions
    assert set(loss.fused_impls) <= set(loss.impls)
    assert _kernel_ops().search("x") is None
    assert all(_kernel_ops().search(op) for op in {"giou": ["fastzoo::giou_loss_fwd"], "linear_ce": ["LinearCrossEntropy"],
                                                    "lm": ["aten::cross_entropy_loss"]}[name])


def test_a_registered_loss_is_explained_and_benchmarked_from_its_declaration(monkeypatch):
    """A user's loss, declared once: explain recognises its op, `fastzoo bench NAME` finds its suite."""
    from fastzoo import losses
    from fastzoo.bench.cli import part_suites
    from fastzoo.kernel_report import _kernel_ops

    monkeypatch.setattr(losses.registry, "_REGISTRY", dict(losses.registry._REGISTRY))
    assert _kernel_ops().search("mylib::focal_fwd") is None
    losses.register_loss(losses.Loss("focal", "a focal loss", ("focal_loss",), {"kernel": "mylib's op"},
                                     kernel_ops=r"^mylib::focal", bench="mylib.bench_focal"))
    assert _kernel_ops().search("mylib::focal_fwd")
    assert part_suites()["focal"] == "mylib.bench_focal"
    assert losses.registry.loss_of_function("focal_loss").name == "focal"
    with pytest.raises(KeyError, match="no loss 'nope'; losses: .*focal"):
        losses.get_loss("nope")
