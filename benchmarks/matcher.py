"""The detector's Hungarian matcher per step, 256 images x 100 queries with 1-4 boxes each:
DETR's batch-wide cost (before) vs fastzoo's per-image padded cost (after), one host copy each.

    python benchmarks/matcher.py --device cpu --quick
"""

from _common import parser, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.matcher import TARGET_SETTING, matcher_suite


def run(device, out, *, quick, compile=None, note="", progress=True):
    suite = matcher_suite(TARGET_SETTING, device=device)
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True), out, "matcher")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, note=args.note, progress=not args.no_progress)
