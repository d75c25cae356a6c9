"""GIoU loss, forward + backward: B images x 256 box slots with 1-4 real boxes each.
Per-sample loop vs concat vs padded vs the fused kernels (on gathered pairs, and on the
padded tensors with the masked mean inside) vs torchvision's loss on the concatenated real
pairs (the peer), gather included. 256 images is the target setting.

    python benchmarks/giou.py --device cpu --quick
"""

from _common import parser, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.giou import TARGET_SETTING, giou_suite


def run(device, out, *, quick, compile=None, note="", progress=True):  # a loss: no compiled rows
    suite = giou_suite(TARGET_SETTING, device=device)  # fp32: box coordinates are precision-sensitive
    # in rounds (one step of each case per round): a shared CPU's load hits every case alike
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True), out, "giou")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, note=args.note, progress=not args.no_progress)
