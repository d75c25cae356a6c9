"""Command line: ``fastzoo tour | list | bench | check | convert``."""
from __future__ import annotations

import sys

from fastzoo.errors import FastzooError
from fastzoo.text import (
    DTYPES,
    USER_ERRORS,
    ArgumentParser,
    error_line,
    markdown_table,
    parse_dtype,
    parse_key_values,
    positive_int,
    show_traceback,
)


def cmd_list(args) -> int:
    import fastzoo
    from fastzoo.attention import MATRIX_COLUMNS, capability_matrix
    from fastzoo.registry import get_entry

    if args.markdown:  # the README's block: declarations only, not this machine's state
        print(markdown_table(capability_matrix(), [c for c in MATRIX_COLUMNS if c != "available here"]))
        return 0
    if args.families:  # the README's model table
        print(markdown_table(family_rows(), ["family", "task", "names", "examples", "refused"]))
        return 0
    if args.model and any(c in args.model for c in "*?["):  # a wildcard: the names it matches
        for name in fastzoo.list_models(args.model):
            print(f"{name:<40} {get_entry(name).description}")
        return 0
    if args.model:  # what its config says about itself
        from fastzoo.models.config import KINDS

        entry = get_entry(args.model)
        cls = entry.model_class.config_class
        values = cls.from_dict(dict(entry.config), what="field in the YAML").to_dict()
        print(f"{args.model}: {entry.description}  [peer: {entry.peer}]\n"
              f"Config {cls.__name__}; kinds: " + "; ".join(f"{k}: {v}" for k, v in KINDS.items()) + ".")
        rows = [{**r, "value here": repr(values[r["field"]])} for r in cls.describe()]
        print(markdown_table(rows, ["field", "kind", "type", "value here", "constraint", "meaning"]))
        return 0
    print("Models (`fastzoo list 'PATTERN*'` lists the names a wildcard pattern matches):")
    print(markdown_table(family_rows(), ["family", "task", "names", "examples", "refused"]))
    rows = capability_matrix()
    if args.wide:
        print("\nAttention backends (capabilities as declared; 'available here' is this machine):")
        print(markdown_table(rows, MATRIX_COLUMNS))
        return 0
    print("\nAttention backends, main columns ('available here' is this machine; `fastzoo list --wide`: every "
          "column in full):")
    print(markdown_table([{c: _short(r[c]) for c in NARROW_COLUMNS} for r in rows], NARROW_COLUMNS))
    return 0


NARROW_COLUMNS = ("backend", "available here", "devices: dtypes", "causal", "padding mask", "varlen", "kv cache",
                  "backward")


def _short(cell, width: int = 40) -> str:
    text = str(cell)
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def family_rows() -> list[dict]:
    """Per family: how many names it answers to (aliases included), a few of them, and how many
    of the original library's names for its kind it refuses (``fastzoo.create`` says why)."""
    from fastzoo.registry import specs

    rows = []
    for spec in specs():
        names = [v.name for v in spec.variants]
        picks = sorted({names[round(i * (len(names) - 1) / 3)] for i in range(4)}, key=names.index) if names else []
        count = sum(1 + len(v.aliases) for v in spec.variants)
        rows.append({"family": spec.family, "task": spec.task.name, "names": count,
                     "examples": " ".join(f"`{n}`" for n in picks), "refused": len(spec.refused)})
    return rows


def cmd_bench(args) -> int:
    from fastzoo.bench.cli import cmd_bench as run

    return run(args)


def _bench_args(p):
    from fastzoo.bench.cli import add_args

    add_args(p)


def _tour(args) -> int:
    from fastzoo.bench.tour import cmd_tour

    return cmd_tour(args)


def _tour_args(p) -> None:
    from fastzoo.bench.tour import add_args

    add_args(p)


def _list_args(p) -> None:
    p.add_argument("model", nargs="?", help="a model name: list its config fields (kind, type, constraint, meaning); "
                                            "a pattern with wildcards ('*patch14*'): the names it matches")
    p.add_argument("--families", action="store_true", help="print only the model families table, for the README")
    p.add_argument("--markdown", action="store_true", help="print only the capability matrix, for the README")
    p.add_argument("--wide", action="store_true", help="every column of the capability matrix, cells in full")


def _check_args(p) -> None:
    p.add_argument("model", help="model name (see `fastzoo list`)")
    p.add_argument("--attn", nargs="+", default=["all"], metavar="BACKEND",
                   help="backends to check: 'all', names, or NAME:key=value[:key=value] for options "
                        "(e.g. sdpa:sdpa_backend=math)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--tiny", action="store_true", help="a small config of the model (CPU, CI)")
    p.add_argument("--no-grad", action="store_true", help="compare outputs only")
    p.add_argument("--layers", action="store_true",
                   help="also print the per-layer table (fp32): each module's output and gradient error, "
                        "and the first layer where fastzoo and the original part")
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--explain", action="store_true",
                   help="also print, per attention layer, the kernel requested and the one the profiler saw run "
                        "(fastzoo.explain); a requested kernel that did not run fails the check")
    p.add_argument("--allow-fallback", action="store_true", help="with --explain: report fallbacks without failing")


