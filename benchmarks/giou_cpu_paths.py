"""GIoU loss on CPU, forward+backward, by path: the per-image loop, torchvision's loss on the
concatenated pairs, the vectorised closed form (the fallback) and the fused C++ kernel.

    python benchmarks/giou_cpu_paths.py [--images 256] [--max-boxes 7] [--large 200000]

Two sizes: B images with 1..max_boxes matched pairs each (~1000 pairs at the defaults), and
``--large`` pairs spread over the same B images. Each row is the median of repeated steps
(fresh leaf, loss, backward); ratios are against the fused kernel. The vectorised path runs
in a child process with FASTZOO_GIOU_CPU=vectorised, because once the C++ kernel is loaded it
owns the CPU dispatch of the op.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def matched_pairs(images: int, max_boxes: int, total: int | None, seed: int = 0):
    """Per-image box counts and concatenated (pred, target) xyxy pairs in [0, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    if total is None:
        counts = torch.randint(1, max_boxes + 1, (images,), generator=g).tolist()
    else:
        counts = [total // images + (i < total % images) for i in range(images)]
    n = sum(counts)

    def boxes():
        xy = torch.rand(n, 2, generator=g)
        return torch.cat([xy, xy + torch.rand(n, 2, generator=g) * 0.5], -1)

    return counts, boxes(), boxes()


def median_us(step, budget_s: float = 2.0, min_reps: int = 5) -> float:
    for _ in range(3):
        step()
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def rows_for(counts, pred, target, which) -> dict[str, float]:
    from torchvision.ops import generalized_box_iou_loss

    import fastzoo.losses.giou as G

    def step(loss_fn):
        def run():
            leaf = pred.clone().requires_grad_()
            loss_fn(leaf).backward()
        return run

    rows = {}
    if "loop" in which:
        rows["per-sample loop (fastzoo, torch ops)"] = median_us(step(
            lambda p: G.giou_loss_per_sample(list(p.split(counts)), list(target.split(counts)), validate=False)))
    if "torchvision" in which:
        rows["torchvision, concatenated pairs"] = median_us(step(
            lambda p: generalized_box_iou_loss(p, target, reduction="sum")))
    if "kernel" in which:
        path = G.kernel_path("cpu")
        rows[f"kernel ({path})"] = median_us(step(lambda p: G.giou_loss_kernel(p, target, validate=False)))
        rows[f"kernel ({path}), validate=True"] = median_us(step(lambda p: G.giou_loss_kernel(p, target)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--max-boxes", type=int, default=7)
    ap.add_argument("--large", type=int, default=200_000)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # "<size>": time only the kernel, print JSON
    args = ap.parse_args()
    sizes = {"small": None, "large": args.large}
    if args.child:
        counts, p, t = matched_pairs(args.images, args.max_boxes, sizes[args.child])
        print(json.dumps(rows_for(counts, p, t, ("kernel",))))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for size, total in sizes.items():
        counts, p, t = matched_pairs(args.images, args.max_boxes, total)
        rows = rows_for(counts, p, t, ("loop", "torchvision", "kernel"))
        env = {**os.environ, "FASTZOO_GIOU_CPU": "vectorised"}
        child = subprocess.run([sys.executable, __file__, "--child", size, "--images", str(args.images),
                                "--max-boxes", str(args.max_boxes), "--large", str(args.large)],
                               capture_output=True, text=True, env=env, check=True)
        rows.update(json.loads(child.stdout.strip().splitlines()[-1]))
        fused = rows["kernel (cpu-cpp)"]
        print(f"\n{args.images} images, {len(p)} pairs, forward+backward (median)")
        print(f"{'path':44s} {'time':>12s} {'kernel is x faster':>20s}")
        for name, us in rows.items():
            print(f"{name:44s} {us / 1000:9.3f} ms {us / fused:19.1f}x")


if __name__ == "__main__":
    main()
