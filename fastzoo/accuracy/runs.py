"""Accuracy parity on real data: does a fast kernel change what a model learns?

One run file (``configs/accuracy_*.yaml``) names a model, its size (``overrides``), the data
(:mod:`fastzoo.accuracy.data`: digits, digits on a canvas, Python's help text), the optimiser,
the number of steps and the tolerance, and the *arms*: the original library's model (timm,
torchvision, Hugging Face) and fastzoo with each attention backend, input layout or GIoU
mode. Every arm starts from the same weights (the original's, loaded into fastzoo), sees the
same batches in the same order, and trains in fp32 with the same optimiser. Recorded per
arm: the training loss at every step, the held-out loss and metric (accuracy, or mAP@0.5
with torchmetrics) every ``eval_every`` steps.

Two comparisons with the first arm. *Free-running curves*: max absolute difference of each
curve over the run. *Same weights*: at step 0 and every ``eval_every`` steps the first arm's
parameters are copied into every arm, which computes the loss and the gradients of the next
batch; the largest loss difference and the worst parameter's gradient difference (max |diff|
over max |grad|) are recorded. A kernel that computes a different function fails the
same-weights check; one that rounds differently passes it, but its free-running curves can
still separate, because training amplifies a one-ulp difference step after step (the
detector's fused GIoU backward, see the README). Status: ``ok`` (both within tolerance),
``drifts`` (same weights within tolerance, free-running curves not; the step where they first
leave it is recorded), ``disagrees`` (the same-weights check fails, or, where a tolerance for
it is not set, the curves do). The arms agree when none disagrees.

    python benchmarks/accuracy_parity.py --config configs/accuracy_digits_vit.yaml
    python benchmarks/accuracy_parity.py --config configs/accuracy_digits_vit.yaml --steps 20 --set optim.lr=3e-4

Writes ``<name>.json`` and ``<name>.png`` to ``benchmarks/results/<device>/accuracy/`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from fastzoo.equivalence import LOW_FACTOR, compare_errors, curve_error, grad_error
from fastzoo.errors import BackendUnavailableError, ConfigError, FastzooError, UnknownModelError
from fastzoo.losses.boxes import GIOU_LAYOUTS
from fastzoo.losses.lm import IGNORE_INDEX, next_token_targets
from fastzoo.machine import device_name, load_average, versions
from fastzoo.registry import get_entry
from fastzoo.tasks import TASKS, resolve
from fastzoo.text import dtype_name, parse_dtype, read_yaml, set_dotted
from fastzoo.train.schedule import DECAYS, warmup_schedule

LAYOUTS = ("padded", "packed", "nested")


# -- the run file -------------------------------------------------------------------------------
@dataclass
class Arm:
    name: str  # shown in the table and the chart
    original: bool = False  # the original library's model (timm / torchvision / Hugging Face)
    attn: str | None = None  # fastzoo attention backend
    layout: str | None = None  # a decoder's input: padded | packed | nested
    loss: str | None = None  # box detector GIoU mode: per_sample | concat | padded | kernel
    model_kwargs: dict = field(default_factory=dict)  # extra fastzoo.create overrides for this arm
    # A rounding control: this arm's initial weights times (1 + nudge * random sign), e.g. 1e-7 (about
    # one fp32 ulp). It shows how far two runs drift from a rounding-size difference alone; reported,
    # never judged against the tolerance.
    nudge: float = 0.0
    # Train and evaluate under autocast to this dtype ("bf16"; weights and optimiser stay fp32). The
    # first arm of a precision runs the first arm's model in it: the precision's peer (see _compare).
    amp: str | None = None


@dataclass
class Data:
    img_size: int = 32  # digits: upsampled side; canvas: the canvas side
    test_fraction: float = 0.2  # digits held out (canvases: test canvases use only held-out digits)
    n_train: int = 0  # canvases (digits_canvas)
    n_test: int = 0
    max_digits: int = 3
    digit_px: tuple = (14, 24)
    vocab_size: int = 1024  # pydoc_text: BPE vocabulary trained here
    max_len: int = 128  # tokens per document piece
    val_fraction: float = 0.1


@dataclass
class Optim:
    batch_size: int
    lr: float
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    schedule: str = "constant"  # constant | cosine (lr from `lr` down to 0 at the last step, after warmup)
    warmup_steps: int = 0  # linear warm-up from 0 to `lr`


@dataclass
class Tolerance:
    train_loss: float  # max |loss(step) - first arm's loss(step)| over every step
    eval_loss: float  # the same over the held-out loss curve
    eval_metric: float  # held-out accuracy / mAP: max difference, as a fraction
    metric_goal: float | None = None  # e.g. 0.95: the final held-out accuracy each arm should reach (reported)
    same_weights_loss: float | None = None  # max |loss - first arm's loss| from the first arm's parameters
    same_weights_grad: float | None = None  # max over parameters of max|grad - first arm's grad| / max|first arm's grad|


@dataclass
class RunConfig:
    name: str
    task: str
    model: str
    overrides: dict
    arms: list
    data: Data
    optim: Optim
    steps: int
    eval_every: int
    tolerance: Tolerance
    seed: int = 0
    description: str = ""


def _build(cls, raw, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown field {key!r}{hint}; fields: {', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing field {missing[0]!r}")
    kwargs = {}
    nested = {"data": Data, "optim": Optim, "tolerance": Tolerance}
    for key, value in raw.items():
        if key in nested and cls is RunConfig:
            value = _build(nested[key], value, f"{where}.{key}")
        elif key == "arms" and cls is RunConfig:
            if not isinstance(value, list) or not value:
                raise ConfigError(f"{where}.arms: expected a non-empty list of arms")
            value = [_build(Arm, a, f"{where}.arms[{i}]") for i, a in enumerate(value)]
        else:
            value = _typed(fields[key], value, f"{where}.{key}")
        kwargs[key] = value
    return cls(**kwargs)


def _typed(f: dataclasses.Field, value, where: str):
    t = str(f.type)
    if value is None and "None" in t:
        return None
    want = [(bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (dict, "dict"), (tuple, "tuple")]
    for typ, name in want:
        if t.startswith(name):
            if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if typ is tuple and isinstance(value, list):
                return tuple(value)
            if typ is int and isinstance(value, bool) or not isinstance(value, typ):
                raise ConfigError(f"{where}: expected {name}, got {value!r}")
            return value
    return value


def _check(cfg: RunConfig, where: str) -> RunConfig:
    trains = {data: task for task in TASKS for data in task.parity}  # the run file's task: the data, and the task it trains
    if cfg.task not in trains:
        raise ConfigError(f"{where}.task: {cfg.task!r} is not one of {', '.join(trains)}")
    try:
        kind = get_entry(cfg.model).spec.task
    except UnknownModelError as e:
        raise ConfigError(f"{where}.model: {e.args[0]}") from None
    if kind is not trains[cfg.task]:
        raise ConfigError(f"{where}.model: {cfg.model} is {kind}; task {cfg.task!r} trains {trains[cfg.task]} models")
    if cfg.steps < 1 or cfg.eval_every < 1:
        raise ConfigError(f"{where}: steps and eval_every must be >= 1")
    if cfg.optim.schedule not in DECAYS:
        raise ConfigError(f"{where}.optim.schedule: {cfg.optim.schedule!r} is not one of {', '.join(DECAYS)}")
    if not 0 <= cfg.optim.warmup_steps < cfg.steps:
        raise ConfigError(f"{where}.optim.warmup_steps: must be >= 0 and below steps ({cfg.steps}), got {cfg.optim.warmup_steps}")
    for a in cfg.arms:
        if not 0 <= a.nudge < 1e-2:
            raise ConfigError(f"{where}: arm {a.name!r}: nudge must be in [0, 0.01) (a rounding-size perturbation), got {a.nudge}")
        if a.layout is not None and a.layout not in LAYOUTS:
            raise ConfigError(f"{where}: arm {a.name!r}: layout {a.layout!r} is not one of {', '.join(LAYOUTS)}")
        if a.loss is not None and a.loss not in GIOU_LAYOUTS:
            raise ConfigError(f"{where}: arm {a.name!r}: loss {a.loss!r} is not one of {', '.join(GIOU_LAYOUTS)}")
        if a.amp is not None:
            try:
                parse_dtype(a.amp, what="amp")
            except ValueError as e:
                raise ConfigError(f"{where}: arm {a.name!r}: {e}") from None
    first = cfg.arms[0]
    if _precision(first) != "fp32":
        raise ConfigError(f"{where}: the first arm ({first.name!r}) is the fp32 reference: it takes no amp")
    for amp, peer in _peers(cfg.arms).items():
        if _kind(peer) != _kind(first):
            raise ConfigError(f"{where}: arm {peer.name!r}, the first in {amp}, is that precision's peer: it must run "
                              f"the first arm's model ({first.name!r}) and differ from it only in amp")
    return cfg


def _precision(arm: Arm) -> str:
    return "fp32" if arm.amp is None else dtype_name(parse_dtype(arm.amp))


def _kind(arm: Arm) -> tuple:
    return arm.original, arm.attn, arm.layout, arm.loss, arm.model_kwargs, arm.nudge


def _peers(arms) -> dict:
    """Low precision -> its peer, the first arm in that precision (the first arm's model run in it).
    Its difference from the first arm is what the precision alone costs; another arm in that
    precision may differ from the first arm by LOW_FACTOR times as much (fastzoo.equivalence)."""
    peers = {}
    for a in arms:
        if _precision(a) != "fp32":
            peers.setdefault(_precision(a), a)
    return peers


def load_config(path, assignments=()) -> RunConfig:
    """Read a run file; ``assignments`` (``FIELD=VALUE``, dotted into sections) override its fields."""
    raw = set_dotted(read_yaml(path), assignments)
    return _check(_build(RunConfig, raw, str(path)), str(path))


# -- results ------------------------------------------------------------------------------------
@dataclass
class ArmResult:
    name: str
    # ok | drifts | disagrees | unavailable | control (a rounding control) | peer (the first arm in a low
    # precision) | unjudged (low precision without its peer); control and peer are reported, not judged
    status: str = "ok"
    note: str = ""
    train_loss: list = field(default_factory=list)
    eval_steps: list = field(default_factory=list)
    eval_loss: list = field(default_factory=list)
    eval_metric: list = field(default_factory=list)
    diff: dict = field(default_factory=dict)  # vs the first arm: max abs difference of each curve
    bound: dict = field(default_factory=dict)  # what each diff was judged against (the tolerance; low precision: the rule)
    first_over: int | None = None  # first step whose training loss is off the first arm's by more than the tolerance
    same_weights: dict = field(default_factory=dict)  # {"steps", "loss", "loss_diff", "grad_err"}: from the first arm's parameters
    seconds: float = 0.0

    @property
    def final_metric(self):
        return self.eval_metric[-1] if self.eval_metric else None


@dataclass
class AccuracyReport:
    config: dict
    metric: str
    device: str
    versions: dict
    arms: list
    threads: int = 1
    load: list = field(default_factory=list)  # 1-minute load average at the start and the end of the run

    @property
    def agree(self) -> bool:
        return all(a.status != "disagrees" for a in self.arms) and sum(a.status in ("ok", "drifts") for a in self.arms) >= 2

    def table(self) -> str:
        tol = self.config["tolerance"]
        goal = tol.get("metric_goal")
        lines = [f"| arm | status | final train loss | final held-out loss | held-out {self.metric} | "
                 f"max train-loss diff | max held-out loss diff | max {self.metric} diff | same weights: max loss / grad diff | time |",
                 "|---|" + "---|" * 9]
        for a in self.arms:
            if a.status == "unavailable":
                lines.append(f"| {a.name} | unavailable: {a.note} | - | - | - | - | - | - | - | - |")
                continue
            m = a.final_metric
            met = "" if goal is None or m is None else (" (goal met)" if m >= goal else f" (below the {100 * goal:.0f}% goal)")
            d = {key: _d(a, key, tol) for key in ("train_loss", "eval_loss", "eval_metric", "same_weights_loss", "same_weights_grad")}
            lines.append(f"| {a.name} | {a.status} | {a.train_loss[-1]:.4f} | {a.eval_loss[-1]:.4f} | "
                         f"{100 * m:.1f}%{met} | {d['train_loss']} | {d['eval_loss']} | {d['eval_metric']} | "
                         f"{d['same_weights_loss']} / {d['same_weights_grad']} | {a.seconds:.0f} s |")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        c, tol = self.config, self.config["tolerance"]
        sw = ("" if tol.get("same_weights_loss") is None and tol.get("same_weights_grad") is None else
              f"; from the first arm's weights (step 0 and every {c['eval_every']} steps): loss "
              f"{tol.get('same_weights_loss')}, gradients {tol.get('same_weights_grad')} (worst parameter, relative)")
        notes = "".join(f"\n- {a.name}: {a.status}: {a.note}" for a in self.arms if a.note)
        low = "" if not _peers([Arm(**a) for a in c["arms"]]) else (
            f" An arm under autocast (amp) is held to {LOW_FACTOR:g}x the difference of its precision's peer (the first "
            f"arm's model in that precision) from the fp32 first arm, plus the fp32 tolerance (fastzoo.equivalence's rule).")
        return (f"### {c['name']}: {c['description']}\n\n"
                f"Device **{self.device}**, {self.threads} thread(s), load {' -> '.join(f'{x:.1f}' for x in self.load)}; "
                f"{c['steps']} steps, batch {c['optim']['batch_size']}, "
                f"AdamW lr {c['optim']['lr']}{_schedule(c['optim'])}, seed {c['seed']}; every arm from the same weights and batches. "
                f"Tolerance vs the first arm (max over the run): train loss {tol['train_loss']}, held-out loss "
                f"{tol['eval_loss']}, held-out {self.metric} {tol['eval_metric']}{sw}.{low} "
                f"Agree: **{'yes' if self.agree else 'no'}**.\n\n{self.table()}\n{notes}\n")

    def to_dict(self) -> dict:
        return {"config": self.config, "metric": self.metric, "device": self.device, "threads": self.threads,
                "load": self.load, "versions": self.versions, "agree": self.agree,
                "arms": [dataclasses.asdict(a) for a in self.arms]}

    def plot(self, path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(14, 3.8))
        ok = [a for a in self.arms if a.train_loss]
        for i, a in enumerate(ok):
            style = dict(lw=1.2, alpha=0.85, ls=["-", "--", ":", "-."][i % 4])
            ax0.plot(range(1, len(a.train_loss) + 1), a.train_loss, label=a.name, **style)
            ax1.plot(a.eval_steps, [100 * m for m in a.eval_metric], marker="o", ms=3, label=a.name, **style)
            if i:
                ref = ok[0].train_loss
                diff = [abs(x - y) for x, y in zip(a.train_loss, ref)]
                ax2.semilogy(range(1, len(diff) + 1), [max(d, 1e-9) for d in diff], label=f"{a.name} vs {ok[0].name}", lw=1)
        ax2.axhline(self.config["tolerance"]["train_loss"], color="red", lw=1, ls="--", label="tolerance")
        ax0.set(xlabel="step", ylabel="training loss", yscale="log", title="training loss")
        ax1.set(xlabel="step", ylabel=f"held-out {self.metric} (%)", title=f"held-out {self.metric}")
        ax2.set(xlabel="step", ylabel="|loss - first arm's loss|", title="difference of the training curves")
        for ax in (ax0, ax1, ax2):
            ax.legend(fontsize=7)
        fig.suptitle(f"{self.config['name']} on {self.device}: same init, same batches, every arm", fontsize=10)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _schedule(o: dict) -> str:
    warm = f", {o['warmup_steps']} warm-up steps" if o.get("warmup_steps") else ""
    return (" cosine-decayed to 0" if o.get("schedule") == "cosine" else "") + warm


def _d(arm: ArmResult, key: str, tol: dict) -> str:
    """A diff cell; with its bound where that is not the file's tolerance (an arm in low precision)."""
    if key not in arm.diff:
        return "-"
    bound = arm.bound.get(key)
    return f"{arm.diff[key]:.1e}" + ("" if bound is None or bound == tol.get(key) else f" (<= {bound:.1e})")


# -- arms: build, train, evaluate -----------------------------------------------------------------
def _original(cfg: RunConfig):
    """The original library's model of ``cfg.model``, built from its config and ``cfg.overrides``, as
    its users run it (the family's spec); None for a family without one (the box detector: its arms
    differ in the loss)."""
    return get_entry(cfg.model).spec.original_as_users_run_it(_model_config(cfg))


def _model_config(cfg: RunConfig) -> dict:
    """``cfg.model``'s config fields with the run's ``overrides``."""
    return {**get_entry(cfg.model).config, **cfg.overrides}


def _models(cfg: RunConfig, device):
    """One model per arm, all with the same initial weights; an arm that cannot run here is
    returned as the error's message instead of a model."""
    import fastzoo

    torch.manual_seed(cfg.seed)
    original = _original(cfg)
    init = None if original is not None else fastzoo.create(cfg.model, **cfg.overrides)
    out = []
    for arm in cfg.arms:
        try:
            if arm.original:
                if original is None:
                    raise ConfigError(f"arm {arm.name!r}: {cfg.model} has no original library model")
                m = copy.deepcopy(original)
            elif original is not None:
                m = _fastzoo(cfg, arm, copy.deepcopy(original), device)
            else:
                m = fastzoo.create(cfg.model, **{**cfg.overrides, **({"loss": arm.loss} if arm.loss else {}), **arm.model_kwargs})
                m.load_state_dict(init.state_dict())
            if arm.nudge:
                _nudge(m, arm.nudge, cfg.seed)
            out.append(m.to(device))
        except BackendUnavailableError as e:
            out.append(str(e).split(". Available on this machine")[0])
    return out


def _fastzoo(cfg: RunConfig, arm: Arm, original, device):
    """fastzoo's model of this arm on the original's weights. Its attention backend is checked
    for the dtype it computes in (the arm's autocast dtype: a bf16-only kernel serves a bf16 arm)."""
    import fastzoo

    m = fastzoo.create(cfg.model, attn="eager", pretrained=original, **arm.model_kwargs)
    amp = _precision(arm)
    return m.set_attention(arm.attn or "sdpa", device=device, dtype=None if amp == "fp32" else parse_dtype(amp))


@torch.no_grad()
def _nudge(model, rel: float, seed: int) -> None:
    """Multiply every float parameter by 1 +- ``rel`` (random signs, seeded): a rounding-size change."""
    g = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        if p.is_floating_point():
            sign = torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 - 1
            p.mul_(1 + rel * sign)


def _optimizer(model, o: Optim):
    return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))


