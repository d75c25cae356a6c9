"""Writing files so that no reader ever sees half of one: every file fastzoo writes
(``save_pretrained``, ``fastzoo convert``, training checkpoints and logs, NaN captures,
benchmark results) goes through here.

A file is written under a temporary name beside its destination, flushed to disk
(``fsync``), renamed over the destination (``os.replace``: atomic on POSIX and Windows),
and the directory is fsynced so the rename itself survives a power cut. A crash, a kill
or a full disk at any moment leaves either the old file or the new one, never a mix; the
temporary file is removed on any error. A directory (a training checkpoint) is built as
``NAME.tmp`` and renamed in place the same way; a ``NAME.tmp`` or ``NAME.old`` left by a
killed writer is cleaned (or, for ``.old``, restored) by the next writer of ``NAME``.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents to disk (directories: where the OS allows)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:  # Windows cannot open a directory; its renames are durable without this
        if Path(path).is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not Path(path).is_dir():
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new contents to (with any writer that takes
    a path: ``safetensors.save_file``, ``torch.save``, ``savefig(..., format=...)``); when the
    block ends without an error it replaces ``path`` atomically and durably. On any error,
    ``KeyboardInterrupt`` included, the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; expected a file name to write")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path.parent}: no such directory (to write {path.name} in)")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask applies, as for open()
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_bytes(path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2) + "\n")


def save_figure(fig, path, **savefig_kwargs) -> Path:
    """``fig.savefig`` to ``path`` atomically (parents created; the format from the suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or None, **savefig_kwargs)
    return path


def recover_dir(path) -> None:
    """Undo what a killed :func:`atomic_dir` left at ``path``: a half-written ``NAME.tmp`` is
    removed; ``NAME.old`` (the previous version, moved aside for the rename) is put back if
    ``NAME`` is missing, removed otherwise."""
    path = Path(path)
    tmp, old = path.with_name(path.name + TMP_SUFFIX), path.with_name(path.name + OLD_SUFFIX)
    _remove(tmp)
    if old.exists() or old.is_symlink():
        if path.exists():
            _remove(old)
        else:
            os.replace(old, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path) -> Iterator[Path]:
    """Yield ``NAME.tmp`` to fill; when the block ends without an error, every file in it is
    fsynced and it replaces ``path`` (an existing ``path`` is moved to ``NAME.old`` for the
    moment of the swap). On any error ``NAME.tmp`` is removed and ``path`` is untouched."""
    path = Path(path)
    recover_dir(path)
    tmp, old = path.with_name(path.name + TMP_SUFFIX), path.with_name(path.name + OLD_SUFFIX)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for file in sorted(tmp.rglob("*"), reverse=True):  # files before the directories holding them
            fsync_path(file)
        fsync_path(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():  # failed between the two renames: put the old one back
            os.replace(old, path)
        raise
    fsync_path(path.parent)
    shutil.rmtree(old, ignore_errors=True)
