"""Writing the command line's and the demo's output files whole or not at all.

A symbolic link is written through (its target is replaced, the link stays); a special
file that exists (a FIFO, a device such as ``/dev/null``) is written into, never renamed
over; a FIFO with no reader is refused rather than waited on. Models too big for one
protobuf message (2 GiB) keep their weights as external data in ``<name>.data`` beside them.
A :class:`DigestingFile` hashes what it writes, so a folder's digests need no second read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from onnx import ModelProto, TensorProto
from onnx.numpy_helper import to_array

from onnxgrad._leftovers import held, remove_leftovers
from onnxgrad._onnx_utils import (
    PROTOBUF_LIMIT,
    header_only,
    serialized_size,
    tensor_nbytes,
    tensor_serialized_size,
)

#: Permissions of a new file before the umask, as ``open`` gives them.
NEW_FILE_MODE = 0o666
_NAME_ATTEMPTS = 100
#: Initializers at least this big go to the external data file.
EXTERNAL_THRESHOLD = 1024
_ALIGNMENT = 4096
#: Hex digits of the data's SHA-256 in the name of a model's external data file.
_DIGEST_DIGITS = 16


class DigestingFile:
    """A binary file written from its start, keeping the SHA-256 and the size of what it
    holds; :meth:`zeros` leaves a hole (a sparse file: zeros written without memory or disk
    writes, only hashed); :meth:`zero_tail` ends the file with a hole the digest leaves out,
    recorded as a count of zeros instead."""

    _ZEROS = memoryview(bytes(1 << 22))

    def __init__(self, path: str | os.PathLike):
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close / __exit__)
        self._sha256 = hashlib.sha256()
        self.size = 0
        self._tail = 0

    def write(self, data) -> None:
        """Append ``data`` (bytes, or any C-contiguous buffer of bytes)."""
        self._check_no_tail()
        view = memoryview(data).cast("B")
        self._file.write(view)
        self._sha256.update(view)
        self.size += view.nbytes

    def zeros(self, count: int) -> None:
        """Append ``count`` zero bytes as a hole."""
        self._check_no_tail()
        self._file.seek(count, os.SEEK_CUR)
        self.size += count
        while count:
            chunk = self._ZEROS[: min(count, len(self._ZEROS))]
            self._sha256.update(chunk)
            count -= len(chunk)

    def zero_tail(self, count: int) -> None:
        """Append ``count`` zero bytes as a hole, not hashed: the digest's ``zeros`` counts
        them (the SHA-256 covers the ``bytes - zeros`` first bytes); only more zero tail
        may follow."""
        self._file.seek(count, os.SEEK_CUR)
        self.size += count
        self._tail += count

    def _check_no_tail(self) -> None:
        if self._tail:
            raise ValueError("nothing but zeros may follow the zero tail of a DigestingFile")

    def close(self) -> None:
        self._file.truncate(self.size)  # a trailing hole
        self._file.close()

    def digest(self) -> dict:
        """``{"sha256": hex digest, "bytes": size}`` of what was written, and ``"zeros":
        count`` when it ends with a zero tail (:meth:`zero_tail`)."""
        digest = {"sha256": self._sha256.hexdigest(), "bytes": self.size}
        return {**digest, "zeros": self._tail} if self._tail else digest

    def __enter__(self) -> DigestingFile:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._file.close()


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(temporary_path)`` then rename the temporary file to ``path``.

    The temporary file lives in the destination folder (so the rename is atomic) and is
    removed when ``write`` fails: no partial file is ever left at ``path``; the temporaries
    of killed writes to ``path`` are removed (:mod:`onnxgrad._leftovers`). The result has
    the permissions of the file it replaces, or those of any new file (``0o666`` less the
    umask). A link is followed; a special file is written into (see the module docstring).
    """
    destination = resolved(path)
    if _is_special(destination):
        _write_into_special(destination, write)
        return
    temporary = _create_temporary(destination)
    try:
        with held(temporary):
            remove_leftovers(destination)
            write(str(temporary))
            _keep_mode(destination, temporary)
            os.replace(temporary, destination)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def resolved(path: str | os.PathLike) -> Path:
    """``path`` with its symbolic links followed (a dangling link gives its target)."""
    return Path(os.path.realpath(path))


def _is_special(path: Path) -> bool:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return False
    return not stat.S_ISREG(mode)


def _write_into_special(destination: Path, write: Callable[[str], None]) -> None:
    """Write to a private temporary file, then copy it into the special file: a failed
    ``write`` sends nothing."""
    with tempfile.TemporaryDirectory(prefix="onnxgrad-") as folder:
        temporary = Path(folder) / destination.name
        write(str(temporary))
        with open(temporary, "rb") as source, _open_special(destination) as target:
            shutil.copyfileobj(source, target)


def _open_special(destination: Path):
    """``destination`` opened for writing without waiting: a FIFO nobody reads is an
    ``OSError`` naming it (opening it would block until a reader comes, maybe never)."""
    try:
        descriptor = os.open(destination, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OSError(
                exc.errno, "no process reads this FIFO (start the reader first)", str(destination)
            ) from None
        raise
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "wb")


def _create_temporary(destination: Path) -> Path:
    """A new empty file next to ``destination``, created as ``open`` would (umask applied);
    ``FileNotFoundError`` names the folder when it does not exist (not the temporary)."""
    if not destination.parent.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            f"no such folder to write {destination.name!r} into",
            str(destination.parent),
        )
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