def _scheduler(opt, o: Optim, steps: int):
    """The scripts' schedule (:mod:`fastzoo.train.schedule`): warm-up, then ``o.schedule``."""
    return warmup_schedule(opt, warmup_steps=o.warmup_steps, total_steps=steps, decay=o.schedule)


def _batches(n: int, batch_size: int, steps: int, seed: int):
    """The same index batches for every arm: epochs of a seeded permutation."""
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n, generator=g) for _ in range(math.ceil(steps * batch_size / n) + 1)])
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(steps)]


class Task:
    metric = "accuracy"

    def loss(self, arm: Arm, model, idx) -> torch.Tensor: ...

    def evaluate(self, arm: Arm, model) -> tuple[float, float]: ...


class DigitsTask(Task):
    """Classification of the upsampled digits: cross-entropy, held-out accuracy."""

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import digits

        self.train, self.test = digits(cfg.data.img_size, test_fraction=cfg.data.test_fraction, seed=cfg.seed)
        self.n, self.device = len(self.train.y), device

    def loss(self, arm, model, idx):
        return F.cross_entropy(model(self.train.x[idx].to(self.device)).float(), self.train.y[idx].to(self.device))

    @torch.no_grad()
    def evaluate(self, arm, model):
        logits = torch.cat([model(x.to(self.device)).float().cpu() for x in self.test.x.split(256)])
        return F.cross_entropy(logits, self.test.y).item(), (logits.argmax(-1) == self.test.y).float().mean().item()


