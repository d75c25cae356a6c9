"""``fastzoo bench MODEL``: parity-gated timing of every requested attention backend vs the peer.

Examples (NAME: a model from `fastzoo list`; its family's spec says which suite and recipes)::

    fastzoo bench NAME --attn all --quick           # every attention backend vs the original, fp32
    fastzoo bench NAME --mode train --dtype all     # every precision worth trying here (and memory format)
    fastzoo bench NAME --attn sdpa,flex --mode train --device cuda --dtype bf16 --compile --json out.json --plot out.png
    fastzoo bench giou                              # GIoU loss implementations vs torchvision
    fastzoo bench linear_ce                         # the LM head's loss: fused vs logits vs torch's chunked op
    fastzoo bench matcher                           # the detector's Hungarian matcher, before / after
    fastzoo bench NAME --parity-train --plot curves.png   # a small model of the family fine-tuned per backend
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings

import torch

from fastzoo.errors import UsageError
from fastzoo.text import DTYPES, dtype_name, non_negative_int, parse_key_values, positive_int


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("model", help="a model name from `fastzoo list` (image classifiers, causal LMs), or a loss suite: "
                   + ", ".join(part_suites()))
    p.add_argument("--attn", default="all", help="`all` (every backend available here) or NAME[,NAME...]; eager is always added")
    p.add_argument("--mode", choices=("eval", "train"), default="eval", help="eval: forward; train: forward+backward")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile every case")
    p.add_argument("--dtype", choices=("auto", "all", *DTYPES), default="auto",
                   help="auto: fp32 on CPU, bf16 on CUDA; all: every precision worth trying here (bf16 autocast on a "
                        "CPU with AVX512-BF16 or AMX); bf16 on a CPU runs under autocast")
    p.add_argument("--batch-size", type=positive_int, help="images or sequences per step")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="batch 2, 1 warm-up + 3 timed runs: minutes on a 2-core CPU")
    p.add_argument("--warmup", type=non_negative_int, help="untimed steps first (default 3; quick 1)")
    p.add_argument("--iters", type=positive_int, help="timed steps; the median is reported (default 10; quick 3)")
    p.add_argument("--threads", type=positive_int, help="torch.set_num_threads (on a shared CPU, 1 avoids thread thrashing)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change the model config (original field names: depth, embed_dim, img_size... / n_layer, n_embd...)")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--plot", help="write a PNG bar chart (with --parity-train: the loss curves)")
    p.add_argument("--markdown", help="write the results as a markdown section")
    p.add_argument("--parity-train", action="store_true",
                   help="fine-tune a small model of this family with every backend from one initialisation; compare accuracy")
    p.add_argument("--steps", type=positive_int, help="--parity-train steps (default 300; quick 100)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _replace(setting, overrides: dict):
    names = {f.name for f in dataclasses.fields(setting)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise UsageError(f"--set {unknown[0]}: not a field of this suite's config; fields: {', '.join(sorted(names - {'name'}))}")
    for key, value in overrides.items():
        _check_like(key, value, getattr(setting, key))
    return dataclasses.replace(setting, **overrides) if overrides else setting


def _check_like(key: str, value, current) -> None:
    """``--set key=value`` must have the kind of the value it replaces (a number for a number,
    positive sizes), else a UsageError naming it, not a TypeError deep in the suite."""
    if current is None or isinstance(current, bool):
        ok = current is None or isinstance(value, bool)
    elif isinstance(current, (int, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (isinstance(current, float) or
                                                                                  isinstance(value, int))
        if ok and isinstance(current, int) and current > 0 and value <= 0:
            raise UsageError(f"--set {key}={value!r}: must be positive")
    elif isinstance(current, (tuple, list)):
        ok = isinstance(value, (tuple, list)) and all(type(v) is type(c) for v, c in zip(value, current))
    else:
        ok = isinstance(value, type(current))
    if not ok:
        raise UsageError(f"--set {key}={value!r}: {key} takes a value like {current!r} ({type(current).__name__})")


def _backends(spec: str) -> list[str]:
    from fastzoo.attention import backend_class, list_attention

    if spec == "all":
        return list_attention(available_only=True)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError("--attn: name at least one backend, or `all`")
    for n in names:
        backend_class(n)  # an unknown name fails here, with a suggestion
    # eager is the reference: its own error in a low precision sets every other backend's tolerance
    return names if "eager" in names else ["eager", *names]


def part_suites() -> dict[str, str]:
    """``fastzoo bench NAME`` for a loss or a part of a task's training step: name -> the suite's
    module, from the declarations (each loss's ``bench``, each task's ``suites``)."""
    from fastzoo.losses import losses
    from fastzoo.tasks import TASKS

    return {**{loss.name: loss.bench for loss in losses() if loss.bench},
            **{name: module for task in TASKS for name, module in task.suites.items()}}


def build_suite(args, device: torch.device, dtype: torch.dtype | None):
    """The suite for ``args.model``: a loss suite by name, else the suite of the model's task."""
    overrides = parse_key_values(args.overrides, what="--set")
    if args.model in part_suites():
        return _part_suite(part_suites()[args.model], args, device, dtype or torch.float32, overrides)
    from fastzoo.registry import get_entry
    from fastzoo.tasks import TASKS, resolve

    entry = get_entry(args.model)
    task = entry.spec.task
    if entry.spec.bench is None or task.bench is None:
        raise UsageError(f"model {args.model!r} ({task}) has no benchmark suite; suites: "
                         f"{', '.join(t.name for t in TASKS if t.bench)} models, and {', '.join(part_suites())}")
    workload = _workload(entry, args, overrides)
    return resolve(task.bench)(entry, workload, backends=_backends(args.attn), mode=args.mode, device=device,
                               recipes=_recipes(entry, args, device, dtype))


