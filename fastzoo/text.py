"""Text in and out of fastzoo's command lines, one of each: ``KEY=VALUE`` options, dtype
names, and markdown tables. The bottom floor of the house: it imports nothing of fastzoo,
so every layer (attention, the training scripts, the bench, the CLI) can use it."""
from __future__ import annotations

import ast

import torch

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


def markdown_table(rows: list[dict], columns=None) -> str:
    """A GitHub markdown table of ``rows`` (missing cells empty; ``|`` in a cell becomes ``/``)."""
    columns = list(columns or (rows[0].keys() if rows else []))
    if not columns:
        return "(no rows)"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in columns) + " |" for r in rows]
    return "\n".join(lines)
