"""DETR's set loss per step (matcher + every term, 6 decoder layers, forward + backward),
transformers' ForObjectDetectionLoss vs fastzoo's set_prediction_loss in each GIoU mode, at 8 and
32 images x 100 queries with 1-50 boxes each, host reads per step counted; then a DETR training
step (ResNet-18 timm backbone, 6+6 layers at width 256, 100 queries, two image sizes padded;
forward with labels, loss, backward, fused AdamW step) vs transformers' DetrForObjectDetection
in fp32 on the same weights, in fp32 and in bf16 autocast with channels_last (where the device
computes bf16), per attention backend; the same step of Deformable DETR (ResNet-18 timm backbone, 4
levels, 6+6 layers at width 256, 300 queries) vs transformers' DeformableDetrForObjectDetection; the same step of
RT-DETR (ResNet-18-vd, hybrid encoder, 3 decoder layers, 300 queries, 100 denoising queries drawn from the same seed
for every case compared; NCHW: it has no channels_last layout) vs transformers' RTDetrForObjectDetection; the same
step of D-FINE small (HGNetV2-B0, 3 decoder layers, 300 queries, its distribution losses) vs transformers'
DFineForObjectDetection and of RF-DETR nano (windowed DINOv2-small, 2 decoder layers, 300 queries x 13 Group-DETR
groups; 384 px images: the two-stage queries need a map of 300 tokens) vs transformers' RfDetrForObjectDetection; and
the set loss per training step of Deformable DETR (8 images x 300 queries, focal term) and of RT-DETR (8 images x
300 queries, 6 decoder layers, the encoder's proposals, 100 denoising queries; forward + backward) vs transformers'
DeformableDetrForObjectDetectionLoss and RTDetrForObjectDetectionLoss.

    python benchmarks/set_loss.py --threads 1 [--part set_loss] [--part detr_step] [--part deformable_detr_step]
        [--part rt_detr_step] [--part d_fine_step] [--part rf_detr_step] [--part deformable_detr_loss] [--part rt_detr_loss]
"""
from _common import parser, save, setup, timing
from fastzoo.bench import limits, run_suite
from fastzoo.bench.detection import SIZES, detection_step_suite
from fastzoo.bench.recipes import BASELINE, Recipe, native_bf16
from fastzoo.bench.set_loss import DEFORMABLE_SETTING, LARGE_SETTING, TARGET_SETTING, rt_detr_suite, set_loss_suite

DETR_STEP = dict(backbone="resnet18")
PARTS = ("set_loss", "detr_step", "deformable_detr_step", "rt_detr_step", "d_fine_step", "rf_detr_step",
         "deformable_detr_loss", "rt_detr_loss")
# each step part: the model the suite builds, its config changes, whether it has a channels_last layout, image sizes
STEPS = {"detr": ("detr", DETR_STEP, True, SIZES), "deformable_detr": ("deformable_detr", DETR_STEP, True, SIZES),
         "rt_detr": ("rtdetr_r18vd", {}, False, SIZES), "d_fine": ("dfine_small_coco", {}, False, SIZES),
         "rf_detr": ("rf_detr_nano", {}, False, ((384, 384), (320, 384)))}


def run(device, out, *, quick, compile=None, note="", progress=True, parts=PARTS):
    """The reports by the name of the files they were saved to (set_loss, set_loss_b32, detr_step,
    deformable_detr_step, rt_detr_step, d_fine_step, rf_detr_step, deformable_detr_loss, rt_detr_loss)."""
    reports = {}
    if "set_loss" in parts:
        for setting, stem in ((TARGET_SETTING, "set_loss"), (LARGE_SETTING, "set_loss_b32")):
            suite = set_loss_suite(setting, device=device)
            suite.limits = limits.measure(device, quick=quick)
            reports[stem] = save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True),
                                 out, stem)
    loss_suites = {"deformable_detr_loss": lambda: set_loss_suite(DEFORMABLE_SETTING, device=device),
                   "rt_detr_loss": lambda: rt_detr_suite(device=device)}
    for stem in (p for p in loss_suites if p in parts):
        suite = loss_suites[stem]()
        suite.limits = limits.measure(device, quick=quick)
        reports[stem] = save(run_suite(suite, **timing(quick, device), progress=progress, note=note, interleave=True),
                             out, stem)
    for name, (model, config, channels_last, sizes) in STEPS.items():
        if f"{name}_step" not in parts:
            continue
        # fp32, and the fastest low-precision recipe the tour finds for it here (bf16 autocast with
        # channels_last: its fp32 channels_last and bf16 NCHW rows are slower); `fastzoo tour` tries every one
        tried = [BASELINE] + [Recipe("bf16 autocast", channels_last=channels_last)] * native_bf16(device)
        suite = detection_step_suite(model, config=config, sizes=sizes, device=device, recipes=tried)
        suite.limits = limits.measure(device, quick=quick)
        reports[f"{name}_step"] = save(run_suite(suite, **timing(quick, device), progress=progress, note=note,
                                                 interleave=True), out, f"{name}_step")
    return reports


if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("--part", choices=PARTS, action="append", help="run only this part (repeatable; default: all)")
    args = p.parse_args()
    device, out = setup(args)
    run(device, out, quick=args.quick, note=args.note, progress=not args.no_progress, parts=args.part or PARTS)
