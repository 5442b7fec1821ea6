""".npz files read as untrusted input: only the arrays asked for, sizes checked first.

An ``.npz`` is a zip archive of ``NAME.npy`` members. :func:`load_arrays` first reads the
member count and the size of the member list from the archive's end record (its last
bytes) and refuses more than :data:`MAX_MEMBERS` members or a list over
:data:`MAX_DIRECTORY_BYTES` before the list is parsed (a million empty members take half a
gigabyte and tens of seconds to list). It then opens only the members asked for, refuses
one whose uncompressed size (the zip entry's ``file_size``) is over the limit before
decompressing a byte, then checks the array header (dtype, shape) against that size, and
its element count, before allocating: a small file holding gigabytes of compressed zeros,
or a header declaring more than its data, is a ``ValueError`` naming the file and array.
Arrays of Python objects (pickles) are refused.
"""

from __future__ import annotations

import math
import os
import struct
import zipfile

import numpy as np
from numpy.lib import format as npy_format

from onnxgrad._untrusted import open_regular

#: The largest array (uncompressed bytes) read from an .npz file.
MAX_ARRAY_BYTES = 2**33
#: The most members an .npz file may hold, and the largest list of them (zip's central
#: directory, which the reader parses whole).
MAX_MEMBERS = 1024
#: The most elements an array may declare, its zero dims left out (numpy makes no larger).
MAX_ELEMENTS = 2**48
MAX_DIRECTORY_BYTES = 2**20
_END = b"PK\x05\x06"  # end of central directory: 22 bytes and a comment of up to 64 KiB
_END64_LOCATOR = b"PK\x06\x07"  # 20 bytes just before it in a zip64 archive


def load_arrays(
    path: str | os.PathLike, names: list[str], limit: int = MAX_ARRAY_BYTES
) -> dict[str, np.ndarray]:
    """``{name: array}`` for the ``names`` of the .npz file ``path`` (see the module
    docstring); ``KeyError`` lists the arrays the file holds when one is missing."""
    where = os.fspath(path)
    with open_regular(path, "the data file") as (file, size):
        count, listing = directory_size(file, size, where)
        if count > MAX_MEMBERS or listing > MAX_DIRECTORY_BYTES:
            raise ValueError(
                f"{where!r} holds {count} members listed in {listing} bytes, over the limits "
                f"of {MAX_MEMBERS} members and {MAX_DIRECTORY_BYTES} bytes for an .npz"
            )
        file.seek(0)
        return _read_arrays(file, names, limit, where)


def directory_size(file, size: int, where: str) -> tuple[int, int]:
    """``(members, bytes)`` of the member list the zip archive ``file`` (``size`` bytes)
    declares in its end record (zip64's when present), read from its last bytes only, found
    as :mod:`zipfile` finds it."""
    tail_size = min(size, 22 + 2**16)
    file.seek(size - tail_size)
    tail = file.read(tail_size)
    at = len(tail) - 22
    if at < 0 or tail[at : at + 4] != _END or tail[-2:] != b"\0\0":
        at = tail.rfind(_END)
    if at < 0 or len(tail) - at < 22:
        raise ValueError(f"{where!r} is not a readable .npz file (no zip end record)")
    count, listing = struct.unpack_from("<HI", tail, at + 10)
    locator = at - 20
    if locator >= 0 and tail[locator : locator + 4] == _END64_LOCATOR:
        end64 = struct.unpack_from("<Q", tail, locator + 8)[0]
        file.seek(min(end64, size))
        record = file.read(56)
        if len(record) < 56 or record[:4] != b"PK\x06\x06":
            raise ValueError(f"{where!r} is not a readable .npz file (no zip64 end record)")
        count64, listing64 = struct.unpack_from("<QQ", record, 32)
        count, listing = max(count, count64), max(listing, listing64)
    return count, listing


def _read_arrays(file, names: list[str], limit: int, where: str) -> dict[str, np.ndarray]:
    with zipfile.ZipFile(file) as archive:
        members = {
            info.filename.removesuffix(".npy"): info
            for info in archive.infolist()
            if info.filename.endswith(".npy")
        }
        missing = [name for name in names if name not in members]
        if missing:
            raise KeyError(
                f"{where!r} has no array {' or '.join(map(repr, missing))}; it holds "
                f"{sorted(members)}"
            )
        return {name: _read_member(archive, members[name], limit, where) for name in names}


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, where: str):
    label = f"{where!r}: array {info.filename.removesuffix('.npy')!r}"
    if info.file_size > limit:
        raise ValueError(f"{label} holds {info.file_size} bytes, over the limit of {limit}")
    with archive.open(info) as member:
        version = npy_format.read_magic(member)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise ValueError(f"{label} has an unknown .npy version {version}")
        read_header = getattr(npy_format, f"read_array_header_{version[0]}_0", None)
        if read_header is None:  # 3.0: 2.0 with a UTF-8 header
            read_header = npy_format._read_array_header
            shape, fortran, dtype = read_header(member, version)
        else:
            shape, fortran, dtype = read_header(member)
        if dtype.hasobject:
            raise ValueError(f"{label} holds Python objects, which are not loaded (pickles)")
        nbytes = math.prod(shape) * dtype.itemsize
        if math.prod(d for d in shape if d) > MAX_ELEMENTS:
            raise ValueError(
                f"{label} declares shape {list(shape)[:8]}: over {MAX_ELEMENTS} elements "
                "(zero dims left out), more than any array holds"
            )
        if nbytes > info.file_size:
            raise ValueError(
                f"{label} declares {dtype} {list(shape)} ({nbytes} bytes), more than the "
                f"{info.file_size} bytes it holds"
            )
        array = np.empty(shape, dtype=dtype, order="F" if fortran else "C")
        flat = array.reshape(-1, order="A").view(np.uint8)
        read = member.readinto(memoryview(flat)) if nbytes else 0
    if read != nbytes:
        raise ValueError(f"{label} ended after {read} of its {nbytes} bytes")
    return array
