"""The exceptions fastzoo raises. Every message names what was wrong and what to do."""
from __future__ import annotations

import difflib


class FastzooError(Exception):
    """Base class of every error fastzoo raises on purpose."""


def did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


class _KeyErrorWithMessage(FastzooError, KeyError):
    # KeyError.__str__ quotes its argument; a message reads better unquoted.
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownModelError(_KeyErrorWithMessage):
    def __init__(self, name: str, choices, reason: str = ""):
        if reason:  # a name of the original library's that fastzoo knows and does not reproduce
            super().__init__(f"model {name!r} is not reproduced by fastzoo: {reason}")
            return
        pattern = f"{str(name)[:3]}*"
        known = (f"Known models: {', '.join(sorted(choices))}." if len(choices) <= 20 else
                 f"`fastzoo list '{pattern}'` (in Python: fastzoo.list_models('{pattern}')) lists them; there are "
                 f"{len(choices)}.")
        super().__init__(f"unknown model {name!r}.{did_you_mean(name, choices)} {known}")


class UnknownBackendError(_KeyErrorWithMessage):
    def __init__(self, name: str, choices):
        super().__init__(
            f"unknown attention backend {name!r}.{did_you_mean(name, choices)} "
            f"Known backends: {', '.join(sorted(choices))}."
        )


class UnservedInputError(FastzooError, ValueError, TypeError):
    """A forward keyword refused by name: one of the original's that fastzoo does not serve, or one the
    original's signature lacks (a ``ValueError``, and a ``TypeError`` as Python's own unexpected keyword)."""


class BackendUnavailableError(FastzooError, RuntimeError):
    """A backend cannot serve the request: missing package, device, dtype, head dim or feature."""


class UsageError(FastzooError, ValueError):
    """Bad command-line arguments or unreadable user data: the command line reports it in one
    line and exits with status 2."""


class ConfigError(UsageError):
    """A config has a field it cannot take: a model config field with a wrong type, out of range or
    at odds with another field, or a run file (YAML) that cannot be read, with an unknown or
    mistyped field. ``fields`` names the field(s), so callers decide by key, not by text."""

    def __init__(self, message: str, *, fields=()):
        super().__init__(message)
        self.fields = tuple(fields)


class UnknownFieldError(FastzooError, TypeError):
    """A config field name the model does not have (a TypeError, as for any unknown keyword)."""

    def __init__(self, message: str, *, field: str):
        super().__init__(message)
        self.fields = (field,)


class CheckpointError(FastzooError, ValueError):
    """A checkpoint cannot be read or does not fit the model. Nothing was loaded. ``fields``: the
    model config's fields at fault, where a config cannot be written in a checkpoint's format."""

    def __init__(self, message: str, *, fields=()):
        super().__init__(message)
        self.fields = tuple(fields)