class QuadrantTask(DigitsTask):
    """Which quadrant of a noisy image is brighter (synthetic, ``data.n_train`` / ``n_test`` images)."""

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import quadrants

        g = torch.Generator().manual_seed(cfg.seed)
        self.train, self.test = quadrants(cfg.data.n_train, g, cfg.data.img_size), quadrants(cfg.data.n_test, g, cfg.data.img_size)
        self.n, self.device = cfg.data.n_train, device


class TextTask(Task):
    """Next-token prediction on Python's help text; held-out metric: next-token accuracy."""

    metric = "next-token accuracy"

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import bpe_tokenizer, pydoc_documents

        docs = pydoc_documents()
        tok = bpe_tokenizer(docs, cfg.data.vocab_size)
        if len(tok) > _model_config(cfg)["vocab_size"]:
            raise ConfigError(f"overrides.vocab_size must be >= the tokenizer's {len(tok)} ids")
        seqs = []
        for d in docs:
            ids = torch.tensor(tok.encode(d) + [tok.eos_token_id])
            seqs += [p for p in ids.split(cfg.data.max_len) if len(p) > 1]
        perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        n_val = int(len(seqs) * cfg.data.val_fraction)
        self.val = [seqs[i] for i in perm[:n_val]]
        self.train = [seqs[i] for i in perm[n_val:]]
        self.n, self.device, self.tokens = len(self.train), device, sum(map(len, seqs))
        self.vocab = len(tok)

    def _forward(self, arm, model, seqs):
        """(mean next-token loss, #correct, #targets) of one batch in the arm's layout."""
        from fastzoo.data import nested, pack, pad_to_longest
        from fastzoo.losses import causal_lm_loss

        layout = arm.layout or "padded"
        if arm.original or layout == "padded":
            b = pad_to_longest(seqs).to(self.device)
            if arm.original:  # Hugging Face's own call and loss, as its users write it
                out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
                return out.loss, out.logits, b.labels
            logits = _logits(model(**b.model_inputs()))
            return causal_lm_loss(logits, b.labels), logits, b.labels
        if layout == "packed":
            b = pack(seqs).to(self.device)
            logits = _logits(model(**b.model_inputs()))
            return causal_lm_loss(logits, b.labels, cu_seqlens=b.cu_seqlens), logits, b.labels
        ids = nested(seqs).to(self.device)
        logits = _logits(model(ids))
        labels = ids.clone()
        return causal_lm_loss(logits, labels), torch.cat(logits.unbind())[None], _first_ignored(seqs).to(self.device)

    def loss(self, arm, model, idx):
        return self._forward(arm, model, [self.train[i] for i in idx.tolist()])[0]

    @torch.no_grad()
    def evaluate(self, arm, model):
        total = correct = count = 0.0
        for i in range(0, len(self.val), 32):
            loss, logits, labels = self._forward(arm, model, self.val[i:i + 32])
            target = next_token_targets(labels)
            keep = target != IGNORE_INDEX
            n = keep.sum().item()
            total += loss.item() * n
            correct += ((logits.argmax(-1) == target) & keep).sum().item()
            count += n
        return total / count, correct / count