def _check_without_attention(args, specs, overrides, dtype, rows, results) -> bool:
    """A model without attention layers: its comparison with the original, once, and per backend asked
    for by name (``--attn all``, the default, names none) what is true of it here ("not available
    here" with the reason, else "no attention layer"), never a pass it did not earn. True when the
    comparison failed, or a backend asked for by name cannot run here."""
    from fastzoo import equivalence
    from fastzoo.attention import get_backend
    from fastzoo.attention.availability import unavailable

    res = equivalence.check(args.model, "eager", device=args.device, dtype=dtype, overrides=overrides, batch=args.batch,
                            train=not args.no_grad, layers=args.layers)
    rows.extend({**row, "backend": f"none ({args.model} has no attention layer)"} for row in res.rows())
    results.append({**res.to_dict(), "backend": None})
    failed = not res.passed
    for name, options in specs if args.attn != ["all"] else []:
        reason = unavailable(get_backend(name, **options).capabilities)
        verdict = f"not available here: {reason}" if reason else f"no attention layer: {args.model} never calls it"
        failed |= reason is not None and args.attn != ["all"]
        rows.append({"backend": name, "device": args.device, "dtype": args.dtype, "result": verdict})
        results.append({"backend": name, "options": {k: repr(v) for k, v in options.items()},
                        "unavailable" if reason else "no_attention": reason or True})
    return failed


def parse_backend_spec(spec: str) -> tuple[str, dict]:
    """``"sdpa:sdpa_backend=math"`` -> ``("sdpa", {"sdpa_backend": "math"})``."""
    name, *pairs = spec.split(":")
    return name, parse_key_values(pairs, what=f"backend option in {spec!r}:")


def cmd_check(args) -> int:
    """``fastzoo check MODEL --attn ...``: :func:`fastzoo.equivalence.check` per backend, as a table."""
    from fastzoo import equivalence
    from fastzoo.attention import get_backend, list_attention
    from fastzoo.bench.tour import quiet_libraries
    from fastzoo.registry import check_device, get_entry

    # Arguments are checked before the first comparison: a bad one is one error, not one table row per backend.
    get_entry(args.model)
    tiny = equivalence.tiny_overrides(args.model)  # also refuses a model without attention
    check_device(args.device, what="--device")
    dtype = parse_dtype(args.dtype)
    everything = args.attn == ["all"]
    specs = [(n, {}) for n in list_attention()] if everything else [parse_backend_spec(s) for s in args.attn]
    for name, options in specs:
        get_backend(name, **options)  # unknown backend names and options
    overrides = tiny if args.tiny else None
    with quiet_libraries():  # the originals are built from small configs: their libraries' notices say nothing here
        return _run_check(args, specs, overrides, dtype, everything)


def _run_check(args, specs, overrides, dtype, everything: bool) -> int:
    import torch

    from fastzoo import equivalence, files
    from fastzoo.errors import BackendUnavailableError

    rows, results, layer_tables, failed = [], [], [], False
    if not equivalence.has_attention(args.model):  # no backend is ever asked: one comparison, and why for each backend
        failed = _check_without_attention(args, specs, overrides, dtype, rows, results)
        specs = []
    for name, options in specs:
        try:
            res = equivalence.check(args.model, name, device=args.device, dtype=dtype, overrides=overrides,
                                    backend_options=options, batch=args.batch, train=not args.no_grad,
                                    layers=args.layers)
        except BackendUnavailableError as e:
            failed |= not everything  # asked for by name: not being able to run it is a failure
            rows.append({"backend": name, "device": args.device, "dtype": args.dtype, "result": f"unavailable: {e}"})
            results.append({"backend": name, "options": {k: repr(v) for k, v in options.items()}, "unavailable": str(e)})
            continue
        except Exception as e:  # a kernel that crashes is a failed check, and the table goes on
            failed = True
            rows.append({"backend": name, "device": args.device, "dtype": args.dtype,
                         "result": f"ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            results.append({"backend": name, "options": {k: repr(v) for k, v in options.items()},
                            "error": f"{type(e).__name__}: {e}", "passed": False})
            continue
        failed |= not res.passed
        rows.extend(res.rows())
        rows.extend({"backend": name, "result": f"note: {n}"} for n in res.notes)
        results.append(res.to_dict())
        if args.explain:
            failed |= _explain_tables(args, name, options, overrides, dtype, layer_tables)
        for form, report in res.layers.items():
            first = report.first
            verdict = ("no layer diverges" if first is None else
                       f"first diverging layer: {first.name or '(model)'}")
            layer_tables.append(f"\nLayers of {name} ({form}): {verdict}\n" + markdown_table(report.rows()))
    cols = ["backend", "device", "dtype", "compared", "max error", "bound", "original's own error", "result"]
    print(f"Equivalence of {args.model}{' (tiny config)' if args.tiny else ''} with the original library's model "
          "(fp32, eager attention); rule: "
          + (f"fp32 abs {equivalence.FP32_OUT_ATOL:g}, grads rel {equivalence.FP32_GRAD_RTOL:g}" if dtype == torch.float32
             else f"<= {equivalence.LOW_FACTOR:g} x the original's own {args.dtype} error + floor; the attention op "
                  f"against fp64 attention on the same {args.dtype} inputs, in units of its rounding")
          + f"; weights: {equivalence.describe(0)}")
    print(markdown_table(rows, cols))
    for table in layer_tables:
        print(table)
    if args.json:
        files.write_json(args.json, {"model": args.model, "tiny": args.tiny, "device": args.device,
                                     "dtype": args.dtype, "torch": torch.__version__, "results": results})
    return 1 if failed else 0


