"""Opening files named by a file that came from elsewhere (a manifest, a model).

A manifest or a model names the files it reads beside it. Every such name goes through
:func:`confined_file`: a plain file name (no folder separator, no ``..``, not absolute),
whose real path (links followed) stays in the folder, and which is a regular file, never a
FIFO (which would block) or a device (``/dev/zero`` never ends). :func:`open_regular` opens
a file without blocking and checks, on the open descriptor, that it is the regular file
that was checked, so a swap after the check is caught too. :func:`read_bounded` reads a
whole file only below a size limit.

Errors are ``ValueError`` naming the file, the entry that names it and the rule broken.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

#: Manifests (JSON) larger than this are refused before they are read.
MAX_MANIFEST_BYTES = 64 * 2**20
_CHUNK = 2**20


def plain_name(name: object, what: str, where: str | os.PathLike) -> str:
    """``name`` when it is a plain file name, else a ``ValueError`` naming ``what`` (the
    entry) and ``where`` (the manifest)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{os.fspath(where)!r}: {what} must be a file name, got {name!r}")
    if name in (".", "..") or any(c in name for c in "/\\\0") or os.path.isabs(name):
        raise ValueError(
            f"{os.fspath(where)!r}: {what} {name!r} is not a plain file name in the "
            "manifest's folder (no folder separators, '..' or absolute paths)"
        )
    return name


def confined_file(folder: str | os.PathLike, name: str, what: str, where) -> Path:
    """``folder/name`` once it is checked (see the module docstring)."""
    path = Path(folder) / plain_name(name, what, where)
    check_inside(path, folder, what, where)
    check_regular(path, what)
    return path


def check_inside(path: Path, folder: str | os.PathLike, what: str, where) -> None:
    """``ValueError`` when ``path``, links followed, is not in ``folder``."""
    real, real_folder = os.path.realpath(path), os.path.realpath(folder)
    if os.path.dirname(real) != real_folder:
        raise ValueError(
            f"{os.fspath(where)!r}: {what} {os.fspath(path)!r} resolves to {real!r}, outside "
            f"the folder {real_folder!r}"
        )


def check_regular(path: Path, what: str) -> os.stat_result:
    """The ``stat`` of ``path``; ``ValueError`` unless it is a regular file (links
    followed), ``FileNotFoundError`` naming it when it is missing."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(2, f"{what} does not exist", os.fspath(path)) from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {os.fspath(path)!r} is not a regular file ({_kind(info)})")
    return info


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str) -> Iterator[tuple[BinaryIO, int]]:
    """``(file, size)`` of the regular file ``path`` opened for reading without blocking
    (a FIFO put in its place is refused, not waited on)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {os.fspath(path)!r} is not a regular file ({_kind(info)})")
        os.set_blocking(descriptor, True)
        file = os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise
    with file:
        yield file, info.st_size


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refused past ``limit`` bytes before any is
    read."""
    with open_regular(path, what) as (file, size):
        if size > limit:
            raise ValueError(
                f"{what} {os.fspath(path)!r} holds {size} bytes, over the limit of {limit}"
            )
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} {os.fspath(path)!r} grew past the limit of {limit} bytes")
    return data


def sha256_of(path: str | os.PathLike, what: str) -> tuple[str, int]:
    """``(hex digest, size)`` of the regular file ``path``, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open_regular(path, what) as (file, _):
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _kind(info: os.stat_result) -> str:
    mode = info.st_mode
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"
