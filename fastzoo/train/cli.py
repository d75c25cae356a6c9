"""What the training scripts share on the command line: the common arguments (named as in
timm's ``train.py`` and Hugging Face's ``run_clm``), ``--model-kwargs key=value`` parsing,
``--replay`` taking its defaults from the captured run, and turning user errors into one
``script: error: ...`` line and exit status 2 instead of a traceback."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastzoo.errors import FastzooError, UsageError
from fastzoo.text import (
    USER_ERRORS, ArgumentParser, error_line, non_negative_float, non_negative_int, parse_key_values, positive_int, read_yaml,
    show_traceback,
)

__all__ = ["UsageError", "create_model", "parse_args", "positive_int", "run_main", "train_parser"]


class _KeyValue(argparse.Action):
    """``--model-kwargs depth=2 img_size=32 global_pool=avg`` -> dict (values as Python literals)."""

    def __call__(self, parser, namespace, values, option_string=None):
        out = dict(getattr(namespace, self.dest) or {})
        for item in values:
            try:
                out.update(parse_key_values([item], what=option_string))
            except ValueError as e:
                parser.error(str(e))
        setattr(namespace, self.dest, out)


def train_parser(description: str, model_default: str) -> argparse.ArgumentParser:
    p = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", type=Path, default=None,
                   help="a YAML run file (configs/*.yaml): its fields are this script's options, named as below "
                        "with underscores (batch_size, model_kwargs...); flags given here override them")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=model_default, help="fastzoo model name (see `fastzoo list`)")
    g.add_argument("--pretrained", default=None, help="any source pretrained= accepts: file, save_pretrained dir, checkpoint dir")
    g.add_argument("--attn", default="sdpa", help="attention backend (see `fastzoo list`)")
    g.add_argument("--model-kwargs", nargs="*", default={}, action=_KeyValue, metavar="KEY=VALUE",
                   help="config overrides with the original library's names, e.g. depth=2 img_size=32")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=positive_int, default=1)
    g.add_argument("--steps", type=positive_int, default=None, help="optimizer steps in total (overrides --epochs)")
    g.add_argument("--batch-size", "-b", type=positive_int, default=32, help="global batch, split across processes")
    g.add_argument("--lr", type=non_negative_float, default=1e-4)
    g.add_argument("--weight-decay", type=non_negative_float, default=0.05)
    g.add_argument("--warmup-steps", type=non_negative_int, default=0)
    g.add_argument("--clip-grad", type=non_negative_float, default=1.0, help="max gradient norm; 0 disables clipping")
    g.add_argument("--amp", choices=["none", "bf16"], default="none", help="autocast dtype")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP (under torchrun)")
    g.add_argument("--sync-bn", action="store_true",
                   help="SyncBatchNorm: BatchNorm statistics over the global batch (CUDA only, as in torch)")
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--workers", "-j", type=non_negative_int, default=2, help="data loader worker processes")
    g.add_argument("--output-dir", type=Path, default=None, help="default: runs/<model>")
    g.add_argument("--log-interval", type=positive_int, default=10, help="steps between printed (synchronised) metrics")
    g.add_argument("--ckpt-interval", type=non_negative_int, default=0, help="steps between checkpoints; 0: each epoch and at the end")
    g.add_argument("--keep-checkpoints", type=non_negative_int, default=2, help="newest checkpoint-<step> dirs kept; 0 keeps all")
    g.add_argument("--resume", type=Path, default=None, help="checkpoint directory to continue from")
    g.add_argument("--nan-guard", action=argparse.BooleanOptionalAction, default=True,
                   help="check loss and gradients every step (one tiny host sync per step); on a non-finite "
                        "value save a capture in OUTPUT/nan_step<K> and stop")
    g.add_argument("--replay", type=Path, default=None,
                   help="re-run the step captured in this nan_step<K> directory and compare bit for bit; "
                        "the captured run's arguments are the defaults, arguments given here override them")
    g.add_argument("--debug-nan-at-step", type=positive_int, default=None, metavar="K",
                   help="testing aid: add +inf to the loss of step K (1-based) to exercise the NaN capture")
    return p


# Arguments that describe the replay itself, never taken from the captured run.
_NOT_REPLAYED = {"replay", "resume", "output_dir"}


def read_run_config(parser: argparse.ArgumentParser, path: Path, argv: list[str]) -> dict:
    """The fields of a YAML run file as defaults for ``parser``: every field must be one of the
    parser's options (else :class:`UsageError` naming it, with the closest option), string values
    go through the option's type, and a field of a mutually exclusive group is dropped when the
    command line gives another member of that group (the command line wins)."""
    import difflib

    data = read_yaml(path, expect="a mapping of option: value")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(dest, list(actions), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"--config {path}: unknown field {key!r}{hint}; fields are this script's options: "
                             f"{', '.join(sorted(actions))}")
        out[dest] = _typed(actions[dest], value, path, key)
    given = {tok.split("=", 1)[0] for tok in argv if tok.startswith("-")}
    for group in parser._mutually_exclusive_groups:
        if any(given & set(a.option_strings) for a in group._group_actions):
            for a in group._group_actions:
                out.pop(a.dest, None)
    return out


def _typed(action: argparse.Action, value, path, key):
    def one(v):
        if v is None:  # YAML null: the option's own "not given", where it has one
            if action.default is not None:
                raise UsageError(f"--config {path}: {key}: needs a value (default {action.default!r}), got null")
            return v
        if action.type is not None and callable(action.type):
            if isinstance(v, (bool, list, dict)) and action.type is not str:  # YAML typed it: never a number or a path
                raise UsageError(f"--config {path}: {key}: expected what --{key.replace('_', '-')} takes, got {v!r}")
            try:  # every value through the option's type, as on the command line (a YAML 0 or -1 too)
                v = action.type(v if isinstance(v, str) else str(v))
            except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
                raise UsageError(f"--config {path}: {key}: {e}") from e
        if action.choices is not None and v not in action.choices:
            raise UsageError(f"--config {path}: {key}: {v!r} is not one of {', '.join(map(str, action.choices))}")
        return v

    if isinstance(action, _KeyValue):
        if not isinstance(value, dict):
            raise UsageError(f"--config {path}: {key}: expected a mapping (key: value), got {value!r}")
        return dict(value)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise UsageError(f"--config {path}: {key}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        values = value if isinstance(value, list) else [value]
        if isinstance(action.nargs, int) and len(values) != action.nargs:
            raise UsageError(f"--config {path}: {key}: expected {action.nargs} values, got {value!r}")
        return [one(v) for v in values]
    return one(value)


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else map(str, argv))
    args = parser.parse_args(argv)
    if args.config is not None:
        parser.set_defaults(**read_run_config(parser, args.config, argv))
        args = parser.parse_args(argv)
    if args.replay is not None:
        from fastzoo.train.nan_guard import read_meta

        try:
            stored = read_meta(args.replay)["args"]
        except FastzooError as e:
            parser.error(str(e))
        known = {a.dest for a in parser._actions}
        parser.set_defaults(**{k: v for k, v in stored.items() if k in known and k not in _NOT_REPLAYED})
        args = parser.parse_args(argv)
    if args.output_dir is None:
        args.output_dir = Path("runs") / args.model
    return args


def _jsonable(v):
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def args_to_json(args: argparse.Namespace) -> dict:
    return {k: _jsonable(v) for k, v in vars(args).items()}


def run_main(main, argv=None) -> None:
    """Run ``main(argv)``; user errors print one line and exit 2, the exit status is main's."""
    prog = Path(sys.argv[0]).name
    try:
        code = main(argv)
    except (FastzooError, *USER_ERRORS) as e:  # see fastzoo.text.USER_ERRORS
        if show_traceback():
            raise
        print(error_line(prog, e), file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    finally:
        from fastzoo.train.distributed import shutdown

        shutdown()
    sys.exit(code or 0)


def create_model(args: argparse.Namespace, device=None, *, task=None, **overrides):
    """``fastzoo.create`` from ``--model/--attn/--pretrained/--model-kwargs`` (+ the script's own
    overrides); a bad name or override becomes a one-line error. ``task``: the task the script
    trains (a :class:`fastzoo.tasks.Task`); a model of another is refused, naming its script."""
    from fastzoo.registry import create, get_entry

    if task is not None and get_entry(args.model).spec.task is not task:
        other = get_entry(args.model).spec.task
        raise UsageError(f"--model {args.model}: a {other} model; this script trains {task} models"
                         + (f" (use {other.train_script})" if other.train_script else ""))
    kwargs = {**args.model_kwargs, **overrides}
    try:
        return create(args.model, attn=args.attn, pretrained=args.pretrained, device=device, **kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, FastzooError):
            raise
        raise UsageError(f"--model {args.model} with {kwargs}: {e}") from e
