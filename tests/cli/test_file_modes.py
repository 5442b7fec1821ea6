"""Output files get the permissions any program's new files get (``0o666`` less the umask),
or keep those of the file they replace."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cli.helpers import run_onnxgrad, save
from tests.models import linear_regression_model

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")


def _with_umask(umask: int) -> tuple[str, ...]:
    """``python -m onnxgrad`` started by a shell whose umask is ``umask``."""
    script = f'umask {umask:03o} && exec "$0" -m onnxgrad "$@"'
    return ("sh", "-c", script, sys.executable)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def workdir(tmp_path):
    save(linear_regression_model(np.array([1.0, 2.0]), np.array([0.5])), tmp_path / "lr.onnx")
    return tmp_path


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize(
    "args",
    [
        ["add-loss", "lr.onnx", "-o", "out.onnx"],
        ["derivative", "lr.onnx", "-o", "out.onnx"],
        ["plot", "lr.onnx", "-o", "out.dot"],
    ],
)
def test_new_file_follows_the_umask(workdir, args, umask):
    result = run_onnxgrad(*args, cwd=workdir, program=_with_umask(umask))
    assert result.returncode == 0, result.stderr
    assert _mode(workdir / args[-1]) == 0o666 & ~umask
    assert sorted(p.name for p in workdir.iterdir()) == sorted(["lr.onnx", args[-1]])


def test_replaced_file_keeps_its_mode(workdir):
    target = workdir / "out.onnx"
    target.write_bytes(b"old")
    target.chmod(0o664)
    result = run_onnxgrad(
        "derivative", "lr.onnx", "-o", "out.onnx", cwd=workdir, program=_with_umask(0o077)
    )
    assert result.returncode == 0, result.stderr
    assert target.read_bytes() != b"old"
    assert _mode(target) == 0o664


def test_demo_files_follow_the_umask(tmp_path):
    result = run_onnxgrad(
        "demo", "-o", "demo", "--epochs", "1", cwd=tmp_path, program=_with_umask(0o022)
    )
    assert result.returncode == 0, result.stderr
    files = sorted((tmp_path / "demo").iterdir())
    assert len(files) == 5
    assert {path.name: _mode(path) for path in files} == {path.name: 0o644 for path in files}
