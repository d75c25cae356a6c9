"""The LM head's loss, forward + backward: ``cross_entropy(hidden @ weight.T, target)`` at
GPT-2's vocabulary (50257) and width (768), 4096 tokens, 10% of them ignored (-100).

Cases: the reference (the logits materialised, ``F.cross_entropy`` on them: what GPT-2 and
Hugging Face do; the peer), torch's chunked ``F.linear_cross_entropy`` with
``LinearCrossEntropyOptions()``, and ``fastzoo.losses.linear_cross_entropy`` (fused, gradients
computed in the forward): by default two passes over logits blocks no larger than the hidden
states (peak at or below torch's op), and with ``block_bytes`` room for one [256, vocab] chunk,
one pass (faster, that much more memory). Each step computes the gradients of the hidden states and
of the weight. Parity: the loss and both gradients against the reference in fp32. Peak memory
on CPU is what the step's tensors hold at most (``harness.cpu_peak_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.losses.lm import IGNORE_INDEX


@dataclass(frozen=True)
class LinearCESetting:
    name: str
    tokens: int
    n_embd: int
    vocab: int
    ignored: float = 0.1  # share of targets set to ignore_index

    def describe(self) -> str:
        return f"{self.tokens} tokens x {self.n_embd} wide -> vocab {self.vocab}, {self.ignored:.0%} of targets ignored"


TARGET_SETTING = LinearCESetting("4096 tokens, GPT-2 head", 4096, 768, 50257)


def linear_ce_suite(setting: LinearCESetting = TARGET_SETTING, *, device="cpu", dtype=torch.float32, seed: int = 0) -> Suite:
    from fastzoo.losses import linear_cross_entropy

    device, s = torch.device(device), setting
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s.tokens, s.n_embd, generator=g).to(device, dtype)
    weight = (0.02 * torch.randn(s.vocab, s.n_embd, generator=g)).to(device, dtype)  # GPT-2's init scale
    target = torch.randint(0, s.vocab, (s.tokens,), generator=g)
    target[torch.rand(s.tokens, generator=g) < s.ignored] = IGNORE_INDEX
    target = target.to(device)

    def loss_step(loss_of) -> Step:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def run():
            h.grad = w.grad = None
            loss = loss_of(h, w)
            loss.backward()
            return loss

        def outputs():
            loss = run()
            return {"output": loss.detach().float().reshape(1), "grad:hidden": h.grad.float(), "grad:weight": w.grad.float()}

        return Step(run=run, items=s.tokens, outputs=outputs)

    def reference():
        return loss_step(lambda h, w: F.cross_entropy(h.float() @ w.float().T, target)).outputs()

    cases = [
        Case("reference: F.cross_entropy(hidden @ weight.T)", lambda: loss_step(lambda h, w: F.cross_entropy(h @ w.T, target)),
             peer=True, reference=True),
        Case("torch F.linear_cross_entropy (chunked)", lambda: loss_step(
            lambda h, w: linear_cross_entropy(h, w, target, impl="torch"))),
        Case("fastzoo linear_cross_entropy (fused)", lambda: loss_step(
            lambda h, w: linear_cross_entropy(h, w, target, impl="fused"))),
        Case("fastzoo linear_cross_entropy (fused, one pass: block_bytes=64 MiB)", lambda: loss_step(
            lambda h, w: linear_cross_entropy(h, w, target, impl="fused", block_bytes=64 * 2**20))),
    ]
    config = {"batch": s.describe(), "step": "forward + backward of the mean loss (grads of hidden and weight)",
              "peer": "F.cross_entropy on the materialised logits",
              "torch op": "F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())",
              "peak memory": "tensors allocated during the step (torch profiler), inputs excluded"}
    group = Group(f"{s.name} | fwd+bwd", cases, reference=reference, unit="tokens/s", cpu_memory=True)
    return Suite("linear_ce", [group], config=config, dtype=dtype, device=device)
