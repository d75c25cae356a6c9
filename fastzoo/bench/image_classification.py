"""Image classifiers (every family of the image-classification task): fastzoo against
its original on the same weights, per recipe (precision, memory format, compilation) and per
attention backend where the model has attention.

Each group is one workload, one mode, one recipe. Its cases: the original as its users run
it (fp32, eager, the library's own default attention: the peer every speed-up is against),
the original under the group's recipe (``vs original, same recipe``), and fastzoo per backend
under the recipe. Parity: against the original with its reference kernels in fp32 and the
group's memory format (channels_last sums convolutions in another order); in a low
precision, within 3x the original's own error in that precision. With ``masks``, FlexAttention
is also timed against eager on masks only a flexible kernel expresses (logit soft-capping,
2-D neighbourhood attention over the patch grid).
"""
from __future__ import annotations

import copy
from functools import cache

import torch

import fastzoo
from fastzoo.bench.harness import Case, Group, Suite
from fastzoo.bench.recipes import BASELINE, Recipe, prepare, prepare_images
from fastzoo.bench.steps import check_mode, classification_loss, compared_as, model_step
from fastzoo.equivalence.weights import draw_
from fastzoo.layers.attention import UsesAttention
from fastzoo.models.spec import Workload

MASK_VARIANTS = {  # name -> backend options (the same preset on eager and flex)
    "softcap 50": {"score_mod": "softcap", "softcap": 50.0},
    "2-D neighbourhood r=3": {"mask_mod": "neighborhood", "radius": 3},
}


def image_classification_suite(
    entry,
    workloads: list[Workload],
    *,
    backends: list,  # names, or (name, options) for a pinned kernel
    modes=("train",),
    recipes=(BASELINE,),
    device="cpu",
    masks: bool = False,
    original_eager: bool = True,
    seed: int = 0,
) -> Suite:
    """``entry``: the registry entry (``fastzoo.registry.get_entry(name)``) whose variant each
    workload changes. ``original_eager``: also time the original with its reference attention."""
    device = torch.device(device)
    groups, config = [], {}
    for w in workloads:
        models = _Models(entry, w, device, seed)
        config[w.name or entry.name] = models.describe()
        for mode in map(check_mode, modes):
            for recipe in recipes:
                groups.append(_recipe_group(models, mode, recipe, backends, original_eager))
                if masks and "flex" in backends and recipe == BASELINE and models.attention:
                    groups += _mask_groups(models, mode)
    config.update({"batch size": ", ".join(str(w.batch) for w in workloads), "peer": models.peer_label + ", fp32, eager"})
    if masks and "flex" in backends:
        config["mask variants"] = "flex vs eager (the peer there: no library has these masks)"
    if "flex" in backends and device.type == "cpu":
        config["flex on CPU"] = ("not compiled: PyTorch runs it unfused (materialises the scores); compiled flex on CPU "
                                 "is refused (wrong results seen with torch 2.14.1), so its compiled rows say so")
    return Suite(entry.spec.family, groups, config=config, device=device)


class _Models:
    """One workload's original (the weights drawn from the seed: equivalence.weights), its inputs and its fastzoo twins."""

    def __init__(self, entry, w: Workload, device: torch.device, seed: int):
        spec, bench = entry.spec, entry.spec.bench
        self.entry, self.spec, self.bench, self.device = entry, spec, bench, device
        self.values = {**entry.config, **bench.deterministic, **w.config}
        self.cfg = spec.config_class.from_dict(self.values)
        self.name = w.name or entry.name
        torch.manual_seed(seed)
        self.original = draw_(spec.original.build(self.values), seed=seed).eval()
        side = getattr(self.cfg, "img_size", None) or w.img_size
        self.side = side if isinstance(side, int) else side[0]
        self.batch = w.batch
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(w.batch, self.cfg.in_chans, self.side, self.side, generator=g)
        self.loss = classification_loss(torch.randint(0, self.cfg.num_classes, (w.batch,), generator=g).to(device))
        twin = self.fastzoo(None)
        self.attention = any(isinstance(m, UsesAttention) for m in twin.modules())
        self.names = {n for n, _ in twin.named_parameters()}
        self.peer_label = bench.library + (f" ({bench.peer_attention})" if bench.peer_attention else "")

    def describe(self) -> str:
        changed = {k: v for k, v in self.values.items() if k not in self.entry.config or self.entry.config[k] != v}
        sizes = ", ".join(f"{k}={v}" for k, v in changed.items())
        return f"{self.entry.name}{' with ' + sizes if sizes else ''}, {self.side}x{self.side} images"

    def flops(self, mode: str) -> float | None:
        return self.spec.task.flops(self.spec, self.cfg, batch=self.batch, img_size=self.side, train=mode == "train")

    def fastzoo(self, attn: str | None, options=None, dtype=None):
        """fastzoo's model from the original's weights; ``attn``: its backend (None: it has no attention)."""
        model = fastzoo.create(self.entry.name, attn="eager", pretrained=self.original)
        if attn is not None:
            model.set_attention(attn, device=self.device, dtype=dtype, **(options or {}))
        return model

    def users_original(self):
        """The original as its users run it (the library's default attention)."""
        m = copy.deepcopy(self.original)
        return self.spec.as_users_run_it(m)

    def step(self, model, mode: str, recipe: Recipe, *, original: bool = False, gate: bool = True):
        """The timed step; ``original``: gradients under fastzoo's names; ``gate=False``: not
        parity-checked (the baseline in another recipe's group: its parity is the baseline group's)."""
        x = prepare_images(self.images, recipe, self.device)
        s = model_step(prepare(model, recipe, self.device), (x,), mode=mode, loss=self.loss, items=self.batch,
                       compile=recipe.compiled)
        s.flops = self.flops(mode)
        return compared_as(s, spec=self.spec, names=self.names, original=original, gate=gate)

    @cache
    def reference(self, mode: str, channels_last: bool, options=()):
        """fp32 outputs of the original with its reference kernels (fastzoo eager with mask options)."""
        recipe = Recipe(channels_last=channels_last)
        if options:
            return self.step(self.fastzoo("eager", dict(options)), mode, recipe).outputs()
        return self.step(copy.deepcopy(self.original), mode, recipe, original=True).outputs()


