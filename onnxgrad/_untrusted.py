"""Opening files named by a file that came from elsewhere (a manifest, a model).

A manifest or a model names the files it reads beside it. Every such file is opened once,
by :func:`open_confined`, and what is checked is the open descriptor, the file then read:

* the name is resolved once (links followed) and must lie inside the folder;
* the resolved path is then opened from a descriptor of the folder, one component at a
  time, never following a link (``O_NOFOLLOW``): a component swapped for a link after the
  name was resolved is refused, so the file opened is inside the folder whatever happens
  meanwhile;
* the descriptor (``fstat``) must be a regular file with a single link: never a FIFO (it is
  opened without blocking), a device (``/dev/zero`` never ends), or a hard link whose
  other name may lie outside the folder.

:func:`open_regular` does the same for a path the user gave (links followed, no folder);
:func:`read_bounded` and :func:`read_confined` read a whole file only below a size limit.

Errors are ``ValueError`` naming the file, the entry that names it and the rule broken.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

#: Manifests (JSON) larger than this are refused before they are read.
MAX_MANIFEST_BYTES = 64 * 2**20
_CHUNK = 2**20
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


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


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str) -> Iterator[tuple[BinaryIO, int]]:
    """``(file, size)`` of the regular file ``path`` opened for reading without blocking
    (a FIFO put in its place is refused, not waited on)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _CLOEXEC)
    opened = _checked_descriptor(descriptor, lambda info: _check_regular(info, path, what))
    with opened as (file, info):
        yield file, info.st_size


@contextlib.contextmanager
def _checked_descriptor(descriptor: int, check) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """``(file, fstat)`` of the open ``descriptor`` once ``check(fstat)`` passes, made
    blocking (it was opened without, so that a FIFO does not hang the open); closed after."""
    try:
        info = os.fstat(descriptor)
        check(info)
        os.set_blocking(descriptor, True)
        file = os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise
    with file:
        yield file, info


def _check_regular(info: os.stat_result, path, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {os.fspath(path)!r} is not a regular file ({_kind(info)})")


def read_bounded(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refused past ``limit`` bytes before any is
    read."""
    with open_regular(path, what) as (file, size):
        return _read_whole(file, size, limit, what, path)


def _read_whole(file: BinaryIO, size: int, limit: int, what: str, path) -> bytes:
    if size > limit:
        raise ValueError(
            f"{what} {os.fspath(path)!r} holds {size} bytes, over the limit of {limit}"
        )
    data = file.read(size + 1)  # a file growing meanwhile is caught, not read on
    if len(data) > size:
        raise ValueError(f"{what} {os.fspath(path)!r} grew while it was read")
    return data


@contextlib.contextmanager
def open_confined(
    folder: str | os.PathLike, name: str | Sequence[str], what: str, where
) -> Iterator[tuple[BinaryIO, os.stat_result]]:
    """``(file, fstat)`` of ``folder/name`` opened for reading once it is checked on its
    descriptor (see the module docstring); ``name`` is a relative path or its components.
    ``ValueError`` names ``what`` (the entry), ``where`` (the manifest or model naming it)
    and the rule broken; ``FileNotFoundError`` names a missing file."""
    path = Path(folder).joinpath(*_parts(name))
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(path)
    if os.path.commonpath([real, real_folder]) != real_folder or real == real_folder:
        raise ValueError(
            f"{os.fspath(where)!r}: {what} {os.fspath(path)!r} resolves to {real!r}, outside "
            f"the folder {real_folder!r}"
        )
    components = os.path.relpath(real, real_folder).split(os.sep)
    descriptor = _open_beneath(real_folder, components, path, what, where)
    opened = _checked_descriptor(
        descriptor, lambda info: _check_single_regular(info, path, what, where)
    )
    with opened as (file, info):
        yield file, info


def _parts(name: str | Sequence[str]) -> list[str]:
    return [name] if isinstance(name, str) else list(name)


def _open_beneath(folder: str, components: list[str], path: Path, what: str, where) -> int:
    """A descriptor of ``folder/components``, opened from a descriptor of ``folder``, one
    component at a time, following no link (by its resolved path where the platform opens
    nothing relative to a folder's descriptor)."""
    if os.open not in os.supports_dir_fd:
        return os.open(os.path.join(folder, *components), os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        current = os.open(folder, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(2, f"the folder of {what} does not exist", folder) from None
    try:
        for index, part in enumerate(components):
            last = index == len(components) - 1
            flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC
            flags |= os.O_NONBLOCK if last else _DIRECTORY
            following = os.open(part, flags, dir_fd=current)
            os.close(current)
            current = following
    except FileNotFoundError:
        os.close(current)
        raise FileNotFoundError(2, f"{what} does not exist", os.fspath(path)) from None
    except OSError as exc:
        os.close(current)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise ValueError(
                f"{os.fspath(where)!r}: {what} {os.fspath(path)!r} became a link while it was "
                "opened (a file changed under the reader): refused"
            ) from None
        raise
    return current


def _check_single_regular(info: os.stat_result, path, what: str, where) -> None:
    _check_regular(info, path, what)
    if info.st_nlink != 1:
        raise ValueError(
            f"{os.fspath(where)!r}: {what} {os.fspath(path)!r} has {info.st_nlink} hard links "
            "(another of its names may lie outside the folder): copy it to a file of its own"
        )


def read_confined(
    folder: str | os.PathLike, name: str | Sequence[str], limit: int, what: str, where
) -> bytes:
    """The bytes of ``folder/name`` opened by :func:`open_confined`, refused past ``limit``
    bytes before any is read."""
    with open_confined(folder, name, what, where) as (file, info):
        return _read_whole(file, info.st_size, limit, what, Path(folder).joinpath(*_parts(name)))


def identity(info: os.stat_result) -> tuple[int, int]:
    """``(st_dev, st_ino)``: which file a descriptor is, whatever its name."""
    return info.st_dev, info.st_ino


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data``, in hex."""
    return hashlib.sha256(data).hexdigest()


def as_file(data: bytes) -> BinaryIO:
    """Bytes already read, as a file to read them from again."""
    return io.BytesIO(data)


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
