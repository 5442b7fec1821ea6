""".npz files read as untrusted input: only the arrays asked for, sizes checked first.

An ``.npz`` is a zip archive of ``NAME.npy`` members. :func:`load_arrays` opens only the
members asked for, refuses one whose uncompressed size (the zip entry's ``file_size``) is
over the limit before decompressing a byte, then checks the array header (dtype, shape)
against that size before allocating: a small file holding gigabytes of compressed zeros,
or a header declaring more than its data, is a ``ValueError`` naming the file and array.
Arrays of Python objects (pickles) are refused.
"""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np
from numpy.lib import format as npy_format

from onnxgrad._untrusted import open_regular

#: The largest array (uncompressed bytes) read from an .npz file.
MAX_ARRAY_BYTES = 2**33


def load_arrays(
    path: str | os.PathLike, names: list[str], limit: int = MAX_ARRAY_BYTES
) -> dict[str, np.ndarray]:
    """``{name: array}`` for the ``names`` of the .npz file ``path`` (see the module
    docstring); ``KeyError`` lists the arrays the file holds when one is missing."""
    where = os.fspath(path)
    with open_regular(path, "the data file") as (file, _), zipfile.ZipFile(file) as archive:
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