def _recipe_group(m: _Models, mode: str, recipe: Recipe, backends, original_eager: bool) -> Group:
    baseline = recipe == BASELINE
    low = recipe.dtype != torch.float32
    c = recipe.compiled
    cases = [Case(m.peer_label + ("" if baseline else ", fp32 eager"), lambda: m.step(
        m.users_original(), mode, BASELINE, original=True, gate=baseline), peer=True, original=baseline, dtype=torch.float32)]
    if not baseline:  # the original under the same recipe: low-precision parity is held to its own error
        cases.append(Case(m.peer_label, lambda: m.step(m.users_original(), mode, recipe, original=True),
                          reference=True, original=True, compiled=c))
    if baseline and original_eager and m.spec.original.users is not None:
        cases.append(Case(f"{m.bench.library} (eager)", lambda: m.step(copy.deepcopy(m.original), mode, recipe, original=True)))
    for b in backends if m.attention else (None,):
        b, options = (b, {}) if b is None or isinstance(b, str) else b  # a name, or (name, options): a pinned kernel
        label = f"fastzoo {b}" + "".join(f" ({k}={v})" for k, v in options.items()) if b else "fastzoo"
        cases.append(Case(label, lambda b=b, options=options: m.step(m.fastzoo(b, options, dtype=recipe.dtype), mode, recipe),
                          reference=b == "eager" and not options and not low and baseline, compiled=c))
    name = f"{m.name} | {mode} | {recipe.name}"
    return Group(name, cases, reference=lambda: m.reference(mode, recipe.channels_last), dtype=recipe.dtype)


def _mask_groups(m: _Models, mode: str) -> list[Group]:
    from fastzoo.attention import backend_class

    if mode == "train" and m.device.type not in backend_class("flex").capabilities.backward:
        return []  # flex has no backward here
    groups = []
    for variant, opts in MASK_VARIANTS.items():
        cases = [Case(f"fastzoo {b}", lambda b=b, o=opts: m.step(m.fastzoo(b, o), mode, BASELINE),
                      peer=b == "eager", reference=b == "eager") for b in ("eager", "flex")]
        key = tuple(sorted(opts.items()))
        groups.append(Group(f"{m.name} | {mode} | {variant}", cases, reference=lambda k=key: m.reference(mode, False, k)))
    return groups


def use_code(entry, label: str) -> str | None:
    """The code a user writes for the fastzoo case ``label`` (None: not a fastzoo case)."""
    if not label.startswith("fastzoo"):
        return None
    backend = label[len("fastzoo "):]
    attn = f', attn="{backend}"' if backend else ""
    return f'fastzoo.create("{entry.name}"{attn}, pretrained={entry.spec.bench.library.lower()}_model)'


def model_suite(entry, workload: Workload, *, backends, mode, device, recipes) -> Suite:
    """``fastzoo bench NAME`` for an image classifier (its task's ``bench``)."""
    return image_classification_suite(entry, [workload], backends=backends, modes=(mode,), recipes=recipes, device=device)


def tour_entry(spec, size, device, compile):
    """The tour's entry for an image classifier (its task's ``tour``): one training step per recipe
    and per attention backend that takes a dense batch, against the original as its users run it."""
    from fastzoo.bench.recipes import recipes
    from fastzoo.bench.tour import Entry, dense_backends, recipe_groups
    from fastzoo.registry import get_entry

    entry, tried = get_entry(spec.bench.variant), recipes(spec.bench, device, compile=compile)
    suite = image_classification_suite(entry, [spec.bench.sizes[size]], backends=dense_backends(device), recipes=tried,
                                       device=device, original_eager=False)
    paths = {c.label: use_code(entry, c.label) for g in suite.groups for c in g.cases if use_code(entry, c.label)}
    return Entry(entry.name, suite.groups[0].cases[0].label, suite, paths, recipe_groups(suite, tried), device.type)

