"""The command at the edges: links and special files as outputs, Ctrl-C at any moment,
absurd picture sizes, broken pipes that are not standard output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.cli.helpers import (
    assert_failed,
    command_environment,
    run_in_process,
    run_model,
    run_onnxgrad,
    save,
)
from tests.models import linear_regression_model

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX files and signals")


@pytest.fixture
def workdir(tmp_path):
    save(linear_regression_model(np.array([1.0, 2.0]), np.array([0.5])), tmp_path / "lr.onnx")
    return tmp_path


def _gradient_is_right(model: onnx.ModelProto) -> None:
    x = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
    weights = {
        "coefs": np.array([[1.0], [2.0]], np.float32),
        "intercept": np.array([0.5], np.float32),
    }
    feeds = {"X": x, "Y_grad": np.ones((2, 1), np.float32), **weights}
    got = run_model(model, feeds)
    np.testing.assert_allclose(got["X_grad"], np.tile([1.0, 2.0], (2, 1)))
    np.testing.assert_allclose(got["coefs_grad"], x.sum(axis=0).reshape(2, 1))


def test_output_onto_a_link_writes_its_target(workdir):
    target = workdir / "real" / "grad.onnx"
    target.parent.mkdir()
    target.write_bytes(b"old")
    (workdir / "link.onnx").symlink_to(target)
    result = run_onnxgrad("derivative", "lr.onnx", "-o", "link.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert (workdir / "link.onnx").is_symlink()
    _gradient_is_right(onnx.load(target))
    assert sorted(p.name for p in target.parent.iterdir()) == ["grad.onnx"]


def test_output_onto_a_dangling_link_creates_its_target(workdir):
    (workdir / "link.onnx").symlink_to(workdir / "new.onnx")
    result = run_onnxgrad("derivative", "lr.onnx", "-o", "link.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert (workdir / "link.onnx").is_symlink()
    _gradient_is_right(onnx.load(workdir / "new.onnx"))


@pytest.mark.parametrize("through_link", [False, True])
def test_output_onto_a_fifo_writes_into_it(workdir, through_link):
    fifo = workdir / "pipe"
    os.mkfifo(fifo)
    output = fifo
    if through_link:
        output = workdir / "link.onnx"
        output.symlink_to(fifo)
    received = {}
    reader = threading.Thread(target=lambda: received.setdefault("data", fifo.read_bytes()))
    reader.start()
    result = run_onnxgrad("derivative", "lr.onnx", "-o", output.name, cwd=workdir)
    reader.join(timeout=60)
    assert result.returncode == 0, result.stderr
    assert fifo.is_fifo()
    _gradient_is_right(onnx.load_from_string(received["data"]))


def test_a_failed_write_into_a_fifo_sends_nothing(workdir):
    fifo = workdir / "pipe"
    os.mkfifo(fifo)
    result = run_onnxgrad("plot", "lr.onnx", "-o", "pipe.png", "--dpi", "100000", cwd=workdir)
    assert result.returncode == 2
    assert fifo.is_fifo()


def test_plot_with_a_huge_dpi_is_one_line(workdir):
    result = run_onnxgrad("plot", "lr.onnx", "-o", "g.png", "--dpi", "100000", cwd=workdir)
    assert_failed(result, 2, "--dpi 100000", "pixels")
    assert sorted(p.name for p in workdir.iterdir()) == ["lr.onnx"]


def _interrupted_run(
    workdir: Path, delay: float, after_imports: bool
) -> subprocess.CompletedProcess:
    """Run ``derivative`` and send SIGINT ``delay`` seconds after it starts, or after it
    has started importing its libraries (numpy's extension is mapped: onnxgrad's code runs)."""
    with tempfile.TemporaryDirectory() as blocked:
        process = subprocess.Popen(
            [sys.executable, "-m", "onnxgrad", "derivative", "lr.onnx", "-o", "out.onnx"],
            cwd=workdir,
            env=command_environment(Path(blocked)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,  # a test runner's worker may ignore SIGINT
        )
        if after_imports:
            _wait_for_numpy(process.pid)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    # once it has said so, a command may also end by SIGINT, which a shell shows as status
    # 128 + 2 = 130 too (the interpreter re-raises an interrupt it ends on)
    said = err.strip().endswith("interrupted")
    status = 130 if process.returncode == -signal.SIGINT and said else process.returncode
    return subprocess.CompletedProcess(process.args, status, out, err)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_numpy(pid: int, timeout: float = 120) -> None:
    maps = Path(f"/proc/{pid}/maps")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if "_multiarray_umath" in maps.read_text():
                return
        except OSError:  # the process ended
            return
        time.sleep(0.002)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_ctrl_c_at_any_moment_is_interrupted_130_and_no_file(workdir):
    """SIGINT during the imports, the work and the writing: status 130, one line, no file.
    A signal at the very start may also hit the interpreter's bootstrap (runpy, site, runpy
    importing the package) before the command's code runs: out of reach, but it must leave
    no file either."""
    moments = [(delay, False) for delay in (0.0, 0.05)]
    moments += [(delay, True) for delay in (0.0, 0.02, 0.1, 0.3, 0.6, 1.0, 2.0)]
    handled = 0
    for delay, after_imports in moments:
        result = _interrupted_run(workdir, delay, after_imports)
        output = workdir / "out.onnx"
        if result.returncode == 0:  # finished before the signal came
            _gradient_is_right(onnx.load(output))
            output.unlink()
        elif result.returncode == 130 or after_imports:
            assert_failed(result, 130, "interrupted")
            handled += after_imports
        else:  # the bootstrap: runpy or site, or runpy importing the onnxgrad package
            assert "onnxgrad/cli.py" not in result.stderr, (delay, result.stderr)
        assert sorted(p.name for p in workdir.iterdir()) == ["lr.onnx"], delay
    assert handled >= 3


def _interrupt_while_saving(monkeypatch, fail: bool) -> None:
    """Make the command's save_model receive a Ctrl-C, then write the file (or fail)."""
    import onnxgrad._files as files  # the command imports save_model from it as it runs

    real_save = files.save_model

    def save_with_ctrl_c(model, path):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs at the next bytecode boundary
        if fail:
            raise OSError(28, "No space left on device")
        real_save(model, path)

    monkeypatch.setattr(files, "save_model", save_with_ctrl_c)


