"""The LM head's loss, forward + backward: ``cross_entropy(hidden @ weight.T, target)`` at
GPT-2's head (4096 tokens x 768 -> vocab 50257) and at a Llama-3-sized vocabulary (1024 tokens x
256 -> 128256), 10% of the targets ignored (-100).

Cases: the logits materialised and ``F.cross_entropy`` on them -- at the GPT-2 head as GPT-2
does; at the 128k vocabulary as Hugging Face's Llama does (``lm_head``, then ``ForCausalLMLoss``,
which upcasts the logits to fp32) -- the peer; torch's chunked ``F.linear_cross_entropy`` with
``LinearCrossEntropyOptions()``; on CUDA Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (its
Triton kernel; the ``[gpu]`` extra); and ``fastzoo.losses.linear_cross_entropy`` (fused, gradients
computed in the forward) at its default settings. Each step computes the gradients of the hidden
states and of the weight.
Parity: the loss and both gradients against the logits path in fp32. Peak memory on CPU is what
the step's tensors hold at most (``harness.cpu_peak_bytes``).

Beside the machine's limits (same run, :mod:`fastzoo.bench.limits`): FLOP/s as a share of the
GEMM peak in the run's dtype, counting the three matmuls an exact forward + backward needs
(logits, grad of the hidden states, grad of the weight: ``6 N D V``); bytes/s (hidden and
weight read, their gradients written) as a share of the copy bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fastzoo.bench import limits as machine
from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.losses import IGNORE_INDEX, linear_cross_entropy


@dataclass(frozen=True)
class LinearCESetting:
    name: str
    tokens: int
    n_embd: int
    vocab: int
    ignored: float = 0.1  # share of targets set to ignore_index

    def describe(self) -> str:
        return f"{self.tokens} tokens x {self.n_embd} wide -> vocab {self.vocab}, {self.ignored:.0%} of targets ignored"

    def flops(self) -> int:
        """The three matmuls of an exact forward + backward: logits, grad of hidden, grad of weight."""
        return 3 * machine.gemm_flop_count(self.tokens, self.vocab, self.n_embd)

    def bytes(self, dtype: torch.dtype) -> int:
        """hidden and weight read, their gradients written, the targets read."""
        return 2 * (self.tokens + self.vocab) * self.n_embd * dtype.itemsize + 8 * self.tokens


TARGET_SETTING = LinearCESetting("4096 tokens, GPT-2 head", 4096, 768, 50257)
LARGE_VOCAB_SETTING = LinearCESetting("1024 tokens, 128256-token vocabulary", 1024, 256, 128256)


@dataclass
class Inputs:
    hidden_ND: Tensor
    weight_VD: Tensor
    target_N: Tensor


def make_inputs(s: LinearCESetting, device: torch.device, dtype: torch.dtype, seed: int) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s.tokens, s.n_embd, generator=g).to(device, dtype)
    weight = (0.02 * torch.randn(s.vocab, s.n_embd, generator=g)).to(device, dtype)  # GPT-2's init scale
    target = torch.randint(0, s.vocab, (s.tokens,), generator=g)
    target[torch.rand(s.tokens, generator=g) < s.ignored] = IGNORE_INDEX
    return Inputs(hidden, weight, target.to(device))


def loss_step(x: Inputs, s: LinearCESetting, loss_of: Callable[[Tensor, Tensor], Tensor]) -> Step:
    """Forward + backward of ``loss_of(hidden, weight)`` on fresh leaf copies of both."""
    h, w = x.hidden_ND.clone().requires_grad_(), x.weight_VD.clone().requires_grad_()

    def run():
        h.grad = w.grad = None
        loss = loss_of(h, w)
        loss.backward()
        return loss

    def outputs():
        loss = run()
        return {"output": loss.detach().float().reshape(1), "grad:hidden": h.grad.float(), "grad:weight": w.grad.float()}

    return Step(run=run, items=s.tokens, outputs=outputs, flops=s.flops(), bytes=s.bytes(h.dtype))


def hf_lm_head_loss(hidden: Tensor, weight: Tensor, target: Tensor) -> Tensor:
    """Hugging Face's causal-LM loss on a Llama head: the logits, upcast to fp32, cross-entropy
    (``ForCausalLMLoss`` with the labels already shifted)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(F.linear(hidden, weight), None, weight.shape[0], shift_labels=target)


