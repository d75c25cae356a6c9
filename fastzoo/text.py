"""Text in and out of fastzoo's command lines, one of each: ``KEY=VALUE`` options, YAML run
files, dtype names, and markdown tables. The bottom floor of the house: it imports nothing of
fastzoo but its errors, so every layer (attention, the training scripts, the bench, the CLI)
can use it."""
from __future__ import annotations

import argparse
import ast
import math
import os
import re
from pathlib import Path

import torch

from fastzoo.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``; other dtypes by torch's own name."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def parse_dtype(name: str, *, what: str = "dtype") -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``, or a ValueError naming ``what`` and the choices."""
    if name not in DTYPES:
        raise ValueError(f"{what}={name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_value(text: str):
    """A Python literal (``2``, ``1e-4``, ``None``, ``True``, ``(32, 32)``, ``'x'``), else a YAML
    scalar or list (``true``, ``null``, ``[3, 4, 6, 3]``), else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_key_values(items, *, what: str = "--set") -> dict:
    """``["depth=2", "img_size=32"]`` -> ``{"depth": 2, "img_size": 32}`` (values: :func:`parse_value`).

    A ValueError names ``what`` and the item that is not ``KEY=VALUE``."""
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{what} {item!r}: write key=value, e.g. depth=2")
        out[key] = parse_value(text)
    return out


def read_yaml(path, *, what: str = "--config", expect: str = "a mapping of field: value") -> dict:
    """A YAML run file as a dict (an empty file: ``{}``); a :class:`ConfigError` naming ``what``
    and the file when it cannot be read or is not a mapping."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{what} {path}: cannot read it as YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected {expect}, got {type(data).__name__}")
    return data


def set_dotted(raw: dict, items, *, what: str = "--set") -> dict:
    """``["optim.lr=3e-4"]`` -> ``raw["optim"]["lr"] = 3e-4``: :func:`parse_key_values`, each key
    dotted into the file's sections. A :class:`ConfigError` names ``what`` and the bad item."""
    for item in items:
        try:
            (key, value), = parse_key_values([item], what=what).items()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        *parents, leaf = key.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{what} {item!r}: {p} is not a section")
        node[leaf] = value
    return raw


def markdown_table(rows: list[dict], columns=None) -> str:
    """A GitHub markdown table of ``rows`` (missing cells empty; ``|`` in a cell becomes ``/``)."""
    columns = list(columns or (rows[0].keys() if rows else []))
    if not columns:
        return "(no rows)"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# -- command lines ---------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, with a usage error reported as one line (``prog: error: ...``, exit
    status 2) instead of the usage block and the error; sub-commands inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a batch size, a number of steps or timed runs)."""
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (warm-up steps)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a learning rate, a weight decay); nan and inf are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


# torch's DataLoader re-raises a worker's error as "Caught X in DataLoader worker process N." with the
# worker's traceback below, whose last line is the cause
_WORKER = re.compile(r"^Caught \w+ in (DataLoader worker process \d+)")
_CAUSE = re.compile(r"^(?:[\w.]+(?:Error|Exception|Exit|Interrupt|Warning)): (.*)$")


def error_line(prog: str, error: BaseException) -> str:
    """The one line a command prints for a user error: ``prog: error: <first line of the message>``
    (an error raised in a data-loading worker: its cause, and which worker)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    worker = _WORKER.match(lines[0]) if lines else None
    if worker and len(lines) > 1:
        cause = _CAUSE.match(lines[-1])
        return f"{prog}: error: {cause[1] if cause else lines[-1]} (in {worker[1]})"
    return f"{prog}: error: {lines[0] if lines else type(error).__name__}"


# Errors a command line reports in one line (exit status 2), beside fastzoo's own
# (FastzooError): the environment's (a missing file, a full disk) and the ValueError /
# TypeError with which configs and arguments are refused. FASTZOO_TRACEBACK=1 shows the
# traceback instead, for bug reports.
USER_ERRORS = (ValueError, TypeError, OSError)


def show_traceback() -> bool:
    return os.environ.get("FASTZOO_TRACEBACK", "") not in ("", "0")
