"""Fixtures built from the family specs (``fastzoo/models/<family>/spec.py``): each family's
tiny config, the original library's model on the same config; weights are drawn by
``fastzoo.equivalence.draw_``."""
import os
import sys

import pytest
import torch
from torch import nn

from fastzoo.registry import specs

# family -> its spec's tiny config (original field names), e.g. TINY["vit"]
TINY = {spec.family: dict(spec.tiny) for spec in specs()}
SPECS = {spec.family: spec for spec in specs()}


def tiny_of(name: str) -> dict:
    """The tiny config of the family the model ``name`` (``"vit_s16"``, ``"resnet50"``...) belongs to."""
    from fastzoo.registry import get_entry

    return dict(get_entry(name).spec.tiny)


def model_kwargs(config: dict, *fields: str) -> list[str]:
    """``fields`` of ``config`` (a tiny config) as command-line ``KEY=VALUE`` words (the scripts'
    ``--model-kwargs``, ``fastzoo convert --set``)."""
    return [f"{k}={config[k]}" for k in fields]


def pytest_configure(config):
    """Under pytest-xdist (the README's ``-n auto``) each worker is a process of its own: the cores are
    shared out among them, so workers do not oversubscribe them with torch's intra-op threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def cuda_only(reason: str = "needs a CUDA GPU; this machine has none"):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)


def original(family: str, **overrides) -> nn.Module:
    """The original library's model of ``family`` on its tiny config plus ``overrides``, its weights
    drawn (``fastzoo.equivalence.draw_``), eval mode."""
    from fastzoo.equivalence import draw_

    spec = SPECS[family]
    return draw_(spec.original.build({**spec.tiny, **overrides})).eval()


def backends(*, backward: bool = False, device: str = "cpu", dtype: torch.dtype | None = None,
             **needs) -> list[tuple[str, dict]]:
    """``(name, options)`` of every registered backend, default and each declared variant (e.g.
    ``sdpa_backend="math"``), that runs on ``device`` here, with a backward there if ``backward``,
    in ``dtype`` there if given, and whose capabilities have each of ``needs`` (``varlen=True``, ``padding_mask=True``...).
    The registry decides: a new backend is tested without editing a list."""
    from fastzoo.attention import backend_class, get_backend, list_attention

    out = []
    for name in list_attention(available_only=True):
        for options in ({}, *getattr(backend_class(name), "variants", ())):
            try:
                caps = get_backend(name, **options).capabilities
            except Exception:  # a variant this machine cannot build (a kernel library missing)
                continue
            runs = device in caps.devices and (not backward or device in caps.backward)
            runs = runs and (dtype is None or dtype in caps.devices[device])  # e.g. a bf16-only kernel another test registered
            if runs and all(getattr(caps, k) == v for k, v in needs.items()) and (name, options) not in out:
                out.append((name, options))
    return out


# generate's decoding strategies, as transformers' users ask for them
GENERATE = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, temperature=0.8),
    "top_k": dict(do_sample=True, top_k=5),
    "top_p": dict(do_sample=True, top_p=0.7),
    "beams": dict(num_beams=3),
    "no_cache": dict(do_sample=False, use_cache=False),
}


def assert_generate_equals_original(ours: nn.Module, original: nn.Module, batch, kind: str):
    """``generate`` with the ``kind`` strategy, 12 new tokens from the (left-)padded ``batch``:
    fastzoo's tokens are the original's, token for token (sampling from the same seed)."""
    kw = dict(attention_mask=batch.attention_mask, max_new_tokens=12, pad_token_id=0, **GENERATE[kind])
    torch.manual_seed(7)
    got = ours.generate(batch.input_ids, **kw)
    torch.manual_seed(7)
    want = original.generate(batch.input_ids, **kw)
    assert torch.equal(got, want)


def backend_id(b) -> str:
    name, options = b
    return name + "".join(f"-{v}" for v in options.values())


def assert_lora_equals_original(ours: nn.Module, original: nn.Module, target_modules: list[str], batch, **inputs):
    """peft's LoRA on fastzoo's model and on the original: the same adapters (the original's module
    names), the base frozen, and from the same adapter weights the same loss and adapter gradients
    on ``batch`` (a ``PaddedBatch``); ``inputs``: fastzoo's own form of the batch, labels included,
    where it takes another (packed); the padded batch by default. Returns the two peft models."""
    from fastzoo import equivalence

    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")

    def lora():  # one config each: peft adapts its copy to the layer it wraps (Conv1D's fan_in_fan_out)
        # init_lora_weights=False: lora_B random too; peft's default B = 0 would leave lora_A without a gradient
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, lora_dropout=0.0, init_lora_weights=False)

    theirs = peft.get_peft_model(original, lora())
    mine = peft.get_peft_model(ours, lora())
    peft.set_peft_model_state_dict(mine, peft.get_peft_model_state_dict(theirs))
    trainable = {n for n, p in mine.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    want = theirs(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels).loss
    want.backward()
    got = mine(**(inputs or dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels))).loss
    got.backward()
    assert (got - want).abs() <= 1e-5  # a mean cross-entropy in fp32, summed in another order
    grads = {n: p.grad for n, p in mine.named_parameters() if n in trainable}
    c = equivalence.compare_grads("adapter grads", grads, {n: p.grad for n, p in theirs.named_parameters() if n in trainable})
    assert c.err <= equivalence.FP32_GRAD_RTOL, f"grad of {c.worst}: relative error {c.err:.2e}"
    assert all(p.grad is None for n, p in mine.named_parameters() if n not in trainable)  # the base is frozen
    return mine, theirs


def sdpa_flags() -> dict:
    """torch's process-wide SDPA kernel flags (what ``torch.nn.attention.sdpa_kernel`` sets)."""
    cuda = torch.backends.cuda
    return {f.__name__: f() for f in (cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.math_sdp_enabled,
                                      cuda.cudnn_sdp_enabled)}


@pytest.fixture
def fast_switching():
    """Threads switch every microsecond (a race that needs an unlucky switch shows in a short test)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.fixture(autouse=True)
def _attention_registry_restored():
    """A backend a test registers is gone after that test: the registry decides what every other test
    iterates (``backends()``), so one test's toy backend must not become another's case."""
    from fastzoo.attention import _REGISTRY

    before = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(before)
