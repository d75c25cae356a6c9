"""A detection model's training step (forward with labels, set loss, backward, optimizer step)
against its original on the same weights and the same batch of images of different sizes
(padded, with a pixel mask), per recipe (precision, memory format) and per attention backend.

Each group is one recipe. Its cases: the original as its users run it (fp32, eager: the peer
every speed-up is against), the original under the group's recipe (``vs original, same
recipe``; in bf16 autocast it and the original on SDPA, its users' kernel, set the tolerance: at most
3x the worse of their errors vs fp32, ``fastzoo.equivalence.rule``), and fastzoo
per backend under the recipe (the fused GIoU kernel in the padded set loss, one host read per
step; ``varlen`` / ``nested`` run the encoder on each image's real tokens only). The optimizer is
transformers ``Trainer``'s default (fused AdamW), the same for every case. Parity: the loss and
every parameter gradient against the original in fp32 in the group's memory format, the bound widened
by the original's own fp32 rounding: the worse of its eager run's and its users' kernels' (transformers'
SDPA: on drawn weights DETR's SDPA run is 5.5e-3 of a decoder gradient's scale from its eager run, at
the tour's size) distance, parameter by parameter; for a family
whose original's spec says ``fp64_reference`` (Deformable DETR, RT-DETR, D-FINE: bilinear sampling's gradient
jumps at its cell edges, so two fp32 runs differ as much as a wrong port could), the fp32 groups also run the
original in fp64 (:mod:`fastzoo.equivalence.exact`: its random draws as the fp32 run's), and each fp32 case is
compared with that run: within 3x the original fp32's own error from it, worst over every gradient (flash-attn's
rule one precision up, ``Group.exact``). The weights are drawn (``equivalence.draw_``), then made to behave as
trained ones where the spec's ``like_trained`` says how (RF-DETR's boxes inside the image).
"""
from __future__ import annotations

import contextlib
import copy
from functools import cache

import torch

from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.bench.recipes import BASELINE, Recipe
from fastzoo.bench.steps import compared_as
from fastzoo.equivalence.exact import fp64_run
from fastzoo.equivalence.weights import draw_

# eager: on a CPU in bf16, torch's fused attention kernels train slower than matmul-softmax-matmul at
# DETR's lengths (100 queries, 10^2-10^3 keys, head dim 32); so every backend is timed
BACKENDS = ("sdpa", "eager", "varlen")
# the step's image sizes (h, w), cycled over the batch and padded to the largest
SIZES = ((160, 224), (128, 192))


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


def train_step(model, x, mask, labels, items: int, recipe: Recipe = BASELINE, flops: float | None = None) -> Step:
    """One training step of ``model`` under ``recipe`` (bf16 autocast or not; the memory format is
    the model's and ``x``'s): ``run`` steps the optimizer, ``outputs`` (parity) leaves the weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, fused=True)

    def forward_backward():
        for p in params:
            p.grad = None
        with torch.autocast(x.device.type, torch.bfloat16, enabled=recipe.autocast):
            loss = model(pixel_values=x, pixel_mask=mask, labels=labels).loss
        loss.backward()
        return loss

    def run():
        loss = forward_backward()
        optimizer.step()
        return loss

    def outputs():
        torch.manual_seed(0)  # what a step draws (RT-DETR's denoising queries) the same for every case compared
        loss = forward_backward()
        return {"output": loss.detach().float()[None],
                **{f"grad:{n}": p.grad.clone() for n, p in zip(names, params) if p.grad is not None}}

    return Step(run=run, items=items, outputs=outputs, flops=flops)


class _Workload:
    """The original (the weights drawn from the seed by equivalence.weights, never stepped: every case starts from its weights),
    the batch, and each case's model and step."""

    def __init__(self, name, config, images, sizes, device, seed):
        from fastzoo.registry import get_entry

        self.name, self.images, self.device = name, images, device
        entry = get_entry(name)
        self.spec = entry.spec
        cfg = {**entry.config, **config, "dropout": 0.0}
        torch.manual_seed(seed)
        self.original = draw_(entry.spec.original.build(cfg), seed=seed).to(device).train()
        if entry.spec.original.like_trained is not None:
            entry.spec.original.like_trained(self.original)
        self.description = entry.spec.original.description
        self.x, self.mask, self.labels = image_batch(images, sizes, self.original.config.num_labels, device, seed)
        self.names = {n for n, _ in self.fastzoo("eager", BASELINE).named_parameters()}

    def original_model(self, recipe: Recipe, *, users: bool = False):
        """A copy of the original in the recipe's memory format; ``users``: on the kernels its users get,
        transformers' SDPA (in bf16 it rounds unlike eager: measured on the tour's DETR, logits error
        0.036 against eager's 0.011, and fastzoo's SDPA path 0.036 with it)."""
        model = copy.deepcopy(self.original)
        if users:
            model = self.spec.as_users_run_it(model)
        return model.to(memory_format=torch.channels_last) if recipe.channels_last else model

    def fastzoo(self, attn: str, recipe: Recipe):
        import fastzoo

        layout = {"channels_last": True} if recipe.channels_last else {}  # a field of the families that offer it
        return fastzoo.create(self.name, pretrained=self.original, attn=attn, giou_impl="kernel",
                              **layout).to(self.device).train()

    def step(self, model, recipe: Recipe, *, counted: bool = True, gate: bool = True, original: bool = False) -> Step:
        """The timed step; ``counted``: with its own FLOPs (the packed encoder skips the padding's
        work); ``gate=False``: not parity-checked (the fp32 peer in another recipe's group); ``original``: the
        original's, its gradients compared under fastzoo's parameter names (RF-DETR's backbone is fastzoo's ViT)."""
        x = self.x.contiguous(memory_format=torch.channels_last) if recipe.channels_last else self.x
        s = train_step(model, x, self.mask, self.labels, self.images, recipe)
        if counted:
            s.flops = step_flops(train_step(copy.deepcopy(model), x, self.mask, self.labels, self.images, recipe).run)
        return compared_as(s, spec=self.spec, names=self.names, original=original, gate=gate)

    @cache
    def reference(self, channels_last: bool, exact: bool = False, users: bool = False) -> dict:
        """The original's outputs in the memory format (channels_last sums convolutions in another order),
        in fp32 or (``exact``) in fp64 (the model, images and boxes cast; ``fastzoo.equivalence.exact``'s run,
        with what the original's spec adds to it); ``users``: on its users' kernels."""
        recipe = Recipe(channels_last=channels_last)
        dtype = torch.float64 if exact else torch.float32
        model = self.original_model(recipe, users=users).to(dtype)
        x = self.x.to(dtype).contiguous(memory_format=torch.channels_last) if channels_last else self.x.to(dtype)
        labels = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()} for t in self.labels]
        step = compared_as(train_step(model, x, self.mask, labels, self.images, recipe), spec=self.spec,
                           names=self.names, original=True)
        with fp64_run(self.spec.original) if exact else contextlib.nullcontext():
            return step.outputs()