def liger_loss(hidden: Tensor, weight: Tensor, target: Tensor) -> Tensor:
    """Liger-Kernel's fused linear cross-entropy (CUDA, Triton), its mean over the counted targets."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)(weight, hidden, target)


def liger_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def head_group(s: LinearCESetting, x: Inputs, *, hf: bool, torch_op: bool = True) -> Group:
    """One head: the logits path (GPT-2's, or Hugging Face's with ``hf``) as the peer and the
    reference, torch's chunked op, Liger-Kernel's on CUDA where it imports, fastzoo's fused loss at
    its defaults. ``torch_op=False`` leaves torch's op out (on a CPU the slowest case by far: a run
    against the deadline of a busy machine)."""
    t = x.target_N
    if hf:
        peer_label, peer = "HF: lm_head + ForCausalLMLoss (logits upcast to fp32)", lambda h, w: hf_lm_head_loss(h, w, t)
    else:
        peer_label, peer = "reference: F.cross_entropy(hidden @ weight.T)", lambda h, w: F.cross_entropy(h @ w.T, t)

    def case(label, loss_of, **kw):
        return Case(label, lambda: loss_step(x, s, loss_of), **kw)

    def fused(h, w):
        # beside HF's loss, an fp32 loss as HF's (its logits upcast): autocast's convention for low-precision inputs
        with torch.autocast(h.device.type, dtype=h.dtype, enabled=hf and h.dtype in (torch.bfloat16, torch.float16)):
            return linear_cross_entropy(h, w, t, impl="fused")

    cases = [case(peer_label, peer, peer=True, reference=True)]
    if torch_op:
        cases.append(case("torch F.linear_cross_entropy (chunked)", lambda h, w: linear_cross_entropy(h, w, t, impl="torch")))
    if liger_available(x.hidden_ND.device):
        cases.append(case("Liger-Kernel LigerFusedLinearCrossEntropyLoss", lambda h, w: liger_loss(h, w, t)))
    cases.append(case("fastzoo linear_cross_entropy (fused, default)", fused))

    def reference():
        return loss_step(x, s, lambda h, w: F.cross_entropy(h.float() @ w.float().T, t)).outputs()

    return Group(f"{s.name} | fwd+bwd", cases, reference=reference, unit="tokens/s", cpu_memory=True)


def linear_ce_suite(setting: LinearCESetting = TARGET_SETTING, *, device="cpu", dtype=torch.float32, seed: int = 0,
                    limits: machine.Limits | bool = True, large_vocab: LinearCESetting | None = LARGE_VOCAB_SETTING,
                    torch_op: bool = True) -> Suite:
    """``setting`` against GPT-2's logits path, and ``large_vocab`` (None: left out) against
    Hugging Face's Llama loss. ``limits``: True measures them in this run (quick), or pass ones
    measured for several suites; False: no limit columns."""
    device = torch.device(device)
    if limits is True:
        limits = machine.measure(device, dtypes=(dtype,), quick=True)
    groups = [head_group(setting, make_inputs(setting, device, dtype, seed), hf=False, torch_op=torch_op)]
    if large_vocab is not None:
        groups.append(head_group(large_vocab, make_inputs(large_vocab, device, dtype, seed), hf=True, torch_op=torch_op))
    config = {"batch": setting.describe() + (f"; and {large_vocab.describe()}" if large_vocab else ""),
              "step": "forward + backward of the mean loss (grads of hidden and weight)",
              "peer": "the logits materialised, F.cross_entropy on them (Hugging Face's ForCausalLMLoss at the "
                      "large vocabulary)",
              "torch op": "F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())",
              "fastzoo beside HF": "bf16 / fp16 inputs under autocast: the matmuls in that dtype, the loss in fp32 as HF's",
              "peak memory": "tensors allocated during the step (torch profiler), inputs excluded",
              "FLOPs per step": "6 N D V (logits, grad of hidden, grad of weight)",
              "bytes per step": "hidden and weight read, their gradients written",
              "timing": "cases interleaved in rounds"}
    return Suite("linear_ce", groups, config=config, dtype=dtype, device=device, limits=limits or None,
                 interleave=True)


BATCH_FIELD = "tokens"  # the setting's field --batch-size sets


def cli_suite(setting, *, device, dtype) -> Suite:
    """``fastzoo bench`` with this module's ``TARGET_SETTING`` changed by ``--set`` / ``--batch-size``."""
    return linear_ce_suite(setting, device=device, dtype=dtype)

