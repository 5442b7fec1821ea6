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

import itertools
import json
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxgrad._arrays import c_contiguous
from onnxgrad._files import DigestingFile, write_atomically
from onnxgrad._untrusted import (
    MAX_MANIFEST_BYTES,
    as_file,
    open_confined,
    plain_name,
    read_bounded,
)
from onnxgrad.training.artifacts.manifest import MANIFEST

FORMAT = "onnxgrad.tensors"
VERSION = 1
ALIGNMENT = 64
#: the element types a tensor file holds, by the name written in the manifest
DTYPES = {
    name: np.dtype(name)
    for name in ("float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool")
}
#: The most dims a tensor of a tensor file has (numpy's limit of old).
MAX_RANK = 32
#: The most elements a tensor may count, its zero dims left out (so that numpy can make
#: even an empty array of that shape).
MAX_ELEMENTS = 2**48
WEIGHTS = "weights"
#: Tensors of at least this many bytes are mapped rather than copied by ``mapped`` loads.
MAPPED_FROM = 1 << 20
OPTIMIZER_STATE = "optimizer_state"
#: the checkpoint's manifest in an artifact folder
ARTIFACT_CHECKPOINT = "checkpoint.json"


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


def _refuse_artifacts_checkpoint(path: Path) -> None:
    """An artifact folder's own checkpoint is not overwritten: its ``artifacts.json`` digests
    it and its inference model may read its big weights from the ``.bin`` as external data,
    so a trained checkpoint written there would change that model without a word."""
    data = path.with_suffix(".bin")
    own = path.name == ARTIFACT_CHECKPOINT and (path.parent / MANIFEST).exists()
    if own and data.exists():
        raise ValueError(
            f"{os.fspath(path)!r} is the checkpoint of the artifacts in "
            f"{os.fspath(path.parent)!r}: their {MANIFEST} digests it and their inference "
            f"model may read weights from {data.name}; save the trained checkpoint elsewhere"
        )


def load_checkpoint(
    path: str | os.PathLike,
    files: Mapping[str, bytes] | None = None,
    *,
    mapped: bool = False,
    weights_only: bool = False,
) -> Checkpoint:
    """The checkpoint saved at ``path`` by :func:`save_checkpoint` (or by the JavaScript
    example, which writes the same format); ``files`` and ``mapped`` as in
    :func:`load_tensors`; ``weights_only``: the optimizer state is left unread (empty)."""
    wanted = (WEIGHTS,) if weights_only else None
    tensors, groups = load_tensors(path, files, mapped=mapped, groups=wanted)
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
    path = _manifest_path(path)
    _refuse_artifacts_checkpoint(path)
    data_path = path.with_suffix(".bin")
    arrays = {name: _checked_array(name, value) for name, value in tensors.items()}
    manifest = {}

    def write_data(temporary: str) -> None:
        with TensorWriter(temporary, data_path.name) as writer:
            for name, array in arrays.items():
                writer.add(name, (groups or {}).get(name, "tensors"), array)
        manifest.update(writer.manifest)

    write_atomically(data_path, write_data)
    save_manifest(manifest, path)


def save_manifest(manifest: dict, path: str | os.PathLike) -> None:
    """Write the manifest of a :class:`TensorWriter` to ``path`` (atomically)."""
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=1)))


def _manifest_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix != ".json":
        raise ValueError(f"a tensor file is named by its .json manifest, got {str(path)!r}")
    return path


