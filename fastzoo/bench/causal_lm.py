"""Causal LMs (every family of the causal-LM task) on variable-length batches: padding
vs packing, per recipe (precision; compilation where the family's spec allows it).

Sequence lengths are uniform in [1, max_len]. The peer is the original (Hugging Face) as its
users run it (its default attention, fp32), padded to the longest sequence; the original
padded to the maximum length, a loop that runs each sequence alone, and the original on HF's
own packing (``DataCollatorWithFlattening``: one row, positions restarting per sequence; with
``use_cache=False``, without which transformers 5.17 attends across the sequences on every CPU
attention, see :func:`flattened_vs_packed`) are timed too. fastzoo
runs padded (to max, to longest), as a jagged NestedTensor, and packed
(``fastzoo.data.pack``: one row, ``cu_seqlens``) with every requested backend that takes
packed sequences. Throughput counts real tokens only; packed rows carry the FLOP-ratio bound
(the padded step's FLOPs / the packed step's). Parity compares the logits of real tokens,
sequence by sequence, with fastzoo's eager model padded to the longest in fp32; in a low
precision, within 3x the original's own error under the same recipe.

Besides the logits step, ``train`` adds the step as users write it (``labels=``: fastzoo's
fused LM-head loss) and ``eval`` adds ``generate`` with the KV cache.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from functools import cache, partial

import torch
import torch.nn.functional as F

import fastzoo
from fastzoo.bench.harness import Case, Group, Step, Suite
from fastzoo.bench.recipes import BASELINE, Recipe, prepare
from fastzoo.bench.steps import check_mode, compared_as, model_step
from fastzoo.equivalence.weights import draw_
from fastzoo.models.spec import Workload

GENERATE_NEW_TOKENS = 32
# HF's packing as its docs give it: the collator's rows (input_ids [1, T], position_ids restarting
# per sequence). transformers (5.17) reads sequence boundaries from position_ids only when the model
# has no KV cache; its decoders make one by default (config.use_cache), so use_cache=False is part
# of the recipe (tests/test_hf_flattening.py checks both sides of that on every CPU attention)
FLATTENED = "with DataCollatorWithFlattening, use_cache=False"


def causal_lm_suite(
    entry,
    workload: Workload,
    *,
    backends: list[str],
    modes=("eval", "train"),
    recipes=(BASELINE,),
    steps=("logits", "labels"),
    device="cpu",
    seed: int = 0,
) -> Suite:
    """``entry``: the registry entry whose variant ``workload`` changes. ``steps``: the logits
    step (every layout, loss on the real tokens' logits) and, in train mode, the step as users
    write it (``labels=``), each under every recipe."""
    device = torch.device(device)
    m = _Models(entry, workload, device, seed)
    batch = _Batch.draw(m, workload, device, seed)
    groups = []
    for mode in map(check_mode, modes):
        if "logits" in steps:  # one fp32 reference for every recipe's group
            reference = cache(partial(_logits_reference, m, batch, mode))
            groups += [_layouts_group(m, batch, mode, recipe, backends, reference) for recipe in recipes]
    if "train" in modes and "labels" in steps:
        reference = cache(partial(_labels_reference, m, batch))
        groups += [_labels_group(m, batch, backends, recipe, reference) for recipe in recipes]
    if "eval" in modes:
        groups.append(_generate_group(m, batch, backends))
    config = {"model": m.describe(), "peer": f"{m.peer_label}, padded to the longest", "tokens/s": "real tokens only",
              "lengths": batch.lengths, "real tokens": batch.real}
    padded, packed = m.flops(batch.lengths, max(batch.lengths), True), m.flops(batch.lengths, None, True)
    if padded is not None:  # what packing can gain by skipping work alone
        config["FLOP-ratio bound (train, padded to longest ÷ packed)"] = round(padded / packed, 3)
    return Suite(f"{entry.spec.family}_varlen", groups, config=config, device=device)


# -- the models and the batch ----------------------------------------------------------------
class _Models:
    """The original holding the weights drawn from the seed (equivalence.weights; dropout off), its users' version, and fastzoo from its weights."""

    def __init__(self, entry, w: Workload, device: torch.device, seed: int):
        spec, bench = entry.spec, entry.spec.bench
        self.entry, self.spec, self.bench, self.device, self.workload = entry, spec, bench, device, w
        self.values = {**entry.config, **bench.deterministic, **w.config}
        self.cfg = spec.config_class.from_dict(self.values)
        torch.manual_seed(seed)
        self.original = draw_(spec.original.build(self.values), seed=seed).eval()
        self.peer_label = self.label("padded to longest")
        self.names = {n for n, _ in fastzoo.create(entry.name, attn="eager", pretrained=self.original).named_parameters()}

    def label(self, what: str) -> str:
        """How tables name the original doing ``what``: "HF padded to longest (sdpa)"."""
        return f"{self.bench.library} {what}" + (f" ({self.bench.peer_attention})" if self.bench.peer_attention else "")

    def describe(self) -> str:
        w = self.workload
        changed = ", ".join(f"{k}={v}" for k, v in w.config.items())
        lengths = (f"uniform in [1, {w.max_len}]" if w.median_len is None
                   else f"log-normal (median {w.median_len}) in [16, {w.max_len}]")
        return f"{self.entry.name}{' with ' + changed if changed else ''}; {w.batch} sequences, lengths {lengths}"

    def users_original(self, recipe: Recipe):
        m = copy.deepcopy(self.original)
        return prepare(self.spec.as_users_run_it(m), recipe, self.device)

    def fastzoo(self, attn: str, recipe: Recipe):
        model = fastzoo.create(self.entry.name, attn="eager", pretrained=self.original)
        model.set_attention(attn, device=self.device, dtype=recipe.dtype)
        return prepare(model, recipe, self.device)

    def flops(self, lengths: list[int], width: int | None, train: bool, block: bool = False) -> float | None:
        """FLOPs of a step on ``lengths`` padded to ``width`` (None: packed, no padding);
        ``block``: packed in one row attended as a whole ``[T, T]`` block, masked (HF's attention
        on flattened rows): the work of one sequence of T tokens."""
        if block:
            lengths, width = [sum(lengths)], sum(lengths)
        return self.spec.task.flops(self.spec, self.cfg, lengths=lengths, width=width, train=train)


@dataclass
class _Layout:
    args: tuple
    kwargs: dict
    view: object  # model output -> the real tokens' logits [T_real, V], sequence after sequence
    width: int | None  # padded to this length; None: no padding
    block: bool = False  # one row attended as a whole [T, T] block (FLOPs), masked per sequence


@dataclass
class _Batch:
    seqs: list[torch.Tensor]
    lengths: list[int]
    real: int
    targets: torch.Tensor
    padded: dict  # "longest" / "max" -> (ids [B, S], mask [B, S]) on the CPU
    layouts: dict  # "longest" / "max" / "packed" / "nested" / "flattened" -> _Layout on the device
    packed: object
    flattened: dict  # DataCollatorWithFlattening's batch (input_ids, position_ids, labels) on the device

    @classmethod
    def draw(cls, m: _Models, w: Workload, device, seed: int) -> "_Batch":
        from fastzoo.data import nested, pack

        g = torch.Generator().manual_seed(seed)
        lengths = _lengths(w, g)
        seqs = [torch.randint(0, m.cfg.vocab_size, (n,), generator=g) for n in lengths]
        padded = {"longest": _pad(seqs, max(lengths)), "max": _pad(seqs, w.max_len)}
        packed = pack(seqs).to(device)
        layouts = {name: _Layout((ids.to(device),), {"attention_mask": mask.to(device)}, _padded_view(mask.to(device)),
                                 ids.shape[1]) for name, (ids, mask) in padded.items()}
        layouts["packed"] = _Layout((packed.input_ids,), dict(position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens,
                                                               max_seqlen=packed.max_seqlen), lambda out: _logits(out)[0], None)
        layouts["nested"] = _Layout((nested(seqs).to(device),), {}, _nested_view, None)
        from transformers import DataCollatorWithFlattening

        flat = {k: v.to(device) for k, v in DataCollatorWithFlattening(return_tensors="pt")(
            [{"input_ids": x.tolist()} for x in seqs]).items()}
        layouts["flattened"] = _Layout((flat["input_ids"],), dict(position_ids=flat["position_ids"], use_cache=False),
                                       lambda out: _logits(out)[0], None, block=True)
        return cls(seqs, lengths, sum(lengths), torch.cat(seqs).to(device), padded, layouts, packed, flat)


def _lengths(w: Workload, g: torch.Generator) -> list[int]:
    """Uniform in [1, max_len]; with ``median_len``, log-normal (sigma 0.8) around it, clipped to
    [16, max_len]: the shape of instruction-tuning data, where padding to the longest wastes most
    of a batch."""
    if w.median_len is None:
        return torch.randint(1, w.max_len + 1, (w.batch,), generator=g).tolist()
    z = torch.randn(w.batch, generator=g)
    return [int(min(max(16, round(w.median_len * math.exp(0.8 * float(x)))), w.max_len)) for x in z]


def _pad(seqs: list[torch.Tensor], width: int):
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return ids, mask


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _padded_view(mask_BS):
    return lambda out: _logits(out)[mask_BS.bool()]


def _nested_view(out):
    out = _logits(out)
    return torch.cat(out.unbind()) if out.is_nested else out.reshape(-1, out.shape[-1])


# -- the logits step: every layout, every backend ------------------------------------------
def _step(m: _Models, batch: _Batch, model, mode: str, layout: str, recipe: Recipe, *, original: bool = False,
          gate: bool = True) -> Step:
    """One step of ``model`` on ``layout``: cross-entropy on the real tokens' logits.
    ``original``: gradients under fastzoo's names; ``gate=False``: not parity-checked."""
    if layout == "loop":
        model, lay = _Loop(model, [x.to(m.device) for x in batch.seqs]), _Layout((), {}, lambda out: out, None)
    else:
        lay = batch.layouts[layout]
    call = _Call(model, (lambda *a: model(*a, **lay.kwargs)) if lay.kwargs else model)
    step = model_step(call, lay.args, mode=mode, loss=lambda out: F.cross_entropy(lay.view(out).float(), batch.targets),
                      items=batch.real, compile=recipe.compiled, view=lay.view)
    step.flops = m.flops(batch.lengths, lay.width, mode == "train", lay.block)
    return compared_as(step, spec=m.spec, names=m.names, original=original, gate=gate)


def _fastzoo_cases(m: _Models, batch: _Batch, mode: str, recipe: Recipe, backends) -> list[Case]:
    """Each backend in each layout it takes: nested (its own input), padded to the longest (and to
    the maximum for sdpa), packed."""
    c, cases = recipe.compiled, []
    baseline = recipe == BASELINE

    def case(label, backend, layout, **kw):
        return Case(label, lambda: _step(m, batch, m.fastzoo(backend, recipe), mode, layout, recipe), compiled=c, **kw)

    for b in backends:
        caps = fastzoo.attention.backend_class(b).capabilities
        if b == "nested":
            cases.append(case("fastzoo nested", b, "nested"))
            continue
        if caps.padding_mask:
            cases.append(case(f"fastzoo padded to longest ({b})", b, "longest", reference=b == "eager" and baseline))
        if caps.padding_mask and b == "sdpa" and baseline:
            cases.append(case(f"fastzoo padded to max ({b})", b, "max"))
        if caps.varlen:
            cases.append(case(f"fastzoo packed ({b})", b, "packed"))
    return cases


def _original_cases(m: _Models, batch: _Batch, mode: str, recipe: Recipe) -> list[Case]:
    """The peer (the original as its users run it), the original under the recipe, and in the
    baseline the original padded to the maximum and one sequence at a time."""
    c = recipe.compiled

    def original(layout):
        return lambda: _step(m, batch, m.users_original(recipe), mode, layout, recipe, original=True)

    flattened = Case(m.label(FLATTENED), original("flattened"), compiled=c)
    if recipe != BASELINE:
        return [Case(m.peer_label + ", fp32 eager", lambda: _step(m, batch, m.users_original(BASELINE), mode, "longest",
                                                                   BASELINE, gate=False), peer=True, dtype=torch.float32),
                Case(m.peer_label, original("longest"), reference=True, original=True, compiled=c), flattened]
    return [Case(m.peer_label, original("longest"), peer=True, original=True, compiled=c), flattened,
            Case(m.label("padded to max"), original("max"), compiled=c),
            Case(f"{m.bench.library} loop, one sequence at a time", original("loop"), compiled=c)]


def _logits_reference(m: _Models, batch: _Batch, mode: str) -> dict:
    """fastzoo eager in fp32, padded to the longest: sequence by sequence, the function of every case."""
    return _step(m, batch, m.fastzoo("eager", BASELINE), mode, "longest", BASELINE).outputs()


def _layouts_group(m: _Models, batch: _Batch, mode: str, recipe: Recipe, backends, reference) -> Group:
    cases = _original_cases(m, batch, mode, recipe) + _fastzoo_cases(m, batch, mode, recipe, backends)
    return Group(f"{m.workload.name} | {mode} | {recipe.name}", cases, reference=reference, unit="tokens/s",
                 dtype=recipe.dtype)


# -- the training step as users write it: labels= ---------------------------------------------
def _labels_inputs(m: _Models, batch: _Batch) -> tuple[tuple, tuple, tuple]:
    """(args, kwargs) with ``labels``: the batch padded to the longest (HF's convention: padding
    not scored), packed, and flattened by HF's collator (its labels: -100 at each sequence start)."""
    from fastzoo.losses import IGNORE_INDEX

    ids, mask = (t.to(m.device) for t in batch.padded["longest"])
    padded = ((ids,), {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)})
    p = batch.packed
    packed = ((p.input_ids,), dict(position_ids=p.position_ids, cu_seqlens=p.cu_seqlens, max_seqlen=p.max_seqlen,
                                   labels=p.labels))
    f = batch.flattened
    flattened = ((f["input_ids"],), dict(position_ids=f["position_ids"], labels=f["labels"], use_cache=False))
    return padded, packed, flattened