def _first_ignored(seqs):
    """Packed labels of ``seqs`` (IGNORE_INDEX on each sequence's first token): the nested arm's targets."""
    from fastzoo.data import pack

    return pack(seqs).labels


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


class CanvasTask(Task):
    """Digits on a canvas: DETR loss (the arm's GIoU mode); held-out mAP@0.5 (torchmetrics)."""

    metric = "mAP@0.5"

    def __init__(self, cfg: RunConfig, device):
        from fastzoo.accuracy.data import digits_canvas

        d = cfg.data
        self.train, self.test = digits_canvas(d.n_train, d.n_test, canvas=d.img_size, max_digits=d.max_digits,
                                              digit_px=tuple(d.digit_px), test_fraction=d.test_fraction, seed=cfg.seed)
        self.n, self.device = len(self.train.boxes), device

    def _loss(self, model, images, boxes, labels):
        out = model(images.to(self.device))
        return model.loss(out, [b.to(self.device) for b in boxes], labels=[c.to(self.device) for c in labels]), out

    def loss(self, arm, model, idx):
        idx = idx.tolist()
        return self._loss(model, self.train.images[idx], [self.train.boxes[i] for i in idx],
                          [self.train.labels[i] for i in idx])[0]

    @torch.no_grad()
    def evaluate(self, arm, model):
        from torchmetrics.detection import MeanAveragePrecision

        mean_ap = MeanAveragePrecision(iou_thresholds=[0.5], box_format="xyxy")
        total, n = 0.0, 0
        for i in range(0, len(self.test.boxes), 64):
            sl = slice(i, i + 64)
            loss, out = self._loss(model, self.test.images[sl], self.test.boxes[sl], self.test.labels[sl])
            total += loss.item() * len(self.test.boxes[sl])
            n += len(self.test.boxes[sl])
            probs = out["logits"].float().softmax(-1)[..., :-1].cpu()  # the last class is "no object"
            scores, classes = probs.max(-1)
            preds = [{"boxes": b.float().cpu(), "scores": s, "labels": c} for b, s, c in zip(out["boxes"], scores, classes)]
            target = [{"boxes": b, "labels": c} for b, c in zip(self.test.boxes[sl], self.test.labels[sl])]
            mean_ap.update(preds, target)
        return total / n, float(mean_ap.compute()["map_50"])


