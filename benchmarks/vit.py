"""ViT: fastzoo per attention backend vs timm's VisionTransformer (same weights), eval and train,
eager and compiled; softcap and 2-D neighbourhood masks, flex vs eager.

Full: the articles' configs (24 layers x 16 heads x 64 dims at 224/16; 6 layers x 12 heads
at patch 4, 3136 tokens). --quick: the same layer shapes, fewer layers, patch 8 for the
long one (stated in the output).

    python benchmarks/vit.py --device cuda
    python benchmarks/vit.py --device cpu --quick
"""
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

import fastzoo  # noqa: E402
from _common import compile_modes, dtype_for, parser, save, setup, timing  # noqa: E402
from fastzoo.bench import run_suite  # noqa: E402
from fastzoo.bench.vit import ARTICLE_SETTINGS, QUICK_SETTINGS, vit_suite  # noqa: E402


def run(device, out, *, quick, compile=None, note="", progress=True):
    suite = vit_suite(
        QUICK_SETTINGS if quick else ARTICLE_SETTINGS,
        backends=fastzoo.list_attention(available_only=True),
        compile_modes=compile_modes(quick, device, compile),
        batch_size=2 if quick else (8 if device.type == "cpu" else 32),
        device=device,
        dtype=dtype_for(device),
    )
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note), out, "vit")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, compile=args.compile, note=args.note, progress=not args.no_progress)
