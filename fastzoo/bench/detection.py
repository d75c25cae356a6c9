"""A detection model's training step (forward, set loss, backward) against its original on the same
weights and the same batch of images of different sizes (padded, with a pixel mask): the original
in fp32 with its reference attention, fastzoo on its recommended path (SDPA, the fused GIoU kernel
in the padded set loss, one host read per step) and on the packed-encoder path (varlen: the
encoder runs on the real tokens only). Parity: loss and every parameter gradient.
"""
from __future__ import annotations

import torch

from fastzoo.bench.harness import Case, Group, Step, Suite


def image_batch(images: int, sizes, num_labels: int, device, seed: int = 0):
    """``images`` images of the given (h, w) sizes (cycled) padded to the largest, their pixel
    mask, and 1-10 boxes each in transformers' labels format."""
    g = torch.Generator().manual_seed(seed)
    H, W = max(h for h, _ in sizes), max(w for _, w in sizes)
    x = torch.zeros(images, 3, H, W)
    mask = torch.zeros(images, H, W, dtype=torch.long)
    labels = []
    for i in range(images):
        h, w = sizes[i % len(sizes)]
        x[i, :, :h, :w] = torch.randn(3, h, w, generator=g)
        mask[i, :h, :w] = 1
        n = int(torch.randint(1, 11, (1,), generator=g))
        c, wh = torch.rand(n, 2, generator=g) * 0.6 + 0.2, torch.rand(n, 2, generator=g) * 0.3 + 0.05
        labels.append({"class_labels": torch.randint(0, num_labels, (n,), generator=g).to(device),
                       "boxes": torch.cat([c, wh], 1).to(device)})
    return x.to(device), mask.to(device), labels


def step_flops(run) -> float | None:
    """FLOPs of one call of ``run`` (a training step), counted by torch's ``FlopCounterMode``
    (matmuls and convolutions, forward and backward), or None where the counter cannot run the step."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            run()
    except (RuntimeError, TypeError, NotImplementedError):  # an op the counter cannot enter (eager flex on CUDA)
        return None
    return float(counter.get_total_flops())


def train_step(model, x, mask, labels, items: int, flops: float | None = None) -> Step:
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def run():
        for p in params:
            p.grad = None
        loss = model(pixel_values=x, pixel_mask=mask, labels=labels).loss
        loss.backward()
        return loss

    def outputs():
        loss = run()
        return {"output": loss.detach()[None], **{f"grad:{n}": p.grad.clone() for n, p in zip(names, params)}}

    return Step(run=run, items=items, outputs=outputs, flops=flops)


def detection_step_suite(name: str = "detr", *, config: dict, images: int = 4, sizes=((160, 224), (128, 192)),
                         device="cpu", seed: int = 0) -> Suite:
    """``name``'s training step at ``config`` (its original's field names) vs its original."""
    import fastzoo
    from fastzoo.bench.set_loss import host_reads
    from fastzoo.registry import get_entry

    device = torch.device(device)
    entry = get_entry(name)
    cfg = {**entry.config, **config, "dropout": 0.0}
    torch.manual_seed(seed)
    original = entry.spec.original.build(cfg).to(device).train()
    x, mask, labels = image_batch(images, sizes, cfg.get("num_labels", 91), device, seed)

    def counted(model) -> Step:  # a step with its own FLOPs: the packed encoder skips the padding's work
        return train_step(model, x, mask, labels, images, step_flops(train_step(model, x, mask, labels, images).run))

    def ours(attn: str):
        return fastzoo.create(name, pretrained=original, attn=attn, loss="kernel").to(device).train()

    cases = [Case(f"{entry.spec.original.description}, fp32", lambda: counted(original), peer=True, reference=True),
             Case("fastzoo, SDPA + fused GIoU set loss, fp32", lambda: counted(ours("sdpa"))),
             Case("fastzoo, packed encoder (varlen) + fused GIoU set loss, fp32",
                  lambda: counted(ours("varlen")))]
    reads = {"original": host_reads(train_step(original, x, mask, labels, images).run),
             "fastzoo sdpa": host_reads(train_step(ours("sdpa"), x, mask, labels, images).run)}
    group = Group(f"{name} training step, {images} images of sizes {list(sizes)}", cases, unit="images/s",
                  reference=lambda: train_step(original, x, mask, labels, images).outputs())
    config_out = {"model": f"{name} with {config}", "batch": f"{images} images, sizes {list(sizes)}, padded + pixel_mask",
                  "host reads per step": reads}
    return Suite("detection_step", [group], config=config_out, device=device)


def tour_entry(spec, size, device, compile):
    """The tour's entry for a detector (its task's ``tour``): one training step against its original
    (loss and every gradient checked), at the family's ``tour`` / ``quick`` workload: ``batch`` images
    of two sizes (``img_size`` square, and half as high), padded, with a pixel mask."""
    from fastzoo.bench.recipes import BASELINE
    from fastzoo.bench.tour import Entry

    w = spec.bench.sizes[size]
    name, side = spec.bench.variant, w.img_size
    suite = detection_step_suite(name, config=dict(w.config), images=w.batch, sizes=((side, side), (side // 2, side)),
                                 device=device)
    labels = [c.label for c in suite.groups[0].cases]
    paths = {labels[1]: f'fastzoo.create("{name}", pretrained=hf_detr)',
             labels[2]: f'fastzoo.create("{name}", pretrained=hf_detr, attn="varlen")'}
    return Entry(name, labels[0], suite, paths, {suite.groups[0].name: BASELINE}, device.type)
