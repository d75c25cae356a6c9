"""Multi-scale deformable attention, forward + backward, at Deformable DETR's sizes (800x800 image,
strides 8-64, 8 heads x 32, 4 levels x 4 points; encoder: every token a query, decoder: 300): the
fused kernel (C++ on CPU, Triton on CUDA) vs transformers' grid_sample path, interleaved in rounds,
load average before and after in the note.

    OMP_NUM_THREADS=1 python benchmarks/deformable_attention.py --device cpu --threads 1
"""

from _common import parser, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.deformable import QUICK_SETTING, TARGET_SETTING, deformable_suite
from fastzoo.machine import load_average


def run(device, out, *, quick, compile=None, note="", progress=True):  # a kernel: no compiled rows
    before = load_average()
    suite = deformable_suite(QUICK_SETTING if quick else TARGET_SETTING, device=device)  # fp32: the rule's setting
    report = run_suite(suite, **timing(quick, device), progress=progress, interleave=True)
    report.note = " ".join(w for w in (note, f"load average (1 min) before {before:.2f}, after {load_average():.2f}") if w)
    return save(report, out, "deformable_attention")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, note=args.note, progress=not args.no_progress)