def _labels_reference(m: _Models, batch: _Batch) -> dict:
    """fp32 logits materialised, the original's loss on them: the function both sides compute."""
    from fastzoo.losses import causal_lm_loss

    (ids,), kwargs = _labels_inputs(m, batch)[0]
    model = m.fastzoo("eager", BASELINE).train()
    loss = causal_lm_loss(_logits(model(ids, attention_mask=kwargs["attention_mask"])).float(), kwargs["labels"])
    loss.backward()
    return {"output": loss.detach().reshape(1),
            **{f"grad:{n}": q.grad.detach().float().clone() for n, q in model.named_parameters() if q.grad is not None}}


def _labels_group(m: _Models, batch: _Batch, backends, recipe: Recipe, reference) -> Group:
    """``model(..., labels=...).loss.backward()`` under ``recipe``: the original computes the
    logits and ``cross_entropy`` on them; fastzoo in train mode computes the loss from the hidden
    states with the fused ``linear_cross_entropy`` (no ``[tokens, vocabulary]`` logits). Outside
    fp32 the original as its users run it (fp32) is the peer, the original under the recipe the
    precision's reference."""
    padded, packed, flattened = _labels_inputs(m, batch)
    width = padded[0][0].shape[1]

    def loss_step(model, inputs, original=False, gate=True):
        args, kwargs = inputs
        step = model_step(_Call(model, lambda *a: model(*a, **kwargs)), args, mode="train", loss=lambda out: out.loss,
                          items=batch.real, view=lambda out: out.loss.reshape(1).float())
        block = inputs is flattened
        step.flops = m.flops(batch.lengths, None if "cu_seqlens" in kwargs or block else width, True, block)
        return compared_as(step, spec=m.spec, names=m.names, original=original, gate=gate)

    baseline = recipe == BASELINE
    if baseline:
        cases = [Case(f"{m.peer_label}, labels", lambda: loss_step(m.users_original(BASELINE), padded, True), peer=True)]
    else:
        cases = [Case(f"{m.peer_label}, labels, fp32 eager", lambda: loss_step(m.users_original(BASELINE), padded, gate=False),
                      peer=True, dtype=torch.float32),
                 Case(f"{m.peer_label}, labels", lambda: loss_step(m.users_original(recipe), padded, True), reference=True,
                      original=True)]
    cases.append(Case(m.label(FLATTENED) + ", labels", lambda: loss_step(m.users_original(recipe), flattened, True)))
    for b in backends:
        caps = fastzoo.attention.backend_class(b).capabilities
        if caps.padding_mask and b in ("eager", "sdpa"):
            cases.append(Case(f"fastzoo padded to longest ({b}), labels: fused loss",
                              lambda b=b: loss_step(m.fastzoo(b, recipe), padded), reference=baseline and b == "eager"))
        if caps.varlen:
            cases.append(Case(f"fastzoo packed ({b}), labels: fused loss", lambda b=b: loss_step(m.fastzoo(b, recipe), packed)))
    return Group(f"{m.workload.name} | train with labels | {recipe.name}", cases, reference=reference, unit="tokens/s",
                 cpu_memory=True, dtype=recipe.dtype)


