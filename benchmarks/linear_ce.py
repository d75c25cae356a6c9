"""The LM head's loss, forward + backward: 4096 tokens x 768 -> vocab 50257 (GPT-2's head) against
the logits materialised, and 1024 tokens x 256 -> vocab 128256 (Llama-3's vocabulary) against
Hugging Face's causal-LM loss; torch's chunked F.linear_cross_entropy and fastzoo's fused
linear_cross_entropy (one pass over token chunks, its block set from the shapes) beside them, timed in
rounds (one step of each case per round: a shared CPU's load hits all alike), with each case's
peak memory. fp32 writes linear_ce.*, bf16 inputs linear_ce_bf16.*.

    python benchmarks/linear_ce.py --device cpu --quick --threads 2 [--dtype bf16]
"""

import torch

from _common import parser, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.linear_ce import TARGET_SETTING, linear_ce_suite

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run(device, out, *, quick, compile=None, note="", progress=True, dtype="fp32", torch_op=True):  # a loss: no compiled rows
    suite = linear_ce_suite(TARGET_SETTING, device=device, dtype=DTYPES[dtype], torch_op=torch_op)
    stem = "linear_ce" if dtype == "fp32" else f"linear_ce_{dtype}"
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True), out, stem)


if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="the inputs' dtype (fp32: the equivalence rule's)")
    p.add_argument("--no-torch-op", action="store_true", help="leave torch's chunked op out (the slowest case on a CPU)")
    args = p.parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, note=args.note, progress=not args.no_progress, dtype=args.dtype,
        torch_op=not args.no_torch_op)
