"""``onnxgrad train --checkpoint/--resume`` in one process: a run stopped after some epochs
and resumed ends where the uninterrupted run ends (weights, printed curve); a checkpoint
whose data file changed is refused."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from tests.cli.helpers import run_in_process, save
from tests.models import linear_regression_model


def _workdir(tmp_path):
    save(linear_regression_model(np.zeros(2), np.zeros(1)), tmp_path / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((50, 2)).astype(np.float32)
    np.savez(tmp_path / "data.npz", X=X, y=(X @ [1.5, -2.0] + 0.25).astype(np.float32))
    return tmp_path


def train(workdir, epochs: int, output: str, *options):
    result = run_in_process(
        "train", "lr.onnx", "--data", "data.npz", "-o", output, "--optimizer", "adam",
        "--batch-size", "8", "--seed", "2", "--epochs", str(epochs), *options,
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    weights = onnx.load(workdir / output).graph.initializer
    return result.stdout, {i.name: numpy_helper.to_array(i) for i in weights}


def test_resumed_run_ends_as_the_uninterrupted_one(tmp_path):
    workdir = _workdir(tmp_path)
    straight, expected = train(workdir, 4, "straight.onnx")
    train(workdir, 2, "half.onnx", "--checkpoint", "ckpt.json")
    resumed, weights = train(workdir, 4, "resumed.onnx", "--checkpoint", "ckpt.json", "--resume")
    for name, value in expected.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    assert resumed.splitlines()[1:] == [
        line.replace("straight.onnx", "resumed.onnx") for line in straight.splitlines()[1:]
    ]


def test_a_changed_checkpoint_is_refused(tmp_path):
    workdir = _workdir(tmp_path)
    train(workdir, 1, "one.onnx", "--checkpoint", "ckpt.json")
    data = bytearray((workdir / "ckpt.bin").read_bytes())
    data[0] ^= 1
    (workdir / "ckpt.bin").write_bytes(bytes(data))
    result = run_in_process(
        "train", "lr.onnx", "--data", "data.npz", "-o", "two.onnx", "--epochs", "2",
        "--checkpoint", "ckpt.json", "--resume",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 2
    assert "do not match the progress file" in result.stderr


def test_resume_needs_a_checkpoint(tmp_path):
    workdir = _workdir(tmp_path)
    result = run_in_process(
        "train", "lr.onnx", "--data", "data.npz", "-o", "x.onnx", "--resume", cwd=workdir
    )
    assert result.returncode == 2
    assert "--resume needs --checkpoint" in result.stderr