# -- generate with the KV cache ----------------------------------------------------------------
def _generate_group(m: _Models, batch: _Batch, backends) -> Group:
    """``generate`` with the KV cache, greedy, on the batch's sequences as left-padded prompts
    (each cut to at most 64 tokens): the original's ``generate`` against fastzoo's (transformers'
    GenerationMixin driving fastzoo's forward and cache). Throughput counts new tokens; parity
    is the generated ids, which must be equal token for token."""
    from fastzoo.data import pad_to_longest

    prompts = pad_to_longest([x[-64:] for x in batch.seqs], side="left")
    ids, mask = prompts.input_ids.to(m.device), prompts.attention_mask.to(m.device)
    kw = dict(attention_mask=mask, max_new_tokens=GENERATE_NEW_TOKENS, min_new_tokens=GENERATE_NEW_TOKENS,
              do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=m.cfg.vocab_size - 1)

    def step(model):
        model.eval()
        out = {}

        def run():
            with torch.no_grad():
                out["ids"] = model.generate(ids, **kw)
            return out["ids"]

        return Step(run, GENERATE_NEW_TOKENS * ids.shape[0],
                    outputs=lambda: {"output": (out["ids"] if "ids" in out else run()).float()})

    cases = [Case(m.label("generate, KV cache"), lambda: step(m.users_original(BASELINE)), peer=True)]
    for b in backends:
        if fastzoo.attention.backend_class(b).capabilities.kv_cache:
            cases.append(Case(f"fastzoo generate, KV cache ({b})", lambda b=b: step(m.fastzoo(b, BASELINE)),
                              reference=b == "eager"))
    return Group(f"{m.workload.name} | generate {GENERATE_NEW_TOKENS} tokens, greedy, left-padded prompts", cases,
                 reference=lambda: step(m.users_original(BASELINE)).outputs(), unit="new tokens/s")


