"""``set_attention`` on a model shared between threads: the switch is one assignment of the
(name, backend) pair that every layer reads, so threads switching concurrently leave every
layer on the backend the model names, and forwards running meanwhile compute the reference
function.

Python switches threads every 5 ms by default; the tests shorten that to 1 us so that
interleavings a slow machine would show once a day show within a few hundred switches.
"""
import sys
import threading

import pytest
import torch
from conftest import TINY

import fastzoo

VIT = {**TINY["vit"], "depth": 6}  # many layers, so a switch caught half-way shows
BACKENDS = ["eager", "sdpa"]
TOL = 1e-5  # eager vs sdpa, fp32 CPU: the same function up to summation order


def layer_backends(model) -> set:
    from fastzoo.layers.attention import UsesAttention

    return {m.backend.name for m in model.modules() if isinstance(m, UsesAttention)}


def test_concurrent_switches_leave_every_layer_on_the_named_backend(fast_switching):
    """Two threads switch at once, 200 times (a switch that is not atomic ends some rounds with
    some layers on one backend and the name saying the other)."""
    model = fastzoo.create("vit_s16", **{**VIT, "depth": 12})
    mixed = 0
    for _ in range(200):
        barrier = threading.Barrier(2)

        def switch(name):
            barrier.wait()
            model.set_attention(name)

        threads = [threading.Thread(target=switch, args=(b,)) for b in BACKENDS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        mixed += layer_backends(model) != {model.attn_name}
    assert mixed == 0, f"{mixed} of 200 rounds left the layers disagreeing with attn_name"


def test_forwards_during_switches_compute_the_reference(fast_switching):
    model = fastzoo.create("vit_s16", attn="eager", **VIT).eval()
    x = torch.randn(2, 3, VIT["img_size"], VIT["img_size"])
    with torch.no_grad():
        ref = model(x)
    stop, errors, worst = threading.Event(), [], [0.0]

    def switch():
        i = 0
        while not stop.is_set():
            model.set_attention(BACKENDS[i % 2])
            i += 1

    def forward():
        try:
            for _ in range(40):
                with torch.no_grad():
                    worst[0] = max(worst[0], (model(x) - ref).abs().max().item())
        except Exception as e:  # noqa: BLE001 -- any error is the failure this test looks for
            errors.append(e)

    switcher = threading.Thread(target=switch)
    forwards = [threading.Thread(target=forward) for _ in range(2)]
    switcher.start()
    for t in forwards:
        t.start()
    for t in forwards:
        t.join()
    stop.set()
    switcher.join()
    assert not errors, errors[0]
    assert worst[0] <= TOL


def test_a_refused_switch_changes_nothing_under_contention(fast_switching, monkeypatch):
    """A backend the model cannot use is refused in the calling thread, before the swap, while
    other threads switch between usable ones."""
    from fastzoo import attention

    monkeypatch.setattr(attention, "_REGISTRY", dict(attention._REGISTRY))  # registration undone after the test
    fastzoo.register_attention("not_causal", lambda q, k, v, ctx: v)  # declares no causal masking
    model = fastzoo.create("gpt2", **TINY["gpt2"], attn="eager")
    refused, stop = [], threading.Event()

    def bad():
        for _ in range(50):
            try:
                model.set_attention("not_causal")
            except fastzoo.errors.BackendUnavailableError as e:
                refused.append(e)

    def good():
        while not stop.is_set():
            model.set_attention("eager")

    threads = [threading.Thread(target=bad) for _ in range(2)]
    switcher = threading.Thread(target=good)
    switcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    switcher.join()
    assert len(refused) == 100 and "causal" in str(refused[0])
    assert model.attn_name == "eager" and layer_backends(model) == {"eager"}
