"""Writing the command line's and the demo's output files whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from onnx import ModelProto


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(temporary_path)`` then rename the temporary file to ``path``.

    The temporary file lives in the destination folder (so the rename is atomic) and is
    removed when ``write`` fails: no partial file is ever left at ``path``.
    """
    destination = Path(path)
    handle, temporary = tempfile.mkstemp(
        dir=destination.parent or ".", prefix=f".{destination.name}.", suffix=".tmp"
    )
    os.close(handle)
    try:
        write(temporary)
        os.replace(temporary, destination)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    write_atomically(path, lambda temporary: Path(temporary).write_bytes(data))


def save_model(model: ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` to ``path`` atomically."""
    write_bytes(path, model.SerializeToString())