class _Call(torch.nn.Module):
    """A model with its keyword inputs bound, so the step calls it with positional inputs only
    (and ``torch.compile`` compiles the model, keywords included). Parameter names stay the model's."""

    def __init__(self, model, fwd):
        super().__init__()
        self.model = model
        self._fwd = fwd

    def forward(self, *args):
        return self._fwd(*args)

    def named_parameters(self, *a, **k):
        return self.model.named_parameters(*a, **k)


class _Loop(torch.nn.Module):
    """The original run on each sequence alone (no padding at all, no batching); returns the
    logits of every token, sequence after sequence."""

    def __init__(self, model, seqs):
        super().__init__()
        self.inner = model
        self.seqs = seqs

    def forward(self):
        return torch.cat([_logits(self.inner(x[None]))[0] for x in self.seqs])

    def named_parameters(self, *a, **k):
        return self.inner.named_parameters(*a, **k)


def use_code(entry, label: str) -> str | None:
    """The code a user writes for the fastzoo case ``label`` (None: another case)."""
    import re

    create = 'fastzoo.create("{name}", attn="{b}")'.format
    if label == "fastzoo nested":
        return create(name=entry.name, b="nested") + " on fastzoo.data.nested(seqs)"
    found = re.fullmatch(r"fastzoo (packed|padded to longest) \((\w+)\)(, labels: fused loss)?", label)
    if found is None:
        return None
    layout, backend, labels = found.groups()
    data = "pack" if layout == "packed" else "pad_to_longest"
    return create(name=entry.name, b=backend) + f" on fastzoo.data.{data}(seqs)" + (", labels=: the fused loss" if labels else "")


