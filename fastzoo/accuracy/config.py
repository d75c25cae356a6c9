"""The accuracy-parity run file (``configs/accuracy_*.yaml``): its schema (:class:`RunConfig`,
its arms, data, optimiser and tolerance sections), read and checked once, every error naming
the field."""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field

from fastzoo.errors import ConfigError, UnknownModelError
from fastzoo.losses.set_prediction import GIOU_IMPLS
from fastzoo.registry import get_entry
from fastzoo.tasks import TASKS
from fastzoo.text import dtype_name, parse_dtype, read_yaml, set_dotted
from fastzoo.train.schedule import DECAYS

LAYOUTS = ("padded", "packed", "nested")

@dataclass
class Arm:
    name: str  # shown in the table and the chart
    original: bool = False  # the original library's model (timm / torchvision / Hugging Face)
    attn: str | None = None  # fastzoo attention backend
    layout: str | None = None  # a decoder's input: padded | packed | nested
    giou_impl: str | None = None  # DETR's set loss: how its GIoU term runs (GIOU_IMPLS)
    model_kwargs: dict = field(default_factory=dict)  # extra fastzoo.create overrides for this arm
    # A rounding control: this arm's initial weights times (1 + nudge * random sign), e.g. 1e-7 (about
    # one fp32 ulp). It shows how far two runs drift from a rounding-size difference alone; reported,
    # never judged against the tolerance.
    nudge: float = 0.0
    # Train and evaluate under autocast to this dtype ("bf16"; weights and optimiser stay fp32). The
    # first arm of a precision runs the first arm's model in it: the precision's peer (see _compare).
    amp: str | None = None
    # transformers' form of the model: with original, transformers' own class (ViTForImageClassification)
    # on the original's weights; else fastzoo's model built from that transformers model (no name) and
    # trained through transformers' call (pixel_values=, .logits)
    hf: bool = False


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
class Pretrain:
    """The backbone trained first on the run's training digits (single digits on ``img_size`` canvases,
    classified), as a user starts from ImageNet weights; every arm starts from it
    (:mod:`fastzoo.accuracy.pretrain`)."""
    steps: int
    lr: float
    batch_size: int = 128
    img_size: int = 32
    n_images: int = 4000  # single-digit canvases drawn from the training digits


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
    pretrain: Pretrain | None = None  # a detector's backbone trained here first (task digits_canvas)


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
    nested = {"data": Data, "optim": Optim, "tolerance": Tolerance, "pretrain": Pretrain}
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
    if cfg.pretrain is not None:
        p = cfg.pretrain
        if min(p.steps, p.batch_size, p.img_size, p.n_images) < 1 or p.lr <= 0:
            raise ConfigError(f"{where}.pretrain: steps, batch_size, img_size, n_images and lr must be positive, got {p}")
        if cfg.task != "digits_canvas":
            raise ConfigError(f"{where}.pretrain: a backbone is pretrained for task digits_canvas (a detector), not {cfg.task!r}")
    for a in cfg.arms:
        if not 0 <= a.nudge < 1e-2:
            raise ConfigError(f"{where}: arm {a.name!r}: nudge must be in [0, 0.01) (a rounding-size perturbation), got {a.nudge}")
        if a.layout is not None and a.layout not in LAYOUTS:
            raise ConfigError(f"{where}: arm {a.name!r}: layout {a.layout!r} is not one of {', '.join(LAYOUTS)}")
        if a.giou_impl is not None and a.giou_impl not in GIOU_IMPLS:
            raise ConfigError(f"{where}: arm {a.name!r}: giou_impl {a.giou_impl!r} is not one of {', '.join(GIOU_IMPLS)}")
        if a.amp is not None:
            try:
                parse_dtype(a.amp, what="amp")
            except ValueError as e:
                raise ConfigError(f"{where}: arm {a.name!r}: {e}") from None
    first = cfg.arms[0]
    if precision(first) != "fp32":
        raise ConfigError(f"{where}: the first arm ({first.name!r}) is the fp32 reference: it takes no amp")
    for amp, peer in peers(cfg.arms).items():
        if _kind(peer) != _kind(first):
            raise ConfigError(f"{where}: arm {peer.name!r}, the first in {amp}, is that precision's peer: it must run "
                              f"the first arm's model ({first.name!r}) and differ from it only in amp")
    return cfg


def precision(arm: Arm) -> str:
    return "fp32" if arm.amp is None else dtype_name(parse_dtype(arm.amp))


def _kind(arm: Arm) -> tuple:
    return arm.original, arm.attn, arm.layout, arm.giou_impl, arm.model_kwargs, arm.nudge, arm.hf


def peers(arms) -> dict:
    """Low precision -> its peer, the first arm in that precision (the first arm's model run in it).
    Its difference from the first arm is what the precision alone costs; another arm in that
    precision may differ from the first arm by LOW_FACTOR times as much (fastzoo.equivalence)."""
    out = {}
    for a in arms:
        if precision(a) != "fp32":
            out.setdefault(precision(a), a)
    return out


def load_config(path, assignments=()) -> RunConfig:
    """Read a run file; ``assignments`` (``FIELD=VALUE``, dotted into sections) override its fields."""
    raw = set_dotted(read_yaml(path), assignments)
    return _check(_build(RunConfig, raw, str(path)), str(path))


def model_config(cfg: RunConfig) -> dict:
    """``cfg.model``'s config fields with the run's ``overrides``."""
    return {**get_entry(cfg.model).config, **cfg.overrides}