def run(cfg: RunConfig, *, device="cpu", progress: bool = True) -> AccuracyReport:
    from tqdm.auto import tqdm

    device = torch.device(device)
    load = [load_average()]
    task = resolve(get_entry(cfg.model).spec.task.parity[cfg.task])(cfg, device)
    batches = _batches(task.n, cfg.optim.batch_size, cfg.steps, cfg.seed)
    models = _models(cfg, device)
    results, snapshots = [], None
    with tqdm(total=len(cfg.arms) * cfg.steps, desc=cfg.name, disable=not progress, leave=False, dynamic_ncols=True) as bar:
        for arm, model in zip(cfg.arms, models):
            bar.set_postfix_str(arm.name)
            r = ArmResult(arm.name)
            results.append(r)
            if isinstance(model, str):
                r.status, r.note = "unavailable", model
                bar.update(cfg.steps)
                continue
            t0 = time.perf_counter()
            first = snapshots is None  # the first arm that runs keeps its parameters for the same-weights check
            snapshots = [] if first else snapshots
            try:
                _train(cfg, task, arm, model, batches, r, bar, snapshots if first else None)
            except BackendUnavailableError as e:  # e.g. no backward for this kernel on this device
                r.status, r.note = "unavailable", str(e).split(". Available on this machine")[0]
                r.train_loss, r.eval_steps, r.eval_loss, r.eval_metric = [], [], [], []
                snapshots = None if first else snapshots
            r.seconds = time.perf_counter() - t0
    _same_weights(cfg, task, batches, models, results, snapshots or [])
    _compare(cfg, results)
    return AccuracyReport(_as_dict(cfg), task.metric, device_name(device), versions(), results,
                          threads=torch.get_num_threads(), load=load + [load_average()])


