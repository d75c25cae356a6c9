"""The seeds' three tables on one GPU (``benchmarks/gpu_suite.sh seeds`` runs one part per step):
ViT-B/16 training step per attention backend, GPT-2 training step padded vs packed per backend
that serves packing, GIoU loss per_sample / concat / padded / kernel at several box counts, each
beside the same-run GEMM peak and HBM bandwidth and the seed's own figure.

    python benchmarks/seeds.py --dry-run                       the plan and its projected H100 time (CPU, seconds)
    python benchmarks/seeds.py --part vit --device cuda        one part (writes seeds_vit.md / .json / .png)
"""
import sys

from _common import parser, save, setup
from fastzoo.bench import run_suite, seeds

PARTS = ("vit", "gpt2", "giou")


def run(device, out, *, part, note="", progress=True):
    suite = seeds.suite(part, device)
    return save(run_suite(suite, warmup=seeds.WARMUP, iters=seeds.ROUNDS, progress=progress, note=note, interleave=True),
                out, f"seeds_{part}")


if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--part", choices=PARTS, help="the part to run")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its projected H100 time; build nothing")
    args = p.parse_args()
    if args.dry_run:
        print(seeds.dry_run_text())
        sys.exit(0 if seeds.fits() else 1)
    if args.part is None:
        p.error("--part is required (or --dry-run)")
    device, out = setup(args)
    run(device, out, part=args.part, note=args.note, progress=not args.no_progress)
