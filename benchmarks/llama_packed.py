"""A Llama-layout training step on a realistic length mix (the decoder spec's ``bench`` workload:
4 layers x 256 wide, GQA 8/2, vocabulary 32000; 8 sequences, lengths log-normal around 128 tokens
in [16, 1024]): HF LlamaForCausalLM (SDPA) padded to the longest (the peer) vs fastzoo padded,
nested and packed (every backend taking packed sequences), the logits step and the step as users
write it (``labels=``: fastzoo's fused LM-head loss). Each packed row carries the workload's
FLOP-ratio bound (padded FLOPs ÷ packed FLOPs): what skipping the padding alone can give.

    python benchmarks/llama_packed.py --device cpu --quick
"""
import fastzoo
from _common import parser, recipes_for, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.causal_lm import causal_lm_suite
from fastzoo.registry import get_entry


def run(device, out, *, quick, compile=None, note="", progress=True):
    entry = get_entry("llama")
    backends = [b for b in fastzoo.list_attention(available_only=True)
                if not (device.type == "cpu" and b in ("eager", "flex"))]  # the reference is separate; flex trains on CUDA only
    suite = causal_lm_suite(entry, entry.spec.bench.sizes["bench"], backends=backends, modes=("train",),
                            recipes=recipes_for(entry, quick, device, compile), device=device)
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True),
                out, "llama_packed")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, compile=args.compile, note=args.note, progress=not args.no_progress)
