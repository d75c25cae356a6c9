"""ResNet-50: fastzoo vs torchvision on the same weights, channels_last and bf16 autocast on/off,
eval and train. --quick: batch 2 at 128x128.

    python benchmarks/resnet.py --device cpu --quick
"""

from _common import parser, recipes_for, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.image_classification import image_classification_suite
from fastzoo.models.spec import Workload
from fastzoo.registry import get_entry


def run(device, out, *, quick, compile=None, note="", progress=True):
    entry = get_entry("resnet50")
    workload = Workload(f"ResNet-50 at {128 if quick else 224}", batch=2 if quick else (8 if device.type == "cpu" else 128),
                        img_size=128 if quick else 224)
    suite = image_classification_suite(entry, [workload], backends=[], modes=("eval", "train"),
                                       recipes=recipes_for(entry, quick, device, compile), device=device)
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note), out, "resnet50")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, compile=args.compile, note=args.note, progress=not args.no_progress)
