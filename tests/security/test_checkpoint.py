"""Checkpoints from elsewhere (browsers, devices): load_tensors confines its data file,
checks every field before allocating, and never reads more than the data file holds.

Each dangerous case runs in a child with a memory cap and a timeout (tests/security/
isolated.py); the reference is what the file holds (numpy) or the rule it breaks.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxgrad.training.artifacts.checkpoint import (
    Checkpoint,
    load_checkpoint,
    load_tensors,
    save_checkpoint,
)
from tests.security.isolated import refused, run_cases

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX files and resource limits")


def _saved(folder: Path) -> dict:
    save_checkpoint(
        Checkpoint({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"m": np.zeros(2)}),
        folder / "c.json",
    )
    return json.loads((folder / "c.json").read_text())


def _write(folder: Path, manifest: dict) -> Path:
    path = folder / "c.json"
    path.write_text(json.dumps(manifest))
    return path


def _data(value):
    def build(folder: Path) -> None:
        _write(folder, {**_saved(folder), "data": value})

    return build


def _linked(target: str):
    def build(folder: Path) -> None:
        _saved(folder)
        (folder / "c.bin").unlink()
        (folder / "c.bin").symlink_to(target)

    return build


def _fifo(name: str):
    def build(folder: Path) -> None:
        _saved(folder)
        (folder / name).unlink()
        os.mkfifo(folder / name)

    return build


def _changed(**changes):
    def build(folder: Path) -> None:
        manifest = _saved(folder)
        manifest["tensors"][0].update(changes)
        _write(folder, manifest)

    return build


def _shared_bytes(folder: Path) -> None:
    """1000 entries over the same bytes would allocate 1000 times the data file."""
    manifest = _saved(folder)
    first = manifest["tensors"][0]
    manifest["tensors"] = [{**first, "name": f"t{i}"} for i in range(1000)]
    _write(folder, manifest)


def _duplicate(folder: Path) -> None:
    manifest = _saved(folder)
    manifest["tensors"][1]["name"] = "w"
    _write(folder, manifest)


#: id -> (how the folder is made, a fragment of the ValueError's message)
DANGEROUS = {
    "absolute-data": (_data("/etc/passwd"), "not a plain file name"),
    "parent-data": (_data("../outside.bin"), "not a plain file name"),
    "nested-data": (_data("sub/c.bin"), "not a plain file name"),
    "dotdot-data": (_data(".."), "not a plain file name"),
    "list-data": (_data(["c.bin"]), "must be a file name"),
    "link-dev-zero": (_linked("/dev/zero"), "outside the folder"),
    "link-passwd": (_linked("/etc/passwd"), "outside the folder"),
    "link-environ": (_linked("/proc/self/environ"), "outside the folder"),
    "fifo-data": (_fifo("c.bin"), "a FIFO"),
    "fifo-manifest": (_fifo("c.json"), "a FIFO"),
    "negative-dim": (_changed(shape=[-1]), "non-negative integers"),
    "overflowing-shape": (_changed(shape=[2**40, 2**40, 2**40], nbytes=0), "needs"),
    "overflowing-nbytes": (_changed(shape=[2**62, 4], nbytes=2**66), "needs"),
    "declared-8-gib": (_changed(shape=[2**31], nbytes=2**33), "needs"),
    "huge-offset": (_changed(offset=2**63), "needs"),
    "shared-bytes": (_shared_bytes, "share bytes"),
    "duplicate-across-groups": (_duplicate, "'w' appears twice"),
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    cases = {}
    for key, (build, _) in DANGEROUS.items():
        folder = tmp_path_factory.mktemp(key)
        build(folder)
        code = "from onnxgrad.training.artifacts.checkpoint import load_checkpoint\n"
        cases[key] = (folder, code + "load_checkpoint('c.json')\n")
    return run_cases(cases)


@pytest.mark.parametrize("key", sorted(DANGEROUS))
def test_dangerous_manifests_are_refused_within_limits(reports, key):
    refused(reports[key], "ValueError", DANGEROUS[key][1])


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"shape": [True, 3]}, "non-negative integers"),
        ({"shape": "23"}, "non-negative integers"),
        ({"offset": 0.0}, "offset 0.0"),
        ({"nbytes": "24"}, "nbytes '24'"),
        ({"name": ""}, "has no name"),
        ({"name": ["w"]}, "has no name"),
        ({"dtype": ["float32"]}, "dtype ['float32']"),
        ({"dtype": "object"}, "dtype 'object'"),
        ({"group": 3}, "group 3"),
        ({"shape": [1] * 40}, "at most 32"),
    ],
)
def test_entry_fields_are_type_checked(tmp_path, changes, fragment):
    _changed(**changes)(tmp_path)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        load_tensors(tmp_path / "c.json")


def test_lists_where_strings_belong_are_value_errors(tmp_path):
    manifest = _saved(tmp_path)
    manifest["tensors"] = {"w": 1}
    with pytest.raises(ValueError, match="must be a list"):
        load_tensors(_write(tmp_path, manifest))


def test_a_valid_checkpoint_loads_what_it_holds(tmp_path):
    _saved(tmp_path)
    loaded = load_checkpoint(tmp_path / "c.json")
    np.testing.assert_array_equal(loaded.weights["w"], np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(loaded.optimizer_state["m"], np.zeros(2))


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-4, max_value=2**40), max_size=4),
)
_KEYS = ("name", "group", "dtype", "shape", "offset", "nbytes")


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    changes=st.lists(
        st.tuples(st.integers(0, 1), st.sampled_from(_KEYS), _VALUES), min_size=1, max_size=4
    ),
    data=st.one_of(st.just("c.bin"), st.text(max_size=12)),
    extra=st.integers(0, 2),
)
def test_fuzzed_manifests_load_or_raise_value_errors(tmp_path, changes, data, extra):
    """Whatever the fields hold, load_tensors returns arrays of the declared shapes that lie
    in the data file, or raises ValueError/OSError: never another error or an allocation
    larger than the data file."""
    folder = tmp_path / "fuzz"
    folder.mkdir(exist_ok=True)
    manifest = _saved(folder)
    manifest["data"] = data
    manifest["tensors"] += [dict(manifest["tensors"][0], name=f"x{i}") for i in range(extra)]
    for index, key, value in changes:
        manifest["tensors"][index][key] = value
    path = _write(folder, manifest)
    size = (folder / "c.bin").stat().st_size
    try:
        tensors, _ = load_tensors(path)
    except (ValueError, OSError):
        return
    assert sum(a.nbytes for a in tensors.values()) <= size
    for entry in manifest["tensors"]:
        array = tensors[entry["name"]]
        assert list(array.shape) == entry["shape"] and array.dtype.name == entry["dtype"]
