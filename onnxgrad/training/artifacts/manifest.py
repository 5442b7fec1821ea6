"""``artifacts.json`` read as untrusted input: every field checked, every file digested.

The manifest lists under ``files`` each file of the folder with its SHA-256 digest and size
(and ``zeros``: that many last bytes are zero, checked without hashing, holes unread).
:func:`read_manifest` refuses a folder whose files differ from that list (a folder mixing two
runs, a file changed or swapped since), naming the file. Each listed file is read once,
through a checked descriptor (:func:`onnxgrad._untrusted.open_confined`), and its digest is
that of the bytes read: :func:`read_artifacts` hands those very bytes to the loaders, so a
folder regenerated while it is read gives the old files or the new ones, each checked, or
an error, never a mix.
:func:`checked_train` type-checks the ``train`` section :func:`load_train_step` builds on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path

from onnxgrad._untrusted import (
    MAX_MANIFEST_BYTES,
    open_confined,
    plain_name,
    read_bounded,
    sha256_of,
)

MANIFEST = "artifacts.json"
FORMAT = "onnxgrad.artifacts"
#: Version 2 added ``files``, the digests; version 3 their ``zeros`` (a file's last
#: ``zeros`` bytes are zero and left out of its SHA-256: the optimizer's zero state).
VERSION = 3
#: The versions this reader knows.
VERSIONS = (2, 3)
#: The entries naming a file the loaders read.
FILE_ENTRIES = ("training_model", "eval_model", "inference_model", "checkpoint")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 2**20
_ZEROS = bytes(_CHUNK)


def file_digests(folder: Path, names) -> dict[str, dict]:
    """``{name: {"sha256": hex, "bytes": size}}`` of the files ``names`` of ``folder``."""
    digests = {}
    for name in names:
        digest, size = sha256_of(folder / name, "an artifact")
        digests[name] = {"sha256": digest, "bytes": size}
    return digests


def read_manifest(artifact_directory: str | os.PathLike) -> dict:
    """The ``artifacts.json`` of an artifact folder, once its fields and the digest of every
    file it lists are checked (``ValueError`` naming the file otherwise)."""
    return read_artifacts(artifact_directory, lambda manifest: ())[0]


def read_artifacts(
    artifact_directory: str | os.PathLike, keep: Callable[[dict], Collection[str]]
) -> tuple[dict, dict[str, bytes]]:
    """``(manifest, {name: bytes})``: the checked manifest (:func:`read_manifest`) and the
    bytes of the listed files ``keep(manifest)`` names, the very bytes whose digests were
    checked."""
    folder = Path(artifact_directory)
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist: not an artifact folder")
    try:
        manifest = json.loads(read_bounded(path, MAX_MANIFEST_BYTES, "the artifact manifest"))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{str(path)!r} is not a JSON manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an {FORMAT} manifest")
    if manifest.get("version") not in VERSIONS:
        raise ValueError(
            f"{str(path)!r} is version {manifest.get('version')!r} of {FORMAT}, this reader "
            f"knows versions {VERSIONS} (files with digests): write the folder again"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{str(path)!r}: 'files' must map file names to digests")
    for entry in FILE_ENTRIES:
        name = plain_name(manifest.get(entry), f"{entry!r}", path)
        if name not in files:
            raise ValueError(f"{str(path)!r}: {entry!r} names {name!r}, which 'files' lacks")
    kept, wanted = {}, set(keep(manifest))
    for name, expected in files.items():
        data = _checked_file(folder, name, expected, path, name in wanted)
        if data is not None:
            kept[name] = data
    return manifest, kept


def _checked_file(
    folder: Path, name: str, expected: object, manifest: Path, keep: bool
) -> bytes | None:
    """Read ``name`` once and compare the digest of what was read with ``expected``; its
    bytes when ``keep``."""
    plain_name(name, "a listed file", manifest)
    zeros = expected.get("zeros", 0) if isinstance(expected, dict) else None
    if not (
        isinstance(expected, dict)
        and isinstance(expected.get("sha256"), str)
        and _SHA256.fullmatch(expected["sha256"])
        and is_count(expected.get("bytes"))
        and is_count(zeros)
        and zeros <= expected["bytes"]
    ):
        raise ValueError(f"{str(manifest)!r}: the digest of {name!r} is malformed")
    hashed = expected["bytes"] - zeros
    digest, size, data = hashlib.sha256(), 0, None
    with open_confined(folder, name, "a listed file", manifest) as (file, info):
        if info.st_size != expected["bytes"]:
            size = info.st_size
        elif keep:  # one buffer: chunks joined would hold the bytes twice
            data = file.read(expected["bytes"] + 1)
            digest.update(memoryview(data)[:hashed])
            size = len(data) if data.count(0, hashed) == len(data) - hashed else -1
        else:  # past what is listed: one byte more read tells a file that grew
            limit = hashed if zeros else expected["bytes"] + 1
            while size < limit and (chunk := file.read(min(_CHUNK, limit - size))):
                digest.update(chunk)
                size += len(chunk)
            if zeros and size == hashed:
                size = _zero_tail_end(file.fileno(), hashed, expected["bytes"])
    if (digest.hexdigest(), size) != (expected["sha256"], expected["bytes"]):
        raise ValueError(
            f"{str(folder / name)!r} does not match its digest in {MANIFEST} ({size} bytes, "
            f"{expected['bytes']} listed): the folder mixes files of different runs or was "
            "changed since it was written; write it again"
        )
    return data


def _zero_tail_end(descriptor: int, start: int, end: int) -> int:
    """``end`` when bytes ``[start, end)`` of ``descriptor`` are zero and the file ends
    there, else -1 (a size no digest lists)."""
    if zeros_from(descriptor, start, end) and not os.pread(descriptor, 1, end):
        return end
    return -1


def zeros_from(descriptor: int, start: int, end: int) -> bool:
    """Whether bytes ``[start, end)`` of the open file ``descriptor`` are all zero: the holes
    of a sparse file are (``SEEK_DATA`` skips them unread), its data is read and compared."""
    position = start
    while position < end:
        data, hole = _next_data(descriptor, position, end)
        if data >= end:
            return True
        while data < hole:
            chunk = os.pread(descriptor, min(_CHUNK, hole - data), data)
            if not chunk or chunk != _ZEROS[: len(chunk)]:
                return False
            data += len(chunk)
        position = hole
    return True


def _next_data(descriptor: int, position: int, end: int) -> tuple[int, int]:
    """``(start, end)`` of the next span of ``descriptor`` at or after ``position`` that may
    hold data (all of ``[position, end)`` where the system cannot tell holes)."""
    if not hasattr(os, "SEEK_DATA"):
        return position, end
    try:
        data = os.lseek(descriptor, position, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # holes up to the end of the file
            return end, end
        return position, end  # a file system without SEEK_DATA
    return data, min(os.lseek(descriptor, data, os.SEEK_HOLE), end)


def checked_train(manifest: dict, where: str | os.PathLike) -> dict:
    """The ``train`` section of ``manifest``, each field of its type, names unique."""
    train = manifest.get("train")
    label = f"{os.fspath(where)!r}: train"
    if not isinstance(train, dict):
        raise ValueError(f"{label} must be an object")
    features = train.get("features")
    if not isinstance(features, list) or not features or not all(map(is_name, features)):
        raise ValueError(f"{label}.features must be a non-empty list of names")
    for key in ("label", "learning_rate", "loss"):
        if not is_name(train.get(key)):
            raise ValueError(f"{label}.{key} must be a name, got {train.get(key)!r:.80}")
    weights = _records(train, "weights", {"input": is_name, "output": is_name}, label)
    state_fields = {
        "input": is_name,
        "output": is_name,
        "suffix": is_name,
        "weight": lambda v: v is None or is_name(v),
        "shared": lambda v: isinstance(v, bool),
        "initial": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "elem_type": is_count,
    }
    state = _records(train, "state", state_fields, label)
    names = [*features, train["label"], train["learning_rate"]]
    names += [r[k] for r in [*weights, *state] for k in ("input", "output")]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"{label} names {duplicated} more than once")
    return train


def _records(train: dict, key: str, fields: dict, label: str) -> list[dict]:
    records = train.get(key)
    if not isinstance(records, list):
        raise ValueError(f"{label}.{key} must be a list")
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{label}.{key}[{index}] must be an object")
        shape = record.get("shape")
        if not isinstance(shape, list) or not all(map(is_count, shape)):
            raise ValueError(
                f"{label}.{key}[{index}].shape must be a list of integers >= 0, got {shape!r:.80}"
            )
        for field, valid in fields.items():
            if not valid(record.get(field)):
                raise ValueError(
                    f"{label}.{key}[{index}].{field} is invalid: {record.get(field)!r:.80}"
                )
    return records


def is_name(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
