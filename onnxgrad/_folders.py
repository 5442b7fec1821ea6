"""Folders written as a unit: filled beside the destination, then swapped in.

:func:`replace_folder` fills a new hidden sibling ``.NAME.<random>.tmp`` and renames it to
``NAME`` (the folder it replaces, renamed ``.NAME.<random>.old`` first, is removed once the
new one is in place): readers see the old folder or the new one, never a mix, and a failed
or interrupted fill leaves the old folder as it was. Leftovers of a killed run (its
``.tmp`` and ``.old`` siblings) are removed by the next run for the same folder.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Collection
from pathlib import Path

from onnxgrad._files import is_data_file_of
from onnxgrad._leftovers import held, remove_leftovers, temporary_pattern

_ATTEMPTS = 100


def replace_folder(
    destination: str | os.PathLike, fill: Callable[[Path], None], known: Collection[str]
) -> Path:
    """Call ``fill(folder)`` on a new empty folder, then put it at ``destination``.

    An existing ``destination`` (a link to one is followed) is replaced only when every
    entry in it is one of the ``known`` names (files this writer writes), the external data
    file :func:`onnxgrad._files.save_model` writes for one of them, or a hidden temporary
    file: a folder holding anything else is a ``ValueError`` listing it.
    Missing parent folders are created. Returns the folder written.
    """
    target = Path(os.path.realpath(destination))
    target.parent.mkdir(parents=True, exist_ok=True)
    fresh = _new_sibling(target, "tmp")
    try:
        with held(fresh):
            _restore_or_remove_old(target)
            remove_leftovers(target)
            mode = _replaceable_mode(target, set(known))
            if mode is not None:
                os.chmod(fresh, mode)
            fill(fresh)
            _swap(fresh, target)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    return target


def _replaceable_mode(target: Path, known: set[str]) -> int | None:
    """The permissions of the folder ``target`` replaces (None when there is none)."""
    try:
        info = os.stat(target)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{str(target)!r} exists and is not a folder")
    foreign = sorted(
        name
        for name in os.listdir(target)
        if name not in known
        and not _is_temporary(name)
        and not any(is_data_file_of(name, model) for model in known)
    )
    if foreign:
        shown = ", ".join(map(repr, foreign[:5])) + (", ..." if len(foreign) > 5 else "")
        raise ValueError(
            f"{str(target)!r} holds files onnxgrad did not write ({shown}): it is replaced as "
            "a whole, so give an empty or new folder, or one written by onnxgrad"
        )
    return stat.S_IMODE(info.st_mode)


def _swap(fresh: Path, target: Path) -> None:
    if not target.exists():
        os.rename(fresh, target)
        return
    old = _new_sibling(target, "old", create=False)
    os.rename(target, old)
    try:
        os.rename(fresh, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _new_sibling(target: Path, kind: str, create: bool = True) -> Path:
    for _ in range(_ATTEMPTS):
        candidate = target.with_name(f".{target.name}.{secrets.token_hex(6)}.{kind}")
        if not create:
            if not os.path.lexists(candidate):
                return candidate
            continue
        try:
            os.mkdir(candidate)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"no free temporary name next to {str(target)!r}")


def _restore_or_remove_old(target: Path) -> None:
    """A run killed between its two renames left ``target`` as a ``.old`` sibling: put the
    newest back when ``target`` is missing, remove the others."""
    pattern = temporary_pattern(target, "old")
    olds = sorted(
        (p for p in target.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()),
        key=lambda p: p.stat().st_mtime,
    )
    if olds and not os.path.lexists(target):
        os.rename(olds.pop(), target)
    for path in olds:
        shutil.rmtree(path, ignore_errors=True)


def _is_temporary(name: str) -> bool:
    """A hidden temporary file of :func:`onnxgrad._files.write_atomically`."""
    return re.fullmatch(r"\..+\.[0-9a-f]{12}\.tmp", name) is not None