def save_model(
    model: ModelProto,
    path: str | os.PathLike,
    digests: dict | None = None,
    external: Mapping[str, TensorProto] | None = None,
) -> None:
    """Write ``model`` to ``path`` atomically; past protobuf's 2 GiB limit, its big
    initializers go to ``<name>.<digest>.data`` beside ``path`` (beside the link when
    ``path`` is one: runtimes look for it there) as external data, written first, so the
    model never points at a missing file or at another save's data (module docstring).
    ``digests`` (when given) receives ``{file name: DigestingFile.digest()}`` of each file
    written, hashed as it was written. ``external`` maps names of initializers to the
    tensors written in their place (references to data already written beside ``path``;
    ``model`` itself is only read)."""
    digests = {} if digests is None else digests
    initializers = _initializers(model, external or {})
    size = serialized_size(model) - sum(
        tensor_serialized_size(init) - tensor_serialized_size(external[init.name])
        for init in model.graph.initializer
        if init.name in (external or {})
    )
    if size < PROTOBUF_LIMIT:

        def write(temporary: str) -> None:
            digests[Path(path).name] = _write_in_pieces(model, initializers, temporary)

        write_atomically(path, write)
        return
    if _is_special(resolved(path)):
        raise ValueError(
            f"the model is over 2 GiB and needs an external data file beside it: "
            f"{str(path)!r} is not a regular file"
        )
    given = Path(path)  # runtimes resolve the data beside the path they open, link or not
    location = _write_weights_by_digest(initializers, given, digests)
    header = _without_big_weights(model, initializers, location).SerializeToString()
    write_bytes(given, header)
    digests[given.name] = {"sha256": hashlib.sha256(header).hexdigest(), "bytes": len(header)}
    _remove_earlier_data(given, location)


def _initializers(model: ModelProto, external: Mapping[str, TensorProto]) -> list[TensorProto]:
    """The initializers of ``model`` as written: those named in ``external`` replaced."""
    return [external.get(init.name, init) for init in model.graph.initializer]


def _write_weights_by_digest(initializers: list, given: Path, digests: dict) -> str:
    """Write the big weights to a temporary file beside ``given``, then rename it after
    its digest (recorded in ``digests``); the file name (relative to ``given``'s folder)."""
    nominal = given.with_name(f"{given.name}.data")
    temporary = _create_temporary(nominal)
    try:
        with held(temporary):
            remove_leftovers(nominal)
            digest = _write_weights(initializers, str(temporary))
            location = f"{given.name}.{digest['sha256'][:_DIGEST_DIGITS]}.data"
            digests[location] = digest
            os.replace(temporary, given.with_name(location))
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return location


def _remove_earlier_data(given: Path, location: str) -> None:
    """Remove the data files earlier saves to ``given`` left (other digests)."""
    for entry in os.scandir(given.parent):
        if entry.name != location and is_data_file_of(entry.name, given.name):
            Path(entry.path).unlink(missing_ok=True)


def is_data_file_of(name: str, model_name: str) -> bool:
    """Whether ``name`` is an external data file :func:`save_model` writes for a model
    file named ``model_name``."""
    return (
        re.fullmatch(re.escape(model_name) + rf"\.[0-9a-f]{{{_DIGEST_DIGITS}}}\.data", name)
        is not None
    )


def _write_in_pieces(model: ModelProto, initializers: list, path: str) -> dict:
    """Serialise ``model`` into ``path`` one initializer at a time (``initializers``, its
    own or tensors standing for them): the model without its initializers, then for each a
    model holding only it. Parsing concatenated messages merges
    them (repeated fields appended in order), so the file reads back as ``model``; memory
    holds one initializer's bytes at a time instead of the whole model's (each serialised
    alone, framed as ``ModelProto.graph`` (field 7) holding one ``initializer`` (field 5)).
    Returns the file's digest."""
    with DigestingFile(path) as file:
        file.write(header_only(model).SerializeToString())
        for init in initializers:
            tensor = init.SerializeToString()
            framed = _length_delimited(_INITIALIZER_FIELD, len(tensor))
            file.write(_length_delimited(_GRAPH_FIELD, len(framed) + len(tensor)) + framed)
            file.write(tensor)
    return file.digest()


#: Protobuf keys (field number << 3 | 2, length-delimited) of ``ModelProto.graph`` and
#: ``GraphProto.initializer``.
_GRAPH_FIELD, _INITIALIZER_FIELD = 7 << 3 | 2, 5 << 3 | 2


def _length_delimited(key: int, length: int) -> bytes:
    """The key and length prefix of a length-delimited protobuf field (one-byte key)."""
    varint = bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            return bytes([key]) + bytes(varint)


def _is_big(init: TensorProto) -> bool:
    return init.data_location != TensorProto.EXTERNAL and tensor_nbytes(init) >= EXTERNAL_THRESHOLD


def _without_big_weights(model: ModelProto, initializers: list, location: str) -> ModelProto:
    """A copy of ``model`` holding ``initializers`` whose big ones point into ``location``
    (no data copied): at offsets aligned to 4 KiB, in graph order, as
    :func:`_write_weights` writes them."""
    header = header_only(model)
    offset = 0
    for init in initializers:
        copy = header.graph.initializer.add()
        if not _is_big(init):
            copy.CopyFrom(init)
            continue
        size = tensor_nbytes(init)
        copy.name, copy.data_type = init.name, init.data_type
        copy.dims.extend(init.dims)
        copy.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", offset), ("length", size)):
            copy.external_data.add(key=key, value=str(value))
        offset += -(-size // _ALIGNMENT) * _ALIGNMENT
    return header


def _write_weights(initializers: list, path: str) -> dict:
    """Write the big ``initializers`` to ``path`` (4 KiB aligned); the file's digest."""
    with DigestingFile(path) as data:
        for init in filter(_is_big, initializers):
            raw = init.raw_data if init.HasField("raw_data") else to_array(init).tobytes()
            data.write(raw)
            data.write(b"\0" * (-len(raw) % _ALIGNMENT))
    return data.digest()