def _recipes(entry, args, device, dtype):
    """--dtype all: every precision worth trying here; else the one asked (auto: fp32 on CPU, bf16
    on CUDA; bf16 on a CPU is autocast). Memory formats the family's spec names; --compile: compiled."""
    from fastzoo.bench.recipes import recipes

    if args.dtype == "all":
        precisions = None
    else:
        low = dtype not in (None, torch.float32)
        precisions = (("bf16 autocast" if device.type == "cpu" else dtype_name(dtype)) if low else "fp32",)
    found = recipes(entry.spec.bench, device, precisions=precisions, compile=args.compile)
    return [r for r in found if r.compiled == args.compile]


def _workload(entry, args, overrides: dict):
    """The family's ``bench`` workload, changed by --set (config fields in the original's names, or
    the workload's img_size / max_len), --batch-size and --quick (the task's quick batch)."""
    from fastzoo.errors import ConfigError

    w = entry.spec.bench.sizes["bench"]
    cls = entry.spec.config_class
    current = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    current.update({**entry.config, **w.config})
    sizes = {k: getattr(w, k) for k in ("img_size", "max_len") if getattr(w, k) is not None}
    unknown = sorted(set(overrides) - set(current) - set(sizes))
    if unknown:
        raise UsageError(f"--set {unknown[0]}: not a field of this suite's config; fields: {', '.join(sorted({*current, *sizes}))}")
    for key, value in overrides.items():
        _check_like(key, value, sizes[key] if key in sizes else current[key])
    config = {**w.config, **{k: v for k, v in overrides.items() if k not in sizes}}
    try:
        cls.from_dict({**entry.config, **config})
    except ConfigError as e:
        raise UsageError(f"--set: {e}") from e
    batch = args.batch_size or (args.quick and entry.spec.task.bench_quick_batch) or w.batch
    return dataclasses.replace(w, name=w.name or args.model, config=config, batch=batch,
                               **{k: v for k, v in overrides.items() if k in sizes})


def _part_suite(module_name: str, args, device, dtype, overrides):
    """A loss's (or a task part's) suite on its module's ``TARGET_SETTING``, changed by --batch-size and --set."""
    import importlib

    module = importlib.import_module(module_name)
    batch = {module.BATCH_FIELD: args.batch_size} if args.batch_size else {}
    return module.cli_suite(_replace(module.TARGET_SETTING, {**batch, **overrides}), device=device, dtype=dtype)


def cmd_bench(args) -> int:
    from fastzoo.registry import check_device

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_device(device, what="--device")
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" and args.dtype == "auto" else None)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The table says when flex runs uncompiled; PyTorch's multi-line warning would bury the progress bar.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    if args.parity_train:
        return _parity_train(args, device, dtype)
    from fastzoo.bench.harness import run_suite
    from fastzoo.bench import limits

    suite = build_suite(args, device, dtype)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    iters = args.iters if args.iters is not None else (3 if args.quick else 10)
    if args.model not in part_suites():  # a model step beside the GEMM peak of each precision it ran in (a loss suite measures its own)
        suite.limits = limits.measure(device, dtypes=_precisions(suite), quick=args.quick)
    report = run_suite(suite, warmup=warmup, iters=iters, progress=not args.no_progress)
    print(report.to_markdown(f"fastzoo bench {args.model}"))
    if args.json:
        report.write_json(args.json)
    if args.markdown:
        from fastzoo import files

        files.write_text(args.markdown, report.to_markdown(f"fastzoo bench {args.model}"))
    if args.plot and not report.skipped:
        report.plot(args.plot)
    return 0 if report.ok else 1


def _precisions(suite) -> list[torch.dtype]:
    """The precisions a suite's groups run in: the GEMM peaks to measure beside them."""
    return tuple(dict.fromkeys([suite.dtype, *(g.dtype for g in suite.groups if g.dtype is not None)]))


def _parity_train(args, device, dtype) -> int:
    from fastzoo import files
    from fastzoo.accuracy.backends import MODEL, train_parity
    from fastzoo.registry import get_entry

    if get_entry(args.model).spec is not get_entry(MODEL).spec:
        raise UsageError(f"--parity-train fine-tunes {MODEL}'s family; {args.model!r} is of another")
    steps = args.steps or (100 if args.quick else 300)
    report = train_parity(_backends(args.attn), steps=steps, device=device, dtype=dtype, progress=not args.no_progress)
    print(report.to_markdown())
    if args.json:
        files.write_json(args.json, report.to_dict())
    if args.plot:
        report.plot(args.plot)
    return 0 if report.agree else 1
