"""GPT-2 on variable-length batches (lengths uniform in [1, max]): HF GPT2LMHeadModel (SDPA)
padded to the longest (the peer) and to the maximum, an HF loop over sequences, vs fastzoo
padded / pad-to-longest / nested / packed (every backend taking packed sequences).
Throughput counts real tokens only. The config is the CPU target setting: 4 layers x 256
wide, 8 sequences of 1..512 tokens (the same for --quick: it is already small; --quick on
CPU leaves out the eager and flex rows).

    python benchmarks/gpt2_varlen.py --device cpu --quick
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

import fastzoo  # noqa: E402
from _common import compile_modes, dtype_for, parser, save, setup, timing  # noqa: E402
from fastzoo.bench import run_suite  # noqa: E402
from fastzoo.bench.gpt2 import TARGET_SETTING, GPT2Setting, gpt2_suite  # noqa: E402

# On GPU: the articles' scale, a GPT-2 small on 32 sequences up to 1024 tokens.
GPU_SETTING = GPT2Setting("GPT-2 small, 32 seqs in [1,1024]", 12, 768, 12, 32, 1024)


def run(device, out, *, quick, compile=None, note="", progress=True):
    setting = GPU_SETTING if device.type == "cuda" and not quick else TARGET_SETTING
    backends = fastzoo.list_attention(available_only=True)
    if quick and device.type == "cpu":  # minutes on 2 cores: fp32 needs no eager case (the reference is
        backends = [b for b in backends if b not in ("eager", "flex")]  # separate), uncompiled flex is unfused
    suite = gpt2_suite(setting, backends=backends,
                       compile_modes=compile_modes(quick, device, compile), device=device, dtype=dtype_for(device))
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True),
                out, "gpt2_varlen")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, compile=args.compile, note=args.note, progress=not args.no_progress)