def test_ctrl_c_while_the_result_is_written_leaves_a_success(workdir, monkeypatch):
    """A Ctrl-C during the last step (write the file, say so) does not make a written,
    announced file a failure: status 0, the file whole."""
    _interrupt_while_saving(monkeypatch, fail=False)
    result = run_in_process("derivative", "lr.onnx", "-o", "out.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrote ")
    _gradient_is_right(onnx.load(workdir / "out.onnx"))


def test_ctrl_c_while_a_failing_write_is_interrupted(workdir, monkeypatch):
    """A Ctrl-C held back during the last step is the outcome when the step fails: 130."""
    _interrupt_while_saving(monkeypatch, fail=True)
    result = run_in_process("derivative", "lr.onnx", "-o", "out.onnx", cwd=workdir)
    assert_failed(result, 130, "interrupted")
    assert sorted(p.name for p in workdir.iterdir()) == ["lr.onnx"]


def test_a_broken_pipe_that_is_not_stdout_is_a_failure(workdir, monkeypatch, capfd):
    import onnxgrad.cli as cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_info", broken)
    assert cli.main(["info", str(workdir / "lr.onnx")]) == 2
    assert "pipe closed unexpectedly" in capfd.readouterr().err


def test_an_unsorted_model_is_sorted_by_the_command(workdir):
    model = onnx.load(workdir / "lr.onnx")
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    save(model, workdir / "shuffled.onnx")
    result = run_in_process("derivative", "shuffled.onnx", "-o", "g.onnx", cwd=workdir)
    assert result.returncode == 0, result.stderr
    _gradient_is_right(onnx.load(workdir / "g.onnx"))
