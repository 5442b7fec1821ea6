"""Temporary files and folders of killed runs, removed by the next run for the same target.

A writer names its temporary ``.NAME.<12 hex digits>.tmp`` beside its target ``NAME`` and
holds an exclusive ``flock`` on it while it works (:func:`held`); the lock ends with the
process, however it ends. :func:`remove_leftovers` removes the temporaries of ``NAME`` that
no process holds: those of runs that were killed. Without ``fcntl`` (Windows) nothing is
locked and nothing is removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


def temporary_pattern(target: Path, kind: str = "tmp") -> re.Pattern:
    """The names of ``target``'s temporaries of ``kind``."""
    return re.compile(rf"\.{re.escape(target.name)}\.[0-9a-f]{{12}}\.{kind}")


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file or folder ``path`` (see the module docstring)."""
    if fcntl is None:
        yield
        return
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def remove_leftovers(target: Path, kind: str = "tmp") -> None:
    """Remove the temporaries of ``target`` (of ``kind``) that no running writer holds."""
    if fcntl is None:
        return
    pattern = temporary_pattern(target, kind)
    try:
        names = [n for n in os.listdir(target.parent) if pattern.fullmatch(n)]
    except OSError:
        return
    for name in names:
        _remove_if_free(target.parent / name)


def _remove_if_free(path: Path) -> None:
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError:  # gone, a link, or unreadable: not ours to remove
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a running writer
        os.close(descriptor)
        return
    try:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(descriptor)
