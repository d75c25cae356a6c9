"""GPT-2 on variable-length batches (lengths uniform in [1, max]): HF GPT2LMHeadModel (SDPA)
padded to the longest (the peer) and to the maximum, an HF loop over sequences, vs fastzoo
padded / pad-to-longest / nested / packed (every backend taking packed sequences).
Throughput counts real tokens only. The config is the CPU target setting (the spec's bench
workload): 4 layers x 256 wide, 8 sequences of 1..512 tokens (the same for --quick: it is
already small; --quick on CPU leaves out the eager and flex rows).

    python benchmarks/gpt2_varlen.py --device cpu --quick
"""
import fastzoo
from _common import parser, recipes_for, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.causal_lm import causal_lm_suite
from fastzoo.models.spec import Workload
from fastzoo.registry import get_entry

# On GPU: the articles' scale, a GPT-2 small on 32 sequences up to 1024 tokens.
GPU_WORKLOAD = Workload("GPT-2 small, 32 seqs in [1,1024]", batch=32, max_len=1024)


def run(device, out, *, quick, compile=None, note="", progress=True):
    entry = get_entry("gpt2")
    workload = GPU_WORKLOAD if device.type == "cuda" and not quick else entry.spec.bench.sizes["bench"]
    backends = fastzoo.list_attention(available_only=True)
    if quick and device.type == "cpu":  # minutes on 2 cores: fp32 needs no eager case (the reference is
        backends = [b for b in backends if b not in ("eager", "flex")]  # separate), uncompiled flex is unfused
    suite = causal_lm_suite(entry, workload, backends=backends, recipes=recipes_for(entry, quick, device, compile),
                            device=device)
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True),
                out, "gpt2_varlen")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, compile=args.compile, note=args.note, progress=not args.no_progress)
