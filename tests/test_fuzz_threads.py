"""Property: one model run from several threads at once, with ``set_attention`` switching it
between the backends that accept it in between, gives each thread the result a serial run gives.

A random valid config of each family with attention layers, a random input per thread (a detector:
padded images of two sizes, so packed and padded backends take other paths), a random
schedule of switches (which backends, how many, pinned SDPA kernels included); every forward's logits
must be within the fp32 rule (1e-4 times the logits' scale, at least 1: the backends compute the same
function up to summation order) of the serial result; after the switches stop every layer is on the
backend the model names, and torch's process-wide SDPA kernel flags are as they were.
"""
from __future__ import annotations

import threading

import pytest
import torch
from conftest import SPECS, backends, sdpa_flags
from fuzzing import fuzz_results  # noqa: F401 -- the results file's fixture
from fuzzing import configs, count, eval_anchors_free, examples, fail, image_sides
from hypothesis import given
from hypothesis import strategies as st

import fastzoo
from fastzoo import equivalence
from fastzoo.errors import BackendUnavailableError
from fastzoo.layers.attention import UsesAttention

FAMILIES = [f for f, s in SPECS.items() if s.task.name in ("image-classification", "causal-lm", "detection")]
CPU_BACKENDS = backends()  # pinned SDPA kernels (sdpa_backend=) included: their flags are process-wide


def _input(model, family, draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16), label="input seed"))
    cfg = model.config
    if SPECS[family].task.name == "detection":  # padded images: the packed backends get each image's real tokens
        B = draw(st.integers(1, 2))
        H, W = draw(image_sides(model), label="height, width")
        mask = torch.zeros(B, H, W, dtype=torch.long)
        for i in range(B):
            mask[i, :draw(st.integers(H // 2, H)), :draw(st.integers(W // 2, W))] = 1
        return (), {"pixel_values": torch.randn(B, cfg.num_channels, H, W, generator=gen), "pixel_mask": mask}
    if SPECS[family].task.name == "image-classification":
        side = getattr(cfg, "img_size", None) or (32, 32)
        return (torch.randn(draw(st.integers(1, 2)), cfg.in_chans, *side, generator=gen),), {}
    S = draw(st.integers(1, min(12, model.n_positions or 12)), label="length")
    ids = torch.randint(0, cfg.vocab_size, (draw(st.integers(1, 2)), S), generator=gen)
    return (ids,), {"attention_mask": torch.ones_like(ids), "use_cache": False}


@pytest.mark.parametrize("family", FAMILIES)
@examples(ci=3, long=60)
@given(data=st.data())
def test_threads_and_switches_give_the_serial_result(family, data, fast_switching):
    spec = SPECS[family]
    cfg = data.draw(configs(spec, small=True), label="config")
    cfg = eval_anchors_free(cfg)
    model = fastzoo.create(spec.variants[0].name, attn="eager", **cfg).eval()
    if not any(isinstance(m, UsesAttention) for m in model.modules()):
        pytest.skip(f"{family} has no attention layers: set_attention has nothing to switch")
    usable = []
    for name, options in CPU_BACKENDS:
        try:
            model.set_attention(name, **options)
            usable.append((name, options))
        except BackendUnavailableError:
            pass
    model.set_attention("eager")
    n_threads = data.draw(st.integers(2, 4), label="threads")
    inputs = [_input(model, family, data.draw) for _ in range(n_threads)]
    with torch.no_grad():
        serial = [equivalence.logits_of(model(*a, **k)) for a, k in inputs]
    # the fp32 rule's 1e-4 is for logits of order 1: another summation order moves larger ones in proportion
    # (a granite with logits_scaling=1.2e-38 has logits of 4e36, one rounding apart by 3e29 between kernels)
    scales = [max(1.0, s.abs().max().item()) for s in serial]
    schedule = data.draw(st.lists(st.sampled_from(usable), min_size=1, max_size=20), label="switches")
    stop, errors, worst = threading.Event(), [], [0.0]
    flags = sdpa_flags()

    def switch():
        i = 0
        while not stop.is_set():
            name, options = schedule[i % len(schedule)]
            model.set_attention(name, **options)
            i += 1

    def forward(i):
        a, k = inputs[i]
        try:
            for _ in range(3):
                with torch.no_grad():
                    out = equivalence.logits_of(model(*a, **k))
                worst[0] = max(worst[0], (out - serial[i]).abs().max().item() / scales[i])
        except Exception as e:  # noqa: BLE001 -- any error is the failure looked for
            errors.append(e)

    switcher = threading.Thread(target=switch)
    threads = [threading.Thread(target=forward, args=(i,)) for i in range(n_threads)]
    switcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    switcher.join(timeout=60)
    prop = f"concurrency/{family}"
    if any(t.is_alive() for t in threads):
        fail(prop, "hangs", "a forward hung")
    if errors:
        fail(prop, "bare_exceptions", f"{type(errors[0]).__name__}: {errors[0]}")
    if worst[0] > equivalence.FP32_OUT_ATOL:
        fail(prop, "mismatches", f"a threaded forward differs from the serial one by {worst[0]:.3g}")
    if sdpa_flags() != flags:
        fail(prop, "mismatches", f"torch's SDPA kernel flags were {flags}, the threads left {sdpa_flags()}")
    layers = {m.backend.name for m in model.modules() if isinstance(m, UsesAttention)}
    if layers != {model.attn_name}:
        fail(prop, "mismatches", f"layers on {layers}, the model says {model.attn_name}")
    count(prop, examples=1, cases=3 * n_threads, switch_backends=len(usable))
