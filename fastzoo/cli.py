"""Command line: ``fastzoo tour | list | bench | check | convert``."""
from __future__ import annotations

import argparse
import sys


def markdown_table(rows: list[dict], columns=None) -> str:
    columns = list(columns or (rows[0].keys() if rows else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def cmd_list(args) -> int:
    import fastzoo
    from fastzoo.attention import MATRIX_COLUMNS, capability_matrix
    from fastzoo.registry import get_entry

    if args.markdown:  # the README's block: declarations only, not this machine's state
        print(markdown_table(capability_matrix(), [c for c in MATRIX_COLUMNS if c != "available here"]))
        return 0
    print("Models:")
    for name in fastzoo.list_models():
        e = get_entry(name)
        print(f"  {name:<14} {e.description}  [peer: {e.peer}]")
    print("\nAttention backends (capabilities as declared; 'available here' is this machine):")
    print(markdown_table(capability_matrix(), MATRIX_COLUMNS))
    return 0


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
    p.add_argument("--markdown", action="store_true", help="print only the capability matrix, for the README")


def _check(args) -> int:
    from fastzoo.parity import cmd_check

    return cmd_check(args)


def _check_args(p) -> None:
    from fastzoo.parity import add_check_args

    add_check_args(p)


def _convert_args(p) -> None:
    p.add_argument("model", help="fastzoo model name (see `fastzoo list`)")
    p.add_argument("source", help="a checkpoint file or directory in any format fastzoo reads")
    p.add_argument("output", help="fastzoo: a save_pretrained directory; other formats: a .safetensors file")
    p.add_argument("--to", default="fastzoo", help="fastzoo (default), or a foreign format: timm | hf | torchvision")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config fields the checkpoint cannot tell (e.g. num_heads=6), original library names")


def cmd_convert(args) -> int:
    """Load ``source`` strictly (format detected from the keys) and write it in ``--to`` format."""
    import yaml
    from safetensors.torch import save_file

    import fastzoo
    from fastzoo import files
    from fastzoo.errors import FastzooError
    from fastzoo.models.base import untied

    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"fastzoo convert: --set takes KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[key] = yaml.safe_load(value)
    try:
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
    except (FastzooError, ValueError, TypeError, OSError) as e:
        print(f"fastzoo convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({args.to} format, {sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


COMMANDS = {
    "tour": (_tour, "the main job: all four models vs their originals here, parity + speed + what to use", _tour_args),
    "convert": (cmd_convert, "convert a checkpoint between fastzoo, timm, hf and torchvision formats", _convert_args),
    "list": (cmd_list, "models and the attention capability matrix", _list_args),
    "check": (_check, "parity of attention backends against the fp32 eager reference", _check_args),
    "bench": (cmd_bench, "parity-gated speed of every attention backend vs the peer library", _bench_args),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastzoo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (fn, help_, add_args) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if add_args:
            add_args(p)
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