def model_suite(entry, workload: Workload, *, backends, mode, device, recipes) -> Suite:
    """``fastzoo bench NAME`` for a causal LM (its task's ``bench``)."""
    return causal_lm_suite(entry, workload, backends=backends, modes=(mode,), recipes=recipes, device=device)


def tour_entry(spec, size, device, compile):
    """The tour's entry for a causal LM (its task's ``tour``): the step as users write it
    (``labels=``) per recipe, the original (as its users run it, under the recipe, and on HF's own
    packing) against
    fastzoo's paths (padded, packed, nested, per training backend)."""
    from fastzoo.bench.recipes import recipes
    from fastzoo.bench.tour import Entry, recipe_groups, train_backends
    from fastzoo.registry import get_entry

    entry, tried = get_entry(spec.bench.variant), recipes(spec.bench, device, compile=compile)
    suite = causal_lm_suite(entry, spec.bench.sizes[size], backends=train_backends(device), modes=("train",),
                            recipes=tried, steps=("labels",), device=device)
    groups = recipe_groups(suite, tried)
    paths = {c.label: use_code(entry, c.label) for g in suite.groups for c in g.cases if use_code(entry, c.label)}
    kept = lambda c: c.peer or c.original or c.label in paths or FLATTENED in c.label  # noqa: E731  (HF's packing too)
    suite = replace(suite, groups=[replace(g, cases=[c for c in g.cases if kept(c)]) for g in suite.groups if g.name in groups])
    return Entry(entry.name, suite.groups[0].cases[0].label, suite, paths, groups, device.type)


def flattened_vs_packed(rows) -> list[dict]:
    """Per group of a run: fastzoo packed against the original on HF's packing (the collator's
    flattened rows), and the bound that remains between them: HF attends the packed row as one
    masked ``[T, T]`` block, fastzoo each sequence alone, so the FLOP ratio (block ÷ per
    sequence) is what doing less attention work alone gives; ``vs bound`` = speed-up ÷ bound."""
    out = []
    for group in dict.fromkeys(r.group for r in rows):
        in_group = [r for r in rows if r.group == group and r.median_s is not None]
        flat = next((r for r in in_group if FLATTENED in r.label), None)
        if flat is None:
            continue
        for r in in_group:
            if r.label.startswith("fastzoo packed"):
                speedup = flat.median_s / r.median_s
                bound = (flat.flop_rate * flat.median_s) / (r.flop_rate * r.median_s) if r.flop_rate and flat.flop_rate else None
                out.append({"group": group, "fastzoo": r.label, "peer": flat.label, "speed-up": round(speedup, 3),
                            "FLOP-ratio bound": None if bound is None else round(bound, 3),
                            "vs bound": None if bound is None else round(speedup / bound, 3)})
    return out