def _train(cfg, task, arm, model, batches, r: ArmResult, bar, snapshots: list | None = None):
    """Train ``model`` on ``batches``; with a ``snapshots`` list (the first arm), append (step
    index, a copy of the model) before step 1 and every ``eval_every`` steps."""
    opt = _optimizer(model, cfg.optim)
    sched = _scheduler(opt, cfg.optim, len(batches))
    for step, idx in enumerate(batches, 1):
        if snapshots is not None and (step - 1) % cfg.eval_every == 0:
            snapshots.append((step - 1, copy.deepcopy(model)))
        model.train()
        with _autocast(arm, task.device):
            loss = task.loss(arm, model, idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        r.train_loss.append(loss.item())
        if step % cfg.eval_every == 0 or step == len(batches):
            model.eval()
            with _autocast(arm, task.device):
                el, em = task.evaluate(arm, model)
            r.eval_steps.append(step)
            r.eval_loss.append(el)
            r.eval_metric.append(em)
        bar.update(1)


def _autocast(arm: Arm, device):
    """The arm's autocast (``amp``), or a no-op context in fp32."""
    amp = _precision(arm)
    return torch.autocast(torch.device(device).type, dtype=parse_dtype(amp), enabled=amp != "fp32")


def _load_weights(cfg: RunConfig, arm: Arm, ref_arm: Arm, snapshot, trained):
    """A copy of this arm's model holding the first arm's parameters ``snapshot`` (a model of the
    first arm's kind), built the way the arm was built at step 0; None if it cannot be."""
    if arm.original:
        return copy.deepcopy(snapshot) if ref_arm.original else None
    if ref_arm.original:  # the original library's model -> fastzoo, the same conversion as at step 0
        device = next(trained.parameters()).device
        return _fastzoo(cfg, arm, copy.deepcopy(snapshot), device).to(device)
    m = copy.deepcopy(trained)
    m.load_state_dict(snapshot.state_dict())
    return m


def _loss_and_grads(task, arm, model, idx):
    model.train()
    model.zero_grad(set_to_none=True)
    with _autocast(arm, task.device):
        loss = task.loss(arm, model, idx)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_weights(cfg, task, batches, models, results, snapshots) -> None:
    """At each snapshot of the first arm (step k), every arm's loss and gradients on batch k + 1
    from those parameters, against the first arm's own."""
    ran = [(a, m, r) for a, m, r in zip(cfg.arms, models, results) if r.status == "ok" and not isinstance(m, str)]
    if len(ran) < 2 or not snapshots:
        return
    (ref_arm, ref_model, _), others = ran[0], ran[1:]
    for step, snap in snapshots:
        idx = batches[step]
        ref_loss, ref_grads = _loss_and_grads(task, ref_arm, _load_weights(cfg, ref_arm, ref_arm, snap, ref_model), idx)
        for arm, model, r in others:
            m = _load_weights(cfg, arm, ref_arm, snap, model)
            if m is None:
                continue
            loss, grads = _loss_and_grads(task, arm, m, idx)
            ref_as_arm = _as_arm(cfg, arm, ref_arm, snap, ref_grads, model)  # the original's layout -> this arm's
            sw = r.same_weights
            for key in ("steps", "loss", "loss_diff", "grad_err"):
                sw.setdefault(key, [])
            sw["steps"].append(step)
            sw["loss"].append(loss)
            sw["loss_diff"].append(abs(loss - ref_loss))
            sw["grad_err"].append(grad_error({n: grads.get(n, torch.zeros_like(g)) for n, g in ref_as_arm.items()},
                                             ref_as_arm))


def _as_arm(cfg, arm, ref_arm, snapshot, ref_grads: dict, trained) -> dict:
    """The first arm's gradients in this arm's parameter layout: put into a copy of the first
    arm's model as its parameters and converted exactly as its weights are (e.g. Hugging Face
    GPT-2's ``Conv1D`` [in, out] -> fastzoo's ``Linear`` [out, in])."""
    g = copy.deepcopy(snapshot)
    with torch.no_grad():
        for n, p in g.named_parameters():
            p.copy_(ref_grads[n] if n in ref_grads else torch.zeros_like(p))
    return {n: p.detach() for n, p in _load_weights(cfg, arm, ref_arm, g, trained).named_parameters()}


def _compare(cfg: RunConfig, results: list[ArmResult]) -> None:
    """Each arm against the first, by fastzoo.equivalence's rule: an fp32 arm within the file's
    tolerance; an arm in low precision within LOW_FACTOR times its precision's peer's difference
    plus that tolerance. The peers and rounding controls are reported, not judged."""
    ran = [(a, r) for a, r in zip(cfg.arms, results) if r.status == "ok"]
    if not ran:
        return
    ref, tol = ran[0][1], cfg.tolerance
    peers = {amp: a.name for amp, a in _peers(cfg.arms).items()}
    by_name = {r.name: r for _, r in ran}
    for arm, r in ran[1:]:
        r.diff = {key: curve_error(getattr(r, key), getattr(ref, key)) for key in ("train_loss", "eval_loss", "eval_metric")}
        if r.same_weights:
            r.diff["same_weights_loss"] = max(r.same_weights["loss_diff"])
            r.diff["same_weights_grad"] = max(r.same_weights["grad_err"])
        amp = _precision(arm)
        if arm.nudge:
            r.status, r.note = "control", f"initial weights x (1 +- {arm.nudge:g}): the drift rounding alone causes"
        elif amp != "fp32" and peers[amp] == arm.name:
            r.status = "peer"
            r.note = (f"{ran[0][0].name} in {amp}: what {amp} alone changes; the other {amp} arms may differ "
                      f"{LOW_FACTOR:g}x as much, plus the fp32 tolerance")
        elif amp != "fp32" and by_name.get(peers[amp], ArmResult("")).status != "peer":
            r.status, r.note = "unjudged", f"no {amp} peer ran: nothing to bound its {amp} difference by"
        else:
            _judge(r, tol, by_name[peers[amp]] if amp != "fp32" else None)
        r.first_over = next((i for i, (a, b) in enumerate(zip(r.train_loss, ref.train_loss), 1)
                             if not abs(a - b) <= r.bound.get("train_loss", tol.train_loss)), None)
        if r.status == "drifts":
            r.note += f" (first at step {r.first_over})"


def _judge(r: ArmResult, tol: Tolerance, peer: ArmResult | None) -> None:
    """``ok``, ``drifts`` or ``disagrees`` (module docstring) from the arm's differences and bounds."""
    comps = {key: compare_errors(key, err, limit, None if peer is None else peer.diff.get(key))
             for key, err in r.diff.items() if (limit := getattr(tol, key)) is not None}
    r.bound = {key: c.bound for key, c in comps.items()}
    over = {k: f"{k} {c.err:.2g} > {c.bound:.2g}" for k, c in comps.items() if not c.passed}
    curves = [v for k, v in over.items() if not k.startswith("same_weights")]
    same = [v for k, v in over.items() if k.startswith("same_weights")]
    if same or (curves and not any(k.startswith("same_weights") for k in comps)):
        r.status, r.note = "disagrees", "; ".join(same + curves)
    elif curves:
        r.status = "drifts"
        r.note = (f"same weights: loss within {r.diff['same_weights_loss']:.1e}, grads within "
                  f"{r.diff['same_weights_grad']:.1e}; free-running: {'; '.join(curves)}")
    elif peer is not None:
        r.note = f"within {LOW_FACTOR:g}x {peer.name}'s difference from the fp32 reference, plus the fp32 tolerance"


def _as_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def results_dir(device) -> Path:
    return Path("benchmarks") / "results" / device_name(torch.device(device)) / "accuracy"


# -- the results README's table -------------------------------------------------------------------
SUMMARY_BEGIN = "<!-- accuracy: generated from accuracy/*.json by benchmarks/accuracy_parity.py -->"
SUMMARY_END = "<!-- /accuracy -->"


def summary_table(folder) -> str:
    """One row per committed run (``<folder>/*.json``): steps, threads and load, each arm's status
    and final held-out metric, whether the arms agree. The results README shows it."""
    from fastzoo.text import markdown_table

    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        r = json.loads(path.read_text())
        c, arms = r["config"], r["arms"]
        metric = lambda a: "-" if not a["eval_metric"] else f"{100 * a['eval_metric'][-1]:.2f}%"  # noqa: E731
        rows.append({
            "run": f"[{c['description']}]({Path(folder).name}/{path.stem}.md)",
            "steps": c["steps"],
            "threads, load": (f"{r['threads']}, {' -> '.join(f'{x:.1f}' for x in r['load'])}" if "load" in r
                              else "1, not recorded"),
            "arm: status": "; ".join(f"{a['name']}: {a['status']}" for a in arms),
            "final held-out metric": "; ".join(f"{a['name']} {metric(a)}" for a in arms if a["status"] != "unavailable"),
            "agree": "yes" if r["agree"] else "**no**",
        })
    return markdown_table(rows)


def update_summary(readme, folder) -> bool:
    """Rewrite the table between :data:`SUMMARY_BEGIN` and :data:`SUMMARY_END` in ``readme`` from
    ``folder``'s runs; False (nothing written) where the README has no such block."""
    from fastzoo import files

    readme = Path(readme)
    text = readme.read_text() if readme.exists() else ""
    if SUMMARY_BEGIN not in text or SUMMARY_END not in text:
        return False
    head, rest = text.split(SUMMARY_BEGIN, 1)
    files.write_text(readme, f"{head}{SUMMARY_BEGIN}\n{summary_table(folder)}\n{SUMMARY_END}{rest.split(SUMMARY_END, 1)[1]}")
    return True


# -- command line ---------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="accuracy_parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="a run file, configs/accuracy_*.yaml")
    p.add_argument("--steps", type=int, help="override the file's steps")
    p.add_argument("--eval-every", type=int, help="override the file's eval_every")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any field, dotted into sections: optim.lr=3e-4, data.n_train=200, tolerance.train_loss=1e-3")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: on a shared CPU, spinning threads make a small model 10x slower)")
    p.add_argument("--out", type=Path, help="folder for <name>.json and <name>.png (default benchmarks/results/<device>/accuracy)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    prog = "accuracy_parity"
    torch.set_num_threads(args.threads)
    assignments = list(args.assignments)
    assignments += [f"steps={args.steps}"] if args.steps is not None else []
    assignments += [f"eval_every={args.eval_every}"] if args.eval_every is not None else []
    try:
        cfg = load_config(args.config, assignments)
        report = run(cfg, device=args.device, progress=not args.no_progress)
    except FastzooError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = args.out or results_dir(args.device)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{cfg.name}.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    (out / f"{cfg.name}.md").write_text(report.to_markdown())
    report.plot(out / f"{cfg.name}.png")
    print(report.to_markdown())
    print(f"wrote {out / cfg.name}.json, .md and .png" + (", and the table in ../README.md" if update_summary(out.parent / "README.md", out) else ""))
    return 0 if report.agree else 1