def _explain_tables(args, name, options, overrides, dtype, tables) -> bool:
    """Append the kernel tables of one backend to ``tables``; True if a requested kernel did not run."""
    from fastzoo.kernel_report import KernelFallbackError, explain_model

    from fastzoo.equivalence import compares_grads

    label = name + "".join(f":{k}={v}" for k, v in options.items())
    backward = compares_grads(name, options, args.device, not args.no_grad)  # the check's own rule
    try:
        reports = explain_model(args.model, name, backend_options=options, device=args.device, dtype=dtype,
                                overrides=overrides, batch=args.batch, backward=backward,
                                allow_fallback=args.allow_fallback)
    except KernelFallbackError as e:
        tables.append(f"\nKernels of {label}: FALLBACK\n{e.explanation.table()}")
        return True
    for form, report in reports.items():
        tables.append(f"\nKernels of {label}{f' ({form})' if form else ''}:\n{report.table()}")
    return False


def _convert_args(p) -> None:
    p.add_argument("model", help="fastzoo model name (see `fastzoo list`)")
    p.add_argument("source", help="a checkpoint file or directory in any format fastzoo reads")
    p.add_argument("output", help="fastzoo: a save_pretrained directory; other formats: a .safetensors file")
    p.add_argument("--to", default="fastzoo", help="fastzoo (default), or a foreign format: timm | hf | torchvision")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config fields the checkpoint cannot tell (e.g. num_heads=6), original library names")


def cmd_convert(args) -> int:
    """Load ``source`` strictly (format detected from the keys) and write it in ``--to`` format."""
    from safetensors.torch import save_file

    import fastzoo
    from fastzoo import files
    from fastzoo.weights import untied

    overrides = parse_key_values(args.set, what="--set")
    model = fastzoo.create(args.model, pretrained=args.source, **overrides)
    # Written atomically (fastzoo.files): converting in place, over the source, is safe
    # (the source was read whole above) and a failure leaves the old file.
    if args.to == "fastzoo":
        model.save_pretrained(args.output)
    else:
        state = fastzoo.export_state_dict(model, args.to)
        tensors = untied({k: v.detach().contiguous() for k, v in state.items()})
        with files.atomic_path(args.output) as tmp:
            save_file(tensors, str(tmp))
    print(f"wrote {args.output} ({args.to} format, {sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


COMMANDS = {
    "tour": (_tour, "the main job: all four models vs their originals here, parity + speed + what to use", _tour_args),
    "convert": (cmd_convert, "convert a checkpoint between fastzoo, timm, hf and torchvision formats", _convert_args),
    "list": (cmd_list, "models and the attention capability matrix", _list_args),
    "check": (cmd_check, "equivalence of each attention backend with the original library's model", _check_args),
    "bench": (cmd_bench, "parity-gated speed of every attention backend vs the peer library", _bench_args),
}


def main(argv=None) -> int:
    """Run a command. A bad argument, a bad input file or the environment refusing (no such
    device, a full disk) is one line on stderr, ``fastzoo CMD: error: ...``, and exit status 2;
    ``FASTZOO_TRACEBACK=1`` shows the traceback instead."""
    parser = ArgumentParser(prog="fastzoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help_, add_args) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if add_args:
            add_args(p)
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (FastzooError, *USER_ERRORS) as e:
        if show_traceback():
            raise
        print(error_line(f"fastzoo {args.command}", e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
