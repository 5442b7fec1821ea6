"""Checkpoints any runtime can read: raw little-endian tensors and a JSON manifest.

A tensor file is two files side by side: ``NAME.json``, the manifest, and ``NAME.bin``,
the tensors one after the other, each starting at a multiple of :data:`ALIGNMENT` bytes (so
a ``Float32Array``, ``Float64Array`` or ``BigInt64Array`` can view it without a copy)::

    {
      "format": "onnxgrad.tensors", "version": 1, "byte_order": "little",
      "data": "NAME.bin",
      "tensors": [
        {"name": "coefs", "group": "weights", "dtype": "float32", "shape": [3, 1],
         "offset": 0, "nbytes": 12},
        ...
      ]
    }

``dtype`` is one of :data:`DTYPES` (the names onnxruntime's JavaScript ``Tensor`` uses),
``offset`` and ``nbytes`` count bytes in the data file, ``nbytes = itemsize * prod(shape)``.
A :class:`Checkpoint` stores its weights in the group ``"weights"`` and the optimizer state
in ``"optimizer_state"``; the order of the tensors is the order of the train step's inputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxgrad._arrays import c_contiguous
from onnxgrad._files import write_atomically, write_bytes

FORMAT = "onnxgrad.tensors"
VERSION = 1
ALIGNMENT = 64
#: the element types a tensor file holds, by the name written in the manifest
DTYPES = {
    name: np.dtype(name)
    for name in ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool")
}
WEIGHTS = "weights"
OPTIMIZER_STATE = "optimizer_state"


@dataclass
class Checkpoint:
    """What a training run resumes from: ``weights`` and ``optimizer_state`` by the name of
    the train step's input that receives them."""

    weights: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_state: dict[str, np.ndarray] = field(default_factory=dict)


def save_checkpoint(checkpoint: Checkpoint, path: str | os.PathLike) -> None:
    """Write ``checkpoint`` to ``path`` (the ``.json`` manifest) and the ``.bin`` beside it."""
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"expected a Checkpoint, got {type(checkpoint).__name__}")
    overlap = sorted(set(checkpoint.weights) & set(checkpoint.optimizer_state))
    if overlap:
        raise ValueError(f"names {overlap} are both weights and optimizer state")
    groups = {name: WEIGHTS for name in checkpoint.weights}
    groups.update({name: OPTIMIZER_STATE for name in checkpoint.optimizer_state})
    save_tensors({**checkpoint.weights, **checkpoint.optimizer_state}, path, groups)


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint saved at ``path`` by :func:`save_checkpoint` (or by the JavaScript
    example, which writes the same format)."""
    tensors, groups = load_tensors(path)
    unknown = sorted(n for n, g in groups.items() if g not in (WEIGHTS, OPTIMIZER_STATE))
    if unknown:
        raise ValueError(f"{os.fspath(path)!r}: tensors {unknown} are neither weights nor state")
    return Checkpoint(
        weights={n: a for n, a in tensors.items() if groups[n] == WEIGHTS},
        optimizer_state={n: a for n, a in tensors.items() if groups[n] == OPTIMIZER_STATE},
    )


def save_tensors(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    groups: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` (kept in order) as a manifest ``path`` (``.json``) and its data file.

    ``groups`` tags each tensor (default ``"tensors"``). Each file is written whole or not
    at all; the data file is written first.
    """
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"a tensor file is named by its .json manifest, got {str(path)!r}")
    data_path = path.with_suffix(".bin")
    entries, chunks, offset = [], [], 0
    for name, value in tensors.items():
        array = _checked_array(name, value)
        padding = -offset % ALIGNMENT
        chunks.append(b"\0" * padding)
        offset += padding
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        entries.append(
            {
                "name": name,
                "group": (groups or {}).get(name, "tensors"),
                "dtype": array.dtype.name,
                "shape": list(array.shape),
                "offset": offset,
                "nbytes": len(raw),
            }
        )
        chunks.append(raw)
        offset += len(raw)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "byte_order": "little",
        "data": data_path.name,
        "tensors": entries,
    }
    write_bytes(data_path, b"".join(chunks))
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=1)))


def load_tensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``({name: array}, {name: group})`` of the tensor file whose manifest is ``path``."""
    path = Path(path)
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{str(path)!r} is not a JSON manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an {FORMAT} manifest")
    if manifest.get("version") != VERSION or manifest.get("byte_order") != "little":
        raise ValueError(
            f"{str(path)!r}: unsupported version {manifest.get('version')!r} or byte order "
            f"{manifest.get('byte_order')!r} (this reader knows version {VERSION}, little)"
        )
    data = (path.parent / manifest["data"]).read_bytes()
    tensors, groups = {}, {}
    for entry in manifest["tensors"]:
        name = entry["name"]
        tensors[name] = _read_entry(entry, data, path)
        groups[name] = entry.get("group", "tensors")
    return tensors, groups


def _checked_array(name: str, value) -> np.ndarray:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
    array = c_contiguous(value)
    if array.dtype.name not in DTYPES:
        raise TypeError(
            f"tensor {name!r} has dtype {array.dtype}, a tensor file holds {sorted(DTYPES)}"
        )
    return array


def _read_entry(entry: dict, data: bytes, path: Path) -> np.ndarray:
    name = entry["name"]
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{str(path)!r}: tensor {name!r} has unknown dtype {entry['dtype']!r}")
    shape = tuple(int(d) for d in entry["shape"])
    offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
    expected = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if nbytes != expected or offset < 0 or offset + nbytes > len(data):
        raise ValueError(
            f"{str(path)!r}: tensor {name!r} ({entry['dtype']} {list(shape)}) needs {expected} "
            f"bytes at offset {offset}, the entry says {nbytes} and the data file has {len(data)}"
        )
    flat = np.frombuffer(
        data, dtype=dtype.newbyteorder("<"), count=expected // dtype.itemsize, offset=offset
    )
    return flat.astype(dtype).reshape(shape)


__all__ = [
    "Checkpoint",
    "load_checkpoint",
    "load_tensors",
    "save_checkpoint",
    "save_tensors",
]
