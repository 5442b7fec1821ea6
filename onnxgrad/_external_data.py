"""External data read by onnxgrad itself, confined to the model's folder.

A model file may keep tensors in other files (``external_data``: ``location``, ``offset``,
``length``). Whatever onnx version is installed, onnxgrad reads them only when:

* ``location`` is a relative path without ``..`` whose real path (links followed) lies in
  the model's folder;
* it is a regular file with one link (a hard link could expose a file from elsewhere);
* ``offset + length`` lies within the file and ``length`` is the tensor's size
  (``prod(dims) * itemsize``), and no two tensors share bytes.

Anything else is a ``ValueError`` naming the tensor, the file and the rule broken; the data
read never exceeds the size of the files it comes from.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from pathlib import Path

from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, helper

from onnxgrad._untrusted import check_regular, open_regular

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


def load_external_data(model: ModelProto, folder: str | os.PathLike, source: str) -> None:
    """Read the external data of ``model`` (loaded from ``source``, in ``folder``) into its
    tensors, in place (see the module docstring)."""
    external = [t for t in _all_tensors(model) if t.data_location == TensorProto.EXTERNAL]
    if not external:
        return
    spans: dict[str, list[tuple[int, int, str]]] = {}
    plans = []
    for tensor in external:
        path, offset, length = _checked_location(tensor, Path(folder), source)
        spans.setdefault(os.path.realpath(path), []).append((offset, offset + length, tensor.name))
        plans.append((tensor, path, offset, length))
    for file, ranges in spans.items():
        ranges.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
            if start < end:
                raise ValueError(
                    f"{source!r}: tensors {first!r} and {second!r} share bytes of {file!r}"
                )
    for tensor, path, offset, length in plans:
        with open_regular(path, f"the external data of tensor {tensor.name!r}") as (file, size):
            if offset + length > size:
                raise ValueError(_too_short(tensor, path, offset, length, size, source))
            file.seek(offset)
            raw = file.read(length)
        if len(raw) != length:
            raise ValueError(_too_short(tensor, path, offset, length, len(raw) + offset, source))
        tensor.raw_data = raw
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT


def _checked_location(tensor: TensorProto, folder: Path, source: str) -> tuple[Path, int, int]:
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
    path = folder.joinpath(*[p for p in parts if p not in ("", ".")])
    real, real_folder = os.path.realpath(path), os.path.realpath(folder)
    if not real.startswith(real_folder.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"{label} keeps its data in {location!r}, which resolves to {real!r}, outside "
            f"the model's folder {real_folder!r}"
        )
    info = check_regular(path, f"the external data of tensor {tensor.name!r}")
    if info.st_nlink > 1:
        raise ValueError(
            f"{label} keeps its data in {location!r}, a file with {info.st_nlink} hard links "
            "(one of them may be outside the model's folder): copy it to a file of its own"
        )
    offset, length = (_count(entries, key, label) for key in ("offset", "length"))
    expected = _nbytes(tensor)
    offset = offset or 0
    if length is None:
        length = max(info.st_size - offset, 0)
    if expected is not None and length != expected:
        raise ValueError(
            f"{label} declares dims {list(tensor.dims)} ({expected} bytes) but its external "
            f"data in {location!r} is {length} bytes long"
        )
    if offset + length > info.st_size:
        raise ValueError(_too_short(tensor, path, offset, length, info.st_size, source))
    return path, offset, length


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


def _all_tensors(model: ModelProto) -> Iterator[TensorProto]:
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _attribute_tensors(node.attribute)


def _graph_tensors(graph: GraphProto) -> Iterator[TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _attribute_tensors(node.attribute)


def _attribute_tensors(attributes) -> Iterator[TensorProto]:
    for attribute in attributes:
        if attribute.type == AttributeProto.TENSOR:
            yield attribute.t
        elif attribute.type == AttributeProto.TENSORS:
            yield from attribute.tensors
        elif attribute.type == AttributeProto.GRAPH:
            yield from _graph_tensors(attribute.g)
        elif attribute.type == AttributeProto.GRAPHS:
            for graph in attribute.graphs:
                yield from _graph_tensors(graph)


def _np_dtype(elem_type: int):
    return helper.tensor_dtype_to_np_dtype(elem_type)
