"""Progress of ``onnxgrad train`` as a user reads it: a bar in a terminal, one plain line
per epoch in a pipe or a log, never a bar over no epoch."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import tempfile
import termios
from pathlib import Path

import numpy as np
import pytest

from tests.cli.helpers import command_environment, run_onnxgrad, save
from tests.models import linear_regression_model

EPOCHS = 3


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("progress")
    save(linear_regression_model(np.zeros(2), np.zeros(1)), folder / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 2)).astype(np.float32)
    np.savez(folder / "data.npz", X=X, y=(X @ np.array([1.5, -2.0])).astype(np.float32))
    return folder


TRAIN = ("train", "lr.onnx", "--data", "data.npz", "-o", "trained.onnx", "--epochs", str(EPOCHS))


def _epoch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lstrip().startswith("epoch ")]


def test_in_a_pipe_each_epoch_is_one_plain_line(workdir):
    result = run_onnxgrad(*TRAIN, "--val-fraction", "0.25", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout + result.stderr
    assert "it/s" not in result.stderr and "0it" not in result.stderr
    lines = _epoch_lines(result.stdout)
    assert [line.split()[1] for line in lines] == [f"{k}/{EPOCHS}" for k in range(1, 4)]
    assert all("validation" in line for line in lines)


def _run_in_a_terminal(args, cwd: Path, timeout: float = 240) -> str:
    """``python -m onnxgrad ARGS`` with standard output and error on a pseudo-terminal:
    everything it wrote there."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with tempfile.TemporaryDirectory() as blocked:
        process = subprocess.Popen(
            [sys.executable, "-m", "onnxgrad", *args],
            cwd=cwd,
            env=command_environment(Path(blocked)),
            stdin=subprocess.DEVNULL,
            stdout=follower,
            stderr=follower,
        )
        os.close(follower)
        output = b""
        while True:
            ready, _, _ = select.select([leader], [], [], timeout)
            if not ready:
                process.kill()
                raise TimeoutError(output.decode(errors="replace"))
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
        assert process.wait(timeout) == 0, output.decode(errors="replace")
        os.close(leader)
    return output.decode(errors="replace")


def test_in_a_terminal_a_bar_then_each_epoch_once(workdir):
    output = _run_in_a_terminal(TRAIN, workdir)
    assert f"{EPOCHS}/{EPOCHS} [" in output  # the bar, drawn to its end
    assert "0it [" not in output  # no bar over the zero epochs of initialize()
    lines = _epoch_lines(output.replace("\r", "\n"))
    assert [line.split()[1] for line in lines] == [f"{k}/{EPOCHS}" for k in range(1, 4)]


def test_a_verbose_estimator_prints_one_line_per_epoch_outside_a_terminal(workdir):
    code = (
        "import numpy as np, onnx\n"
        "from onnxgrad import OrtGradientForwardBackwardOptimizer as Est\n"
        "d = np.load('data.npz')\n"
        "est = Est(onnx.load('lr.onnx'), max_iter=3, verbose=1, learning_rate=1e-3)\n"
        "est.initialize(d['X'], d['y'])\n"
        "est.fit(d['X'], d['y'])\n"
    )
    with tempfile.TemporaryDirectory() as blocked:
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=workdir,
            env=command_environment(Path(blocked)),
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "0it" not in result.stderr
    lines = _epoch_lines(result.stderr)
    assert [line.split()[1] for line in lines] == [f"{k}/3" for k in range(1, 4)]
    assert all(" loss " in line and " lr " in line for line in lines)