class TensorWriter:
    """The data file of a tensor file written one tensor at a time, each straight from its
    buffer (:meth:`add`) or, for a constant, without one (:meth:`add_filled`: zeros as a
    hole of a sparse file, all placed at the end, where the digest counts them rather than
    hashes them: :meth:`DigestingFile.zero_tail`), hashed as written; :attr:`manifest` once
    closed (the caller writes it, :func:`save_manifest`). ``data_name``: the data file's
    name in the manifest (default: ``path``'s)."""

    def __init__(self, path: str | os.PathLike, data_name: str | None = None):
        self._file = DigestingFile(path)
        self._data_name = data_name or Path(path).name
        self._entries: list[dict] = []
        self.manifest: dict | None = None

    def add(self, name: str, group: str, array: np.ndarray) -> int:
        """Append ``array`` (any byte order: written little-endian); its offset."""
        array = _little_endian(_checked_array(name, array))
        self._start(name, group, array.dtype, array.shape)
        self._file.write(array.reshape(-1).view(np.uint8))
        return self._entries[-1]["offset"]

    def add_filled(
        self, name: str, group: str, dtype: np.dtype, shape: tuple[int, ...], value: float
    ) -> None:
        """Append a tensor of ``shape`` whose every element is ``value``."""
        dtype = np.dtype(dtype).newbyteorder("<")
        count = math.prod(shape)
        if value == 0:  # placed after the others, in the zero tail
            self._entries.append(self._entry(name, group, dtype, shape, offset=None))
            return
        self._start(name, group, dtype, shape)
        chunk = np.full(min(count, _FILL_CHUNK), value, dtype)
        for start in range(0, count, _FILL_CHUNK):
            self._file.write(chunk[: min(_FILL_CHUNK, count - start)].view(np.uint8))

    def _start(self, name: str, group: str, dtype: np.dtype, shape) -> None:
        entry = self._entry(name, group, dtype, shape, offset=None)
        self._file.zeros(-self._file.size % ALIGNMENT)
        entry["offset"] = self._file.size
        self._entries.append(entry)

    def _entry(self, name: str, group: str, dtype: np.dtype, shape, offset) -> dict:
        if any(e["name"] == name for e in self._entries):
            raise ValueError(f"tensor {name!r} is written twice")
        if dtype.name not in DTYPES:
            raise TypeError(
                f"tensor {name!r} has dtype {dtype}, a tensor file holds {sorted(DTYPES)}"
            )
        return {
            "name": name,
            "group": group,
            "dtype": dtype.name,
            "shape": [int(d) for d in shape],
            "offset": offset,
            "nbytes": dtype.itemsize * math.prod(shape),
        }

    def _write_zero_tail(self) -> None:
        """Place the zero tensors (offset still unknown) after all others, as one hole the
        digest counts instead of hashing."""
        for entry in self._entries:
            if entry["offset"] is None:
                self._file.zero_tail(-self._file.size % ALIGNMENT)
                entry["offset"] = self._file.size
                self._file.zero_tail(entry["nbytes"])

    def digest(self) -> dict:
        """The data file's ``{"sha256", "bytes"}`` (and ``"zeros"``, its zero tail)."""
        return self._file.digest()

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self._write_zero_tail()
        self._file.__exit__(*exc)
        if exc[0] is None:
            self.manifest = {
                "format": FORMAT,
                "version": VERSION,
                "byte_order": "little",
                "data": self._data_name,
                "tensors": self._entries,
            }


#: Elements of a constant tensor written at once.
_FILL_CHUNK = 1 << 20


def _little_endian(array: np.ndarray) -> np.ndarray:
    """``array`` contiguous and little-endian, 0-d kept 0-d (itself when it already is: no
    copy)."""
    return c_contiguous(array.astype(array.dtype.newbyteorder("<"), copy=False))


