"""Writing the command line's and the demo's output files whole or not at all."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from onnx import ModelProto

#: Permissions of a new file before the umask, as ``open`` gives them.
NEW_FILE_MODE = 0o666
_NAME_ATTEMPTS = 100


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(temporary_path)`` then rename the temporary file to ``path``.

    The temporary file lives in the destination folder (so the rename is atomic) and is
    removed when ``write`` fails: no partial file is ever left at ``path``. The result has
    the permissions of the file it replaces, or those of any new file (``0o666`` less the
    umask).
    """
    destination = Path(path)
    temporary = _create_temporary(destination)
    try:
        write(str(temporary))
        _keep_mode(destination, temporary)
        os.replace(temporary, destination)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _create_temporary(destination: Path) -> Path:
    """A new empty file next to ``destination``, created as ``open`` would (umask applied)."""
    for _ in range(_NAME_ATTEMPTS):
        temporary = destination.with_name(f".{destination.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, NEW_FILE_MODE))
        except FileExistsError:
            continue
        return temporary
    raise FileExistsError(f"no free temporary name next to {str(destination)!r}")


def _keep_mode(destination: Path, temporary: Path) -> None:
    try:
        mode = stat.S_IMODE(destination.stat().st_mode)
    except FileNotFoundError:
        return
    os.chmod(temporary, mode)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    write_atomically(path, lambda temporary: Path(temporary).write_bytes(data))


def save_model(model: ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` to ``path`` atomically."""
    write_bytes(path, model.SerializeToString())
