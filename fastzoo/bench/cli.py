"""``fastzoo bench MODEL``: parity-gated timing of every requested attention backend vs the peer.

Examples::

    fastzoo bench vit_b16 --attn all --quick
    fastzoo bench vit_b16 --attn sdpa,flex --mode train --device cuda --dtype bf16 --compile --json out.json --plot out.png
    fastzoo bench gpt2 --attn all --quick          # padded vs nested vs packed, real tokens/s
    fastzoo bench giou                              # GIoU loss implementations vs torchvision
    fastzoo bench linear_ce                         # the LM head's loss: fused vs logits vs torch's chunked op
    fastzoo bench matcher                           # the detector's Hungarian matcher, before / after
    fastzoo bench vit_s16 --parity-train --plot curves.png
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings

import torch

from fastzoo.errors import UsageError
from fastzoo.text import DTYPES, non_negative_int, parse_key_values, positive_int


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("model", help="a model name from `fastzoo list` (vit_*, gpt2*, resnet50), or a loss suite: giou, linear_ce, matcher")
    p.add_argument("--attn", default="all", help="`all` (every backend available here) or NAME[,NAME...]; eager is always added")
    p.add_argument("--mode", choices=("eval", "train"), default="eval", help="eval: forward; train: forward+backward")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile every case")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--batch-size", type=positive_int, help="images per step (ViT, ResNet) or sequences (GPT-2)")
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


LOSS_SUITES = ("giou", "linear_ce", "matcher")  # `fastzoo bench NAME` for the loss suites


def _family(model: str) -> str:
    if model in LOSS_SUITES:
        return model
    from fastzoo.registry import get_entry

    return get_entry(model).model_class.family


def build_suite(args, device: torch.device, dtype: torch.dtype):
    family = _family(args.model)
    overrides = parse_key_values(args.overrides, what="--set")
    modes, compile_modes = (args.mode,), (args.compile,)
    if family == "vit":
        from fastzoo.bench.vit import setting_from_model, vit_suite

        setting = _replace(setting_from_model(args.model), overrides)
        return vit_suite([setting], backends=_backends(args.attn), modes=modes, compile_modes=compile_modes,
                         batch_size=args.batch_size or (2 if args.quick else 8), device=device, dtype=dtype, masks=False)
    if family == "gpt2":
        from fastzoo.bench.gpt2 import TARGET_SETTING, gpt2_suite

        setting = _replace(TARGET_SETTING, {**({"num_seqs": args.batch_size} if args.batch_size else {}), **overrides})
        return gpt2_suite(setting, backends=_backends(args.attn), modes=modes, compile_modes=compile_modes,
                          device=device, dtype=dtype)
    if family == "resnet":
        import inspect

        from fastzoo.bench.resnet import resnet_suite

        free = {n: p.default for n, p in inspect.signature(resnet_suite).parameters.items() if n in ("img_size", "seed")}
        unknown = sorted(set(overrides) - set(free))
        if unknown:
            raise UsageError(f"--set {unknown[0]}: the ResNet suite takes --set {' / '.join(free)} only")
        for key, value in overrides.items():
            _check_like(key, value, free[key])
        return resnet_suite(modes=modes, compile_modes=compile_modes, bf16=(dtype == torch.bfloat16,),
                            batch_size=args.batch_size or (2 if args.quick else 8), device=device, **overrides)
    if family == "giou":
        from fastzoo.bench.giou import TARGET_SETTING, giou_suite

        setting = _replace(TARGET_SETTING, {**({"images": args.batch_size} if args.batch_size else {}), **overrides})
        return giou_suite(setting, device=device, dtype=dtype)
    if family == "linear_ce":
        from fastzoo.bench.linear_ce import TARGET_SETTING, linear_ce_suite

        setting = _replace(TARGET_SETTING, {**({"tokens": args.batch_size} if args.batch_size else {}), **overrides})
        return linear_ce_suite(setting, device=device, dtype=dtype)
    if family == "matcher":
        from fastzoo.bench.matcher import TARGET_SETTING, matcher_suite

        setting = _replace(TARGET_SETTING, {**({"images": args.batch_size} if args.batch_size else {}), **overrides})
        return matcher_suite(setting, device=device)
    raise ValueError(f"model {args.model!r} (family {family!r}) has no benchmark suite yet")


def cmd_bench(args) -> int:
    from fastzoo.registry import check_device

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_device(device, what="--device")
    dtype = DTYPES.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The table says when flex runs uncompiled; PyTorch's multi-line warning would bury the progress bar.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    if args.parity_train:
        return _parity_train(args, device, dtype)
    from fastzoo.bench.harness import run_suite

    suite = build_suite(args, device, dtype)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    iters = args.iters if args.iters is not None else (3 if args.quick else 10)
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


def _parity_train(args, device, dtype) -> int:
    from fastzoo import files
    from fastzoo.accuracy.backends import train_parity

    if _family(args.model) != "vit":
        raise UsageError(f"--parity-train is implemented for the ViT family; {args.model!r} is not a ViT")
    steps = args.steps or (100 if args.quick else 300)
    report = train_parity(_backends(args.attn), steps=steps, device=device, dtype=dtype, progress=not args.no_progress)
    print(report.to_markdown())
    if args.json:
        files.write_json(args.json, report.to_dict())
    if args.plot:
        report.plot(args.plot)
    return 0 if report.agree else 1