def load_tensors(
    path: str | os.PathLike,
    files: Mapping[str, bytes] | None = None,
    *,
    mapped: bool = False,
    groups: Collection[str] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``({name: array}, {name: group})`` of the tensor file whose manifest is ``path``.

    The manifest may come from elsewhere (a browser, a device): it is read only below
    :data:`~onnxgrad._untrusted.MAX_MANIFEST_BYTES`, its data file must be a plain name of a
    regular file with one link in the manifest's folder, opened once and checked on its
    descriptor (:func:`~onnxgrad._untrusted.open_confined`), and every entry is checked
    (:func:`checked_entries`) against the data file's size before anything is allocated:
    the arrays returned hold at most the bytes of the data file. ``files`` gives the bytes
    of both files by name when the caller has read (and verified) them already. ``ValueError``
    names the file, the entry and the rule broken. ``mapped``: the arrays are read-only
    views of the data file mapped in memory (no copy: its pages are read when used, and
    the file must not change while they live). ``groups``: read only the tensors of these
    groups (every entry is checked and its group returned all the same).
    """
    path = Path(path)
    if files is None:
        text = read_bounded(path, MAX_MANIFEST_BYTES, "the tensor manifest")
    else:
        text = files[path.name]
    manifest = _parsed_manifest(text, path)
    name = plain_name(manifest.get("data"), "the data file", path)
    if files is not None:
        if name not in files:
            raise ValueError(f"{str(path)!r}: its data file {name!r} is not among the files read")
        return _read_tensors(manifest, as_file(files[name]), len(files[name]), path, groups)
    with open_confined(path.parent, name, "the data file", path) as (data, info):
        source = _Mapped(data, path.with_name(name)) if mapped else data
        return _read_tensors(manifest, source, info.st_size, path, groups)


def checkpoint_shapes(
    path: str | os.PathLike, text: bytes, data_sizes: Mapping[str, int]
) -> dict[str, tuple[int, ...]]:
    """The shapes of the weights of the checkpoint whose manifest ``path`` holds ``text``,
    its entries checked (:func:`checked_entries`) against the size its data file has in
    ``data_sizes`` (by name), none of its data read."""
    path = Path(path)
    manifest = _parsed_manifest(text, path)
    name = plain_name(manifest.get("data"), "the data file", path)
    if name not in data_sizes:
        raise ValueError(f"{str(path)!r}: its data file {name!r} is not among the files listed")
    entries = checked_entries(manifest.get("tensors"), data_sizes[name], path)
    unknown = sorted(e.name for e in entries if e.group not in (WEIGHTS, OPTIMIZER_STATE))
    if unknown:
        raise ValueError(f"{str(path)!r}: tensors {unknown} are neither weights nor state")
    return {e.name: e.shape for e in entries if e.group == WEIGHTS}


def _parsed_manifest(text: bytes, path: Path) -> dict:
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSON, UTF-8, too many digits
        raise ValueError(f"{str(path)!r} is not a JSON manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an {FORMAT} manifest")
    if manifest.get("version") != VERSION or manifest.get("byte_order") != "little":
        raise ValueError(
            f"{str(path)!r}: unsupported version {manifest.get('version')!r} or byte order "
            f"{manifest.get('byte_order')!r} (this reader knows version {VERSION}, little)"
        )
    return manifest


def _read_tensors(manifest: dict, data, size: int, path: Path, groups=None):
    entries = checked_entries(manifest.get("tensors"), size, path)
    data_path = path.with_name(manifest["data"])
    read = [e for e in entries if groups is None or e.group in groups]
    tensors = {e.name: _read_entry(e, data, data_path) for e in read}
    return tensors, {e.name: e.group for e in entries}


@dataclass(frozen=True)
class Entry:
    """One checked tensor entry of a manifest."""

    name: str
    group: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def checked_entries(entries: object, size: int, path: str | os.PathLike) -> list[Entry]:
    """The entries of a manifest checked against a data file of ``size`` bytes: each field
    of its type (integers are not booleans), names non-empty and unique across groups, a
    known dtype, at most :data:`MAX_RANK` non-negative dims, ``nbytes = itemsize *
    prod(shape)`` (exact integers, no overflow), ``offset + nbytes <= size``, no two
    tensors sharing bytes."""
    where = os.fspath(path)
    if not isinstance(entries, list):
        raise ValueError(f"{where!r}: 'tensors' must be a list, got {type(entries).__name__}")
    checked, seen = [], set()
    for index, entry in enumerate(entries):
        item = _entry(entry, index, size, where)
        if item.name in seen:
            raise ValueError(f"{where!r}: tensor {item.name!r} appears twice")
        seen.add(item.name)
        checked.append(item)
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in checked if e.nbytes)
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{where!r}: tensors {first!r} and {second!r} share bytes")
    return checked


def _entry(entry: object, index: int, size: int, where: str) -> Entry:
    if not isinstance(entry, dict):
        raise ValueError(f"{where!r}: tensor entry #{index} is not an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where!r}: tensor entry #{index} has no name (got {name!r})")
    label = f"{where!r}: tensor {name!r}"
    group = entry.get("group", "tensors")
    dtype = entry.get("dtype")
    if not isinstance(group, str) or not group:
        raise ValueError(f"{label} has group {group!r}, expected a non-empty string")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{label} has dtype {dtype!r}, expected one of {sorted(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(map(_count, shape)):
        raise ValueError(
            f"{label} has shape {_short(shape)}, expected a list of at most {MAX_RANK} "
            "non-negative integers"
        )
    offset, nbytes = entry.get("offset"), entry.get("nbytes")
    for field_name, value in (("offset", offset), ("nbytes", nbytes)):
        if not _count(value):
            raise ValueError(f"{label} has {field_name} {value!r}, expected an integer >= 0")
    expected = DTYPES[dtype].itemsize * math.prod(shape)
    if nbytes != expected or offset + nbytes > size:
        raise ValueError(
            f"{label} ({dtype} {_short(shape)}) needs {_short(expected)} bytes at offset "
            f"{offset}, the entry says {nbytes} and the data file has {size}"
        )
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise ValueError(
            f"{label} has shape {_short(shape)}: over {MAX_ELEMENTS} elements (zero dims "
            "left out), more than any array holds"
        )
    return Entry(name, group, DTYPES[dtype], tuple(shape), offset, nbytes)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _checked_array(name: str, value) -> np.ndarray:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor names must be non-empty strings, got {name!r}")
    array = c_contiguous(value)
    if array.dtype.name not in DTYPES:
        raise TypeError(
            f"tensor {name!r} has dtype {array.dtype}, a tensor file holds {sorted(DTYPES)}"
        )
    return array


class _Mapped:
    """A data file read through mappings: one per tensor of :data:`MAPPED_FROM` bytes or
    more (the pages a view has read leave the process's memory with the view), smaller
    ones copied (a mapping each would pass the system's count of mappings)."""

    def __init__(self, file, path: Path):
        self.file, self.path = file, path

    def view(self, entry: Entry) -> np.ndarray:
        little = entry.dtype.newbyteorder("<")
        if entry.nbytes < MAPPED_FROM:
            array = _read_entry(entry, self.file, self.path)
            array.flags.writeable = False
            return array
        mapped = np.memmap(self.file, little, "r", entry.offset, entry.shape)
        return mapped.view(np.ndarray).astype(entry.dtype, copy=False)


def _read_entry(entry: Entry, data, path: Path) -> np.ndarray:
    """The array of ``entry``, read from the open data file (its bytes only), or a view of
    the mapped one."""
    if isinstance(data, _Mapped):
        return data.view(entry)
    array = np.empty(entry.shape, dtype=entry.dtype.newbyteorder("<"))
    data.seek(entry.offset)
    if data.readinto(memoryview(array.reshape(-1).view(np.uint8))) != entry.nbytes:
        raise ValueError(f"{str(path)!r} ended before the bytes of tensor {entry.name!r}")
    return array.astype(entry.dtype, copy=False)


__all__ = [
    "Checkpoint",
    "load_checkpoint",
    "load_tensors",
    "TensorWriter",
    "save_checkpoint",
    "save_manifest",
    "save_tensors",
]
