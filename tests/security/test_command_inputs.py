"""The command's other untrusted inputs and outputs: .npz data files (only the arrays used,
sizes checked before decompressing), FIFO outputs nobody reads, unexpected exceptions.

References: numpy's own .npz writer (np.savez, np.savez_compressed) for the files; the
dangerous cases (gigabytes behind a small file) run in a capped child.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from onnxgrad._npz import load_arrays
from tests.cli.helpers import run_in_process, save
from tests.models import linear_regression_model
from tests.security.isolated import accepted, refused, run_cases

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX FIFOs and limits")

X = np.random.default_rng(0).standard_normal((16, 2))
Y = X @ np.array([1.0, 2.0])


def _zeros_member(archive: zipfile.ZipFile, name: str, nbytes: int) -> None:
    """A member ``name.npy`` of ``nbytes`` zero bytes (a uint8 array), deflated."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros(0, np.uint8))
    header["shape"] = (nbytes,)
    with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, header)
        chunk = bytes(2**24)
        for _ in range(nbytes // len(chunk)):
            member.write(chunk)


def _bomb(path: Path, used: bool) -> None:
    """X, y and 256 MiB of compressed zeros (about 1 MiB on disk): as ``junk`` (unused) or as
    ``X`` itself."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        if not used:
            for name, value in (("X", X), ("y", Y)):
                with archive.open(f"{name}.npy", "w") as member:
                    np.lib.format.write_array(member, value)
        else:
            with archive.open("y.npy", "w") as member:
                np.lib.format.write_array(member, Y)
        _zeros_member(archive, "X" if used else "junk", 2**28)


def _lying_header(path: Path) -> None:
    """X's header declares 2**40 float64 values, its data holds 32 bytes."""
    with zipfile.ZipFile(path, "w") as archive:
        with archive.open("X.npy", "w") as member:
            header = np.lib.format.header_data_from_array_1_0(X)
            header["shape"] = (2**40,)
            np.lib.format.write_array_header_1_0(member, header)
            member.write(struct.pack("4d", 1, 2, 3, 4))
        with archive.open("y.npy", "w") as member:
            np.lib.format.write_array(member, Y)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("npz")
    _bomb(folder / "unused.npz", used=False)
    _bomb(folder / "used.npz", used=True)
    _lying_header(folder / "lying.npz")
    code = "from onnxgrad._npz import load_arrays\nload_arrays('{}', ['X', 'y'], limit=2**26)\n"
    return run_cases(
        {name: (folder, code.format(f"{name}.npz")) for name in ("unused", "used", "lying")}
    )


def test_unused_arrays_are_not_decompressed(reports):
    accepted(reports["unused"])
    assert reports["unused"]["peak_mib"] < 256, reports["unused"]


def test_an_array_over_the_limit_is_refused_before_decompressing(reports):
    refused(reports["used"], "ValueError", "array 'X'", "over the limit of 67108864")


def test_a_header_declaring_more_than_its_data_is_refused(reports):
    refused(reports["lying"], "ValueError", "array 'X'", "more than the")


@pytest.mark.parametrize("writer", [np.savez, np.savez_compressed])
def test_arrays_load_as_numpy_wrote_them(tmp_path, writer):
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    writer(tmp_path / "d.npz", X=X, y=Y.astype(np.float32), F=fortran, junk=np.zeros(3))
    arrays = load_arrays(tmp_path / "d.npz", ["X", "y", "F"])
    assert sorted(arrays) == ["F", "X", "y"]
    np.testing.assert_array_equal(arrays["X"], X)
    np.testing.assert_array_equal(arrays["y"], Y.astype(np.float32))
    np.testing.assert_array_equal(arrays["F"], fortran)


def test_object_arrays_are_refused(tmp_path):
    np.savez(tmp_path / "o.npz", X=np.array([{"a": 1}], dtype=object), y=Y)
    with pytest.raises(ValueError, match="Python objects"):
        load_arrays(tmp_path / "o.npz", ["X", "y"])


@pytest.fixture
def workdir(tmp_path):
    save(linear_regression_model(np.array([1.0, 2.0]), np.array([0.5])), tmp_path / "lr.onnx")
    return tmp_path


def test_train_reads_only_x_and_y(workdir):
    np.savez(workdir / "d.npz", X=X, y=Y, other=np.array([{"a": 1}], dtype=object))
    result = run_in_process(
        "train", "lr.onnx", "--data", "d.npz", "-o", "t.onnx", "--epochs", "1", cwd=workdir
    )
    assert result.returncode == 0, result.stderr


def test_a_fifo_output_without_reader_is_an_error_not_a_hang(workdir):
    os.mkfifo(workdir / "pipe")
    result = run_in_process("derivative", "lr.onnx", "-o", "pipe", cwd=workdir)
    assert result.returncode == 2
    assert "no process reads this FIFO" in result.stderr


def test_an_unexpected_exception_is_one_line_with_status_2(workdir, monkeypatch):
    class Unexpected(Exception):
        pass

    def fail(*args, **kwargs):
        raise Unexpected("something odd")

    monkeypatch.setattr("onnxgrad.derivative.api.derive_in_place", fail)
    result = run_in_process("derivative", "lr.onnx", "-o", "g.onnx", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip() == "onnxgrad derivative: error: Unexpected: something odd"
