"""A Llama-layout training step on a realistic length mix (log-normal lengths, median 128):
HF LlamaForCausalLM padded to the longest (the peer) vs fastzoo packed (every backend taking
packed sequences) and padded, timed in rounds, with the FLOP-ratio bound of the workload
(padded FLOPs / packed FLOPs) stated beside the speed-ups.

    python benchmarks/llama_packed.py --device cpu --quick
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

import fastzoo  # noqa: E402
from _common import parser, save, setup, timing  # noqa: E402
from fastzoo.bench import run_suite  # noqa: E402
from fastzoo.bench.llama import TARGET_SETTING, llama_suite  # noqa: E402


def run(device, out, *, quick, compile=None, note="", progress=True):
    backends = [b for b in fastzoo.list_attention(available_only=True) if not (device.type == "cpu" and b == "flex")]
    suite = llama_suite(TARGET_SETTING, backends=backends, device=device)  # fp32: the equivalence rule's setting
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True), out, "llama_packed")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, note=args.note, progress=not args.no_progress)
