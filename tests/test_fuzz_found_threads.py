"""The minimal cases the property-based tests (``tests/test_fuzz_*.py``) found with threads, each
kept as an explicit example of the bug it showed, now fixed: backend switches and pinned SDPA
kernels while other threads run forwards."""
from __future__ import annotations

import sys

import pytest

import torch
from conftest import TINY, sdpa_flags

import fastzoo


def test_a_switch_during_a_forward_applies_from_the_next_call():
    """Found: a padded GPT-2 forward whose input was read for sdpa met varlen (set by another thread)
    in its later layers, which refused the key-padding mask mid-forward. A forward now keeps the
    backend it started with; here the switch happens inside the forward, from a hook."""
    cfg = TINY["gpt2"]
    model = fastzoo.create("gpt2", attn="sdpa", **cfg).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    handle = model.transformer.h[0].register_forward_hook(lambda *a: model.set_attention("varlen") and None)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    handle.remove()
    assert model.attn_name == "varlen"
    keep = mask.bool()
    assert (got[keep] - want[keep]).abs().max() <= 1e-5  # the same backend throughout: the same sums


def test_flex_from_two_threads_at_once():
    """Found by the concurrency property: two threads running one model on flex at once; one of them
    was refused ('compiled FlexAttention on CPU is refused') though nothing is compiled: uncompiled
    flex traces its own kernel with dynamo, which sets torch.compiler.is_compiling()'s flag for the
    whole process, and the other thread's forward read it. fastzoo asks fastzoo.tracing.tracing()."""
    import threading

    from fastzoo.errors import BackendUnavailableError

    cfg = TINY["vit"]
    model = fastzoo.create("vit_s16", attn="flex", **cfg).eval()
    x = torch.randn(1, 3, cfg["img_size"], cfg["img_size"])
    errors = []

    def run():
        try:
            for _ in range(20):
                with torch.no_grad():
                    model(x)
        except BackendUnavailableError as e:
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_another_threads_flex_call_is_not_tracing_here():
    """The flag behind the flex refusal, the skipped SDPA lock and backend pin, and the input checks
    a traced forward leaves out: while a thread runs uncompiled flex, torch.compiler.is_compiling()
    reads True in every thread, fastzoo's tracing() in none."""
    import threading

    from fastzoo.tracing import tracing

    cfg = TINY["vit"]
    model = fastzoo.create("vit_s16", attn="flex", **cfg).eval()
    x = torch.randn(1, 3, cfg["img_size"], cfg["img_size"])
    stop, seen = threading.Event(), {"torch": 0, "fastzoo": 0}
    torch._dynamo.reset()  # flex traces its kernel on its first call (per shape): that trace sets the flag

    def poll():
        while not stop.is_set():
            seen["torch"] += torch.compiler.is_compiling()
            seen["fastzoo"] += tracing()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=poll)
    t.start()
    try:
        with torch.no_grad():
            for _ in range(3):
                model(x)
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert seen["torch"] > 0  # the process-wide flag this test is about (torch 2.14)
    assert seen["fastzoo"] == 0


def test_pinned_sdpa_kernels_from_threads_leave_torchs_flags_as_they_were(monkeypatch):
    """Found by the threads property once pinned kernels were in it: torch's sdpa_kernel sets process-wide
    flags, so threads entering and leaving it interleaved ran on one another's kernels ('No viable backend
    for scaled_dot_product_attention' in an unpinned or nested call that met a pin) and left one kernel
    enabled for the whole process. Each SDPA call here takes 20 ms (torch's own, after a sleep), time for
    every other thread to come in: a pinned call must see only its kernel, the others the flags as set."""
    import copy
    import threading
    import time

    real = torch.nn.functional.scaled_dot_product_attention
    seen, who = [], threading.local()

    def slow_sdpa(*args, **kwargs):
        before = sdpa_flags()
        time.sleep(0.02)
        seen.append((who.kernel, before, sdpa_flags()))
        return real(*args, **kwargs)

    cfg = TINY["vit"]
    torch.manual_seed(0)
    base = fastzoo.create("vit_s16", attn="eager", **cfg).eval()
    x = torch.randn(2, 3, cfg["img_size"], cfg["img_size"])
    with torch.no_grad():
        want = base(x)
    flags, errors, worst = sdpa_flags(), [], [0.0]
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", slow_sdpa)

    def run(name, options):
        who.kernel = options.get("sdpa_backend")
        model = copy.deepcopy(base).set_attention(name, **options)
        try:
            for _ in range(2):
                with torch.no_grad():
                    worst[0] = max(worst[0], (model(x) - want).abs().max().item())
        except Exception as e:  # noqa: BLE001 -- any error is the failure looked for
            errors.append(e)

    runs = [("sdpa", {"sdpa_backend": "math"}), ("sdpa", {"sdpa_backend": "flash"}), ("sdpa", {}), ("nested", {})]
    threads = [threading.Thread(target=run, args=r) for r in runs * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]
    only = {"math": "math_sdp_enabled", "flash": "flash_sdp_enabled"}
    for kernel, before, after in seen:
        want_flags = flags if kernel is None else {k: k == only[kernel] for k in flags}
        assert before == after == want_flags, (kernel, before, after)
    assert len(seen) == 2 * 2 * 4 * cfg["depth"]  # threads x forwards x layers: every call seen
    assert worst[0] <= 1e-4  # fastzoo.equivalence's fp32 rule: each kernel against eager
    assert sdpa_flags() == flags


def test_a_pinned_sdpa_call_that_raises_leaves_the_flags_and_the_other_threads_free():
    import threading

    from torch.nn.attention import SDPBackend

    from fastzoo.attention.sdpa import sdpa

    flags = sdpa_flags()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError):
        sdpa(q, q, torch.randn(1, 2, 5, 8), kernel=SDPBackend.MATH)  # 4 keys, 5 values
    assert sdpa_flags() == flags
    out = []
    t = threading.Thread(target=lambda: out.append(sdpa(q, q, q)))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and torch.allclose(out[0], torch.nn.functional.scaled_dot_product_attention(q, q, q))
