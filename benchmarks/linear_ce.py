"""The LM head's loss, forward + backward: 4096 tokens x 768 -> vocab 50257 (GPT-2's head).
The logits materialised (the peer) vs torch's chunked F.linear_cross_entropy vs fastzoo's fused
linear_cross_entropy, timed in rounds (one step of each case per round: a shared CPU's load
hits all alike), with each case's peak memory.

    python benchmarks/linear_ce.py --device cpu --quick
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

from _common import parser, save, setup, timing  # noqa: E402
from fastzoo.bench import run_suite  # noqa: E402
from fastzoo.bench.linear_ce import TARGET_SETTING, linear_ce_suite  # noqa: E402


def run(device, out, *, quick, compile=None, note="", progress=True):  # a loss: no compiled rows
    suite = linear_ce_suite(TARGET_SETTING, device=device)  # fp32: the equivalence rule's setting
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True), out, "linear_ce")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, note=args.note, progress=not args.no_progress)