def detection_step_suite(name: str = "detr", *, config: dict, images: int = 4, sizes=SIZES,
                         device="cpu", seed: int = 0, recipes=(BASELINE,), backends=BACKENDS) -> Suite:
    """``name``'s training step at ``config`` (its original's field names) vs its original, per recipe and backend."""
    from fastzoo.bench.set_loss import host_reads

    device = torch.device(device)
    if any(r.cast is not None for r in recipes):
        raise ValueError(f"recipes: a detector's step runs in fp32 or under autocast (its set loss and box arithmetic "
                         f"stay fp32), not cast: got {[r.name for r in recipes if r.cast is not None]}")
    w = _Workload(name, config, images, sizes, device, seed)
    groups = []
    for recipe in recipes:
        baseline, low = recipe == BASELINE, recipe.dtype != torch.float32
        peer = f"{w.description}, fp32"
        cases = [Case(peer, lambda b=baseline: w.step(w.original_model(BASELINE), BASELINE, gate=b, original=True),
                      peer=True, reference=baseline, original=baseline, dtype=torch.float32)]
        if not baseline:
            cases.append(Case(f"{w.description}, {recipe.name}",
                              lambda r=recipe: w.step(w.original_model(r), r, original=True), reference=True, original=True))
        if low:  # the rule's peer is the worse of the original's runs on its reference kernels and on its users'
            cases.append(Case(f"{w.description.split(' (')[0]} (sdpa), {recipe.name}",
                              lambda r=recipe: w.step(w.original_model(r, users=True), r, original=True), reference=True,
                              original=True))
        for b in backends:
            cases.append(Case(f"fastzoo {b}, {recipe.name}", lambda b=b, r=recipe: w.step(w.fastzoo(b, r), r)))
        exact = (lambda cl=recipe.channels_last: w.reference(cl, exact=True)) if w.spec.original.fp64_reference and not low else None
        kernels = None if low else (lambda cl=recipe.channels_last: w.reference(cl, users=True))
        groups.append(Group(f"{name} training step, {images} images of sizes {list(sizes)} | {recipe.name}", cases,
                            unit="images/s", reference=lambda cl=recipe.channels_last: w.reference(cl),
                            dtype=recipe.dtype if low else None, exact=exact, kernels=kernels))
    reads = {"original": host_reads(w.step(w.original_model(BASELINE), BASELINE, counted=False).run),
             "fastzoo sdpa": host_reads(w.step(w.fastzoo("sdpa", BASELINE), BASELINE, counted=False).run)}
    config_out = {"model": f"{name} with {config}", "batch": f"{images} images, sizes {list(sizes)}, padded + pixel_mask",
                  "step": "forward with labels, set loss, backward, fused AdamW step",
                  "host reads per step": reads}
    return Suite("detection_step", groups, config=config_out, device=device)


def use_code(name: str, label: str) -> str:
    """The code a user writes for the fastzoo case ``label`` (the tour adds its recipe's)."""
    return f'fastzoo.create("{name}", pretrained=hf_detr, attn="{label[len("fastzoo "):].split(",")[0]}")'


def tour_entry(spec, size, device, compile):
    """The tour's entry for a detector (its task's ``tour``): one training step per recipe worth
    trying here and per backend, against its original (loss and every gradient checked), at the
    family's ``tour`` / ``quick`` workload: ``batch`` images of two sizes (``img_size`` square, and
    half as high), padded, with a pixel mask."""
    from fastzoo.bench.recipes import recipes
    from fastzoo.bench.tour import Entry, recipe_groups

    w = spec.bench.sizes[size]
    name, side = spec.bench.variant, w.img_size
    # a cast precision (a GPU's bf16) runs as autocast: the set loss and the box arithmetic stay fp32
    tried = list(dict.fromkeys(r if r.cast is None else Recipe("bf16 autocast", r.channels_last)
                               for r in recipes(spec.bench, device, compile=False)))
    suite = detection_step_suite(name, config=dict(w.config), images=w.batch, sizes=((side, side), (side // 2, side)),
                                 device=device, recipes=tried)
    paths = {c.label: use_code(name, c.label) for g in suite.groups for c in g.cases if c.label.startswith("fastzoo")}
    return Entry(name, suite.groups[0].cases[0].label, suite, paths, recipe_groups(suite, tried), device.type)
