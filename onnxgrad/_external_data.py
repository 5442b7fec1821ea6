"""External data read by onnxgrad itself, confined to the model's folder.

A model file may keep tensors in other files (``external_data``: ``location``, ``offset``,
``length``). Whatever onnx version is installed, onnxgrad reads them only when:

* ``location`` is a relative path without ``..`` whose real path (links followed) lies in
  the model's folder;
* the file, opened once and checked on its descriptor
  (:func:`onnxgrad._untrusted.open_confined`: no link followed after the check, a regular
  file with one link, since a hard link could expose a file from elsewhere), is the file
  read;
* ``offset + length`` lies within the file and ``length`` is the tensor's size
  (``prod(dims) * itemsize``), and no two tensors share bytes of one file (the same file
  by its identity, whatever name reaches it), checked before the bytes are read.

Tensors anywhere in the model are read so: initializers, sparse initializers, and the
tensor, sparse tensor and subgraph attributes of nodes and functions.

Anything else is a ``ValueError`` naming the tensor, the file and the rule broken; the data
read never exceeds the size of the files it comes from.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from onnx import AttributeProto, GraphProto, ModelProto, SparseTensorProto, TensorProto, helper

from onnxgrad._untrusted import identity, open_confined

#: Element types packed two to a byte (and two to an int32_data value).
#: element type -> elements packed in one byte (raw data) or one int32 value
PACKED_TYPES = {
    getattr(TensorProto, name): per_byte
    for name, per_byte in (("INT4", 2), ("UINT4", 2), ("FLOAT4E2M1", 2), ("INT2", 4), ("UINT2", 4))
    if hasattr(TensorProto, name)
}
HALF_BYTE_TYPES = {t for t, per_byte in PACKED_TYPES.items() if per_byte == 2}


def packed_count(data_type: int, elements: int) -> int | None:
    """Bytes (or int32 values) holding ``elements`` of a sub-byte type, None for others."""
    per_byte = PACKED_TYPES.get(data_type)
    return None if per_byte is None else -(-elements // per_byte)


_KEYS = ("location", "offset", "length", "checksum", "basepath")


def load_external_data(
    model: ModelProto,
    folder: str | os.PathLike,
    source: str,
    files: Mapping[str, bytes] | None = None,
    skipped: Iterable[str] = (),
) -> None:
    """Read the external data of ``model`` (loaded from ``source``, in ``folder``) into its
    tensors, in place (see the module docstring). ``files`` gives, by file name, bytes the
    caller has read and verified already (an artifact folder's): the data is then taken
    from them only. The main-graph initializers ``skipped`` are left external."""
    spans: dict[object, list[tuple[int, int, str]]] = {}
    names = set(skipped)
    kept = [t for t in model.graph.initializer if t.name in names]  # alive: ids stay theirs
    left = {id(t) for t in kept}
    for tensor in all_tensors(model):
        if tensor.data_location == TensorProto.EXTERNAL and id(tensor) not in left:
            _read_tensor(tensor, Path(folder), source, spans, files)


@contextlib.contextmanager
def _opened(folder: Path, parts: list[str], what: str, source: str, files):
    """``(file, size, identity)`` of the external data file ``parts``: from ``files`` when
    given, else through a checked descriptor."""
    if files is None:
        with open_confined(folder, parts, what, source) as (file, info):
            yield file, info.st_size, identity(info)
        return
    name = "/".join(parts)
    if name not in files:
        raise ValueError(f"{source!r}: {what} is in {name!r}, which was not read with it")
    yield io.BytesIO(files[name]), len(files[name]), name


def _read_tensor(tensor: TensorProto, folder: Path, source: str, spans: dict, files) -> None:
    """Read one tensor's bytes through one checked descriptor; ``spans`` holds, per file
    identity, the sorted byte ranges already read."""
    parts, offset, length = _location(tensor, source)
    what = f"the external data of tensor {tensor.name!r}"
    with _opened(folder, parts, what, source, files) as (file, size, key):
        if length is None:
            length = max(size - offset, 0)
        expected = _nbytes(tensor)
        if expected is not None and length != expected:
            raise ValueError(
                f"{source!r}: tensor {tensor.name!r} declares dims {list(tensor.dims)} "
                f"({expected} bytes) but its external data in {'/'.join(parts)!r} is "
                f"{length} bytes long"
            )
        path = folder.joinpath(*parts)
        if offset + length > size:
            raise ValueError(_too_short(tensor, path, offset, length, size, source))
        _claim(spans.setdefault(key, []), offset, length, tensor.name, path, source)
        file.seek(offset)
        raw = file.read(length)
    if len(raw) != length:
        raise ValueError(_too_short(tensor, path, offset, length, len(raw) + offset, source))
    tensor.raw_data = raw
    del tensor.external_data[:]
    tensor.data_location = TensorProto.DEFAULT


def _claim(ranges: list, offset: int, length: int, name: str, path: Path, source: str) -> None:
    """Add ``[offset, offset + length)`` to the sorted ``ranges`` of one file, ``ValueError``
    when it overlaps one already there."""
    if not length:
        return
    span = (offset, offset + length, name)
    index = bisect.bisect_left(ranges, span)
    for neighbour in ranges[max(index - 1, 0) : index + 1]:
        if neighbour[0] < span[1] and span[0] < neighbour[1]:
            raise ValueError(
                f"{source!r}: tensors {neighbour[2]!r} and {name!r} share bytes of "
                f"{os.fspath(path)!r}"
            )
    ranges.insert(index, span)


def _location(tensor: TensorProto, source: str) -> tuple[list[str], int, int | None]:
    """The path components, offset and length (None: to the end) of a tensor's external
    data, from its entries alone."""
    label = f"{source!r}: tensor {tensor.name!r}"
    entries: dict[str, str] = {}
    for entry in tensor.external_data:
        if entry.key not in _KEYS or entry.key in entries:
            raise ValueError(f"{label} has an unknown or repeated external_data key {entry.key!r}")
        entries[entry.key] = entry.value
    location = entries.get("location", "")
    parts = location.replace("\\", "/").split("/")
    if not location or os.path.isabs(location) or "\0" in location or ".." in parts:
        raise ValueError(
            f"{label} keeps its data at {location!r}: external data must be a relative path "
            "inside the model's folder, without '..'"
        )
    offset, length = (_count(entries, key, label) for key in ("offset", "length"))
    return [p for p in parts if p not in ("", ".")], offset or 0, length


def _count(entries: dict[str, str], key: str, label: str) -> int | None:
    if key not in entries:
        return None
    value = entries[key]
    if not value.isascii() or not value.isdigit():
        raise ValueError(f"{label} has external_data {key} {value!r}, expected an integer >= 0")
    return int(value)


def _nbytes(tensor: TensorProto) -> int | None:
    """``prod(dims) * itemsize`` (None for element types without a fixed size)."""
    if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    elements = math.prod(tensor.dims)
    if tensor.data_type in PACKED_TYPES:
        return packed_count(tensor.data_type, elements)
    try:
        return elements * _np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None


def _too_short(tensor, path, offset, length, size, source) -> str:
    return (
        f"{source!r}: tensor {tensor.name!r} needs bytes {offset} to {offset + length} of "
        f"{os.fspath(path)!r}, which holds {size}"
    )


def all_tensors(model: ModelProto) -> Iterator[TensorProto]:
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _attribute_tensors(node.attribute)


def _graph_tensors(graph: GraphProto) -> Iterator[TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from _sparse_tensors(sparse)
    for node in graph.node:
        yield from _attribute_tensors(node.attribute)


def _sparse_tensors(sparse: SparseTensorProto) -> Iterator[TensorProto]:
    yield sparse.values
    yield sparse.indices


def _attribute_tensors(attributes) -> Iterator[TensorProto]:
    for attribute in attributes:
        if attribute.type == AttributeProto.TENSOR:
            yield attribute.t
        elif attribute.type == AttributeProto.TENSORS:
            yield from attribute.tensors
        elif attribute.type == AttributeProto.SPARSE_TENSOR:
            yield from _sparse_tensors(attribute.sparse_tensor)
        elif attribute.type == AttributeProto.SPARSE_TENSORS:
            for sparse in attribute.sparse_tensors:
                yield from _sparse_tensors(sparse)
        elif attribute.type == AttributeProto.GRAPH:
            yield from _graph_tensors(attribute.g)
        elif attribute.type == AttributeProto.GRAPHS:
            for graph in attribute.graphs:
                yield from _graph_tensors(graph)


def _np_dtype(elem_type: int):
    return helper.tensor_dtype_to_np_dtype(elem_type)
