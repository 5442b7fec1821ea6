"""Running the ``onnxgrad`` command as a process, as a user does."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[2]


def run_onnxgrad(
    *args: str,
    cwd: Path,
    blocked: tuple[str, ...] = (),
    timeout: float = 240,
    program: tuple[str, ...] = (sys.executable, "-m", "onnxgrad"),
) -> subprocess.CompletedProcess:
    """``python -m onnxgrad ARGS`` (or ``program ARGS``) in ``cwd``, with the packages
    ``blocked`` failing to import.

    PyTorch is always blocked: it is no dependency of onnxgrad, so the command must work
    without it.
    """
    with tempfile.TemporaryDirectory() as blocked_folder:
        return subprocess.run(
            [*program, *map(str, args)],
            cwd=cwd,
            env=command_environment(Path(blocked_folder), blocked),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def run_onnxgrad_into_closed_pipe(*args: str, cwd: Path, timeout: float = 240):
    """``python -m onnxgrad ARGS`` whose standard output is a pipe the reader closes after
    the first line, as ``| head -1`` does: returns (status, that line, stderr)."""
    with tempfile.TemporaryDirectory() as blocked_folder, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "onnxgrad", *map(str, args)],
            cwd=cwd,
            env=command_environment(Path(blocked_folder)),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        first_line = process.stdout.readline()
        process.stdout.close()
        status = process.wait(timeout=timeout)
        err.seek(0)
        return status, first_line, err.read()


def command_environment(blocked_folder: Path, blocked: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a child ``onnxgrad``: this checkout first on the path, PyTorch and
    the packages ``blocked`` unimportable, matplotlib drawing off screen."""
    paths = [str(block_modules(blocked_folder, "torch", *blocked))]
    paths += [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    env["MPLBACKEND"] = "Agg"
    return env


def block_modules(folder: Path, *names: str) -> Path:
    """A folder whose packages ``names`` raise ImportError, as if they were not installed."""
    for name in names:
        package = folder / name
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(f"raise ImportError('{name} is blocked')\n")
    return folder


def run_in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``onnxgrad.cli.main(ARGS)`` in this process, seen as a finished process."""
    from onnxgrad.cli import main

    out, err = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main([str(a) for a in args])
            except SystemExit as exc:
                status = exc.code
    finally:
        os.chdir(previous)
        ort.set_default_logger_severity(2)
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def assert_failed(result: subprocess.CompletedProcess, status: int, *fragments: str) -> str:
    """The command failed with ``status`` and a single stderr line holding ``fragments``."""
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def run_model(model: onnx.ModelProto | str | Path, feeds: dict) -> dict[str, np.ndarray]:
    """Outputs by name, computed by onnxruntime."""
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path
