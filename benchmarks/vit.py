"""ViT: fastzoo per attention backend vs timm's VisionTransformer (same weights), eval and train,
eager and compiled; softcap and 2-D neighbourhood masks, flex vs eager.

Full: the articles' configs (24 layers x 16 heads x 64 dims at 224/16; 6 layers x 12 heads
at patch 4, 3136 tokens). --quick: the same layer shapes, fewer layers, patch 8 for the
long one (stated in the output).

    python benchmarks/vit.py --device cuda
    python benchmarks/vit.py --device cpu --quick
"""
import fastzoo
from _common import parser, recipes_for, save, setup, timing
from fastzoo.bench import run_suite
from fastzoo.bench.image_classification import image_classification_suite
from fastzoo.models.spec import Workload
from fastzoo.registry import get_entry

MODEL = "vit_l16"


def _sizes(embed_dim, depth, num_heads, patch_size):
    return dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads, patch_size=patch_size, num_classes=1000)


# The articles' configurations: ViT-L/16 shape at 224, and a long-sequence ViT at patch 4.
ARTICLE = [Workload("L/16 224", _sizes(1024, 24, 16, 16)), Workload("long seq, patch 4", _sizes(768, 6, 12, 4))]
# Quick (2-core CPU in minutes): the same layer shapes with fewer layers and, for the long
# one, patch 8; a ViT's step time is linear in depth, so backend ratios carry over.
QUICK = [Workload("L/16 224, 2 of 24 layers", _sizes(1024, 2, 16, 16), batch=2),
         Workload("long seq, 1 of 6 layers, patch 8", _sizes(768, 1, 12, 8), batch=2)]


def run(device, out, *, quick, compile=None, note="", progress=True):
    entry = get_entry(MODEL)
    batch = 2 if quick else (8 if device.type == "cpu" else 32)
    workloads = [w.__class__(w.name, w.config, batch=batch) for w in (QUICK if quick else ARTICLE)]
    suite = image_classification_suite(entry, workloads, backends=fastzoo.list_attention(available_only=True),
                                       modes=("eval", "train"), recipes=recipes_for(entry, quick, device, compile),
                                       device=device, masks=True)
    return save(run_suite(suite, **timing(quick, device), progress=progress, note=note), out, "vit")


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, compile=args.compile, note=args.note, progress=not args.no_progress)
