"""``onnxgrad train`` and ``onnxgrad demo``: trained weights against numpy's least squares,
the demo's gradient graph against a numpy backpropagation, its printed fit against R²
recomputed from the files it wrote."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.cli.helpers import assert_failed, run_in_process, run_model, run_onnxgrad, save
from tests.models import linear_regression_model

TRUE_COEF = np.array([1.5, -2.0])
TRUE_BIAS = 0.25


@pytest.fixture
def workdir(tmp_path):
    save(linear_regression_model(np.zeros(2), np.zeros(1)), tmp_path / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((256, 2))
    y = X @ TRUE_COEF + TRUE_BIAS + 0.01 * rng.standard_normal(256)
    np.savez(tmp_path / "data.npz", X=X, y=y)  # float64: the command casts to the model's
    return tmp_path


def _least_squares(workdir):
    data = np.load(workdir / "data.npz")
    A = np.hstack([data["X"], np.ones((len(data["X"]), 1))])
    solution, *_ = np.linalg.lstsq(A, data["y"], rcond=None)
    return solution[:2], solution[2]


def _weights(path):
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}


@pytest.mark.parametrize(
    ("optimizer", "lr", "epochs", "in_process"),
    [("nesterov", "0.02", "30", False), ("sgd", "0.05", "40", True), ("adam", "0.05", "60", True)],
)
def test_train_reaches_least_squares(workdir, optimizer, lr, epochs, in_process):
    before = (workdir / "lr.onnx").read_bytes()
    run = run_in_process if in_process else run_onnxgrad
    result = run(
        "train", "lr.onnx", "--data", "data.npz", "-o", "trained.onnx",
        "--optimizer", optimizer, "--lr", lr, "--epochs", epochs, "--batch-size", "16",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (workdir / "lr.onnx").read_bytes() == before
    losses = [float(v) for v in re.findall(r"^epoch .* loss (\S+)", result.stdout, re.M)]
    assert len(losses) == int(epochs) and losses[-1] < losses[0]
    trained = onnx.load(workdir / "trained.onnx")
    onnx.checker.check_model(trained, full_check=True)
    assert [n.op_type for n in trained.graph.node] == ["MatMul", "Add"]
    coef, bias = _least_squares(workdir)
    weights = _weights(workdir / "trained.onnx")
    np.testing.assert_allclose(weights["coefs"].ravel(), coef, atol=2e-2)
    np.testing.assert_allclose(weights["intercept"], [bias], atol=2e-2)


def _full_batch_momentum(X, y, epochs, lr, momentum, nesterov):
    """numpy reference: ``epochs`` steps on the squared error summed over all rows, with
    ``v <- mu v - lr g`` then ``w <- w + mu v - lr g`` (Nesterov) or ``w <- w + v``."""
    A = np.hstack([X, np.ones((len(X), 1))]).astype(np.float64)
    w, v = np.zeros(A.shape[1]), np.zeros(A.shape[1])
    for _ in range(epochs):
        g = 2 * A.T @ (A @ w - y)
        v = momentum * v - lr * g
        w = w + (momentum * v - lr * g if nesterov else v)
    return w


@pytest.mark.parametrize(
    ("optimizer", "lr_option", "lr", "momentum", "nesterov"),
    [
        ("momentum", ["--lr", "0.001"], 0.001, 0.9, False),
        ("nesterov", ["--lr", "0.001"], 0.001, 0.9, True),
        ("sgd", [], None, 0.0, False),
    ],
)
def test_train_optimizer_steps_match_numpy(workdir, optimizer, lr_option, lr, momentum, nesterov):
    """One batch per epoch, so the shuffling does not matter; no --lr is the default
    0.01 / batch size (the summed loss's gradient grows with the batch)."""
    data = np.load(workdir / "data.npz")
    X, y = data["X"].astype(np.float32), data["y"].astype(np.float32)
    lr = 0.01 / len(X) if lr is None else lr
    result = run_in_process(
        "train", "lr.onnx", "--data", "data.npz", "-o", "trained.onnx",
        "--optimizer", optimizer, *lr_option, "--epochs", "3", "--batch-size", str(len(X)),
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    expected = _full_batch_momentum(X, y, 3, lr, momentum, nesterov)
    weights = _weights(workdir / "trained.onnx")
    np.testing.assert_allclose(weights["coefs"].ravel(), expected[:2], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(weights["intercept"], expected[2:], rtol=1e-4, atol=1e-6)


def test_train_absolute_error_loss(workdir):
    result = run_in_process(
        "train", "lr.onnx", "--data", "data.npz", "-o", "trained.onnx",
        "--loss", "absolute_error", "--optimizer", "adam", "--lr", "0.05", "--epochs", "60",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    weights = _weights(workdir / "trained.onnx")
    np.testing.assert_allclose(weights["coefs"].ravel(), TRUE_COEF, atol=5e-2)


def _mlp_forward_backward(weights, X, y):
    """numpy float64 reference: loss = sum (mlp(X) - y)^2 and its gradient by hand."""
    W = [weights[f"coefficient{k}"].astype(np.float64) for k in range(3)]
    b = [weights[f"intercept{k}"].astype(np.float64) for k in range(3)]
    a1 = X @ W[0] + b[0]
    h1 = np.maximum(a1, 0)
    a2 = h1 @ W[1] + b[1]
    h2 = np.maximum(a2, 0)
    out = h2 @ W[2] + b[2]
    d_out = 2 * (out - y)
    d_a2 = (d_out @ W[2].T) * (a2 > 0)
    d_a1 = (d_a2 @ W[1].T) * (a1 > 0)
    grads = {
        "coefficient2": h2.T @ d_out,
        "intercept2": d_out.sum(axis=0),
        "coefficient1": h1.T @ d_a2,
        "intercept1": d_a2.sum(axis=0),
        "coefficient0": X.T @ d_a1,
        "intercept0": d_a1.sum(axis=0),
    }
    return np.sum((out - y) ** 2), grads


def test_demo_without_scikit_learn_or_matplotlib(tmp_path):
    result = run_onnxgrad(
        "demo", "-o", "demo", "--epochs", "4", cwd=tmp_path, blocked=("sklearn", "matplotlib")
    )
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "demo"
    names = {"mlp", "mlp_gradient", "mlp_train_step", "mlp_trained"}
    assert {p.name for p in folder.iterdir()} == {f"{n}.onnx" for n in names} | {"loss_curve.csv"}
    printed = [float(v) for v in re.findall(r"^epoch +\d+/4 +loss (\S+)", result.stdout, re.M)]
    rows = np.loadtxt(folder / "loss_curve.csv", delimiter=",", skiprows=1)
    np.testing.assert_array_equal(rows[:, 0], [1, 2, 3, 4])
    np.testing.assert_allclose(rows[:, 1], printed, atol=1e-5)
    assert "\r" not in result.stderr  # no progress bar in a pipe: the epoch lines above

    from onnxgrad.demo import make_regression_data

    X, y = make_regression_data()
    X_test, y_test = X[800:], y[800:].astype(np.float64)
    prediction = run_model(folder / "mlp_trained.onnx", {"X": X_test})["Y"].astype(np.float64)
    r2 = 1 - np.sum((y_test - prediction) ** 2) / np.sum((y_test - y_test.mean()) ** 2)
    printed_r2 = float(re.search(r"held-out R2: (\S+)", result.stdout).group(1))
    assert printed_r2 == pytest.approx(r2, abs=1e-4)
    assert r2 > 0.5

    weights = _weights(folder / "mlp_trained.onnx")
    assert _weights(folder / "mlp.onnx").keys() == weights.keys()
    batch_X, batch_y = X[:32], y[:32]
    gradient = run_model(folder / "mlp_gradient.onnx", {"X": batch_X, "label": batch_y, **weights})
    loss, expected = _mlp_forward_backward(weights, batch_X.astype(np.float64), batch_y)
    np.testing.assert_allclose(gradient["loss"], loss, rtol=1e-4)
    for name, value in expected.items():
        np.testing.assert_allclose(gradient[f"{name}_grad"], value, rtol=1e-3, atol=1e-4)


def test_demo_draws_the_loss_curve_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    result = run_in_process("demo", "-o", "demo", "--epochs", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "demo" / "loss_curve.csv").exists()


def test_demo_refuses_a_file_as_folder(tmp_path):
    (tmp_path / "taken").write_text("x")
    result = run_in_process("demo", "-o", "taken", "--epochs", "1", cwd=tmp_path)
    assert_failed(result, 2, "'taken' exists and is not a folder")


def test_demo_does_not_import_the_command_line():
    """The file helpers live in onnxgrad._files, so demo and cli do not import each other."""
    code = "import sys, onnxgrad.demo; print('onnxgrad.cli' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
