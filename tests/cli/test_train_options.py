"""``onnxgrad train`` options: starting loss, penalty, trained weights, reduction, validation
rows and the loss curve, each against a numpy computation of the same steps."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.cli.helpers import run_in_process, save
from tests.models import linear_regression_model


@pytest.fixture
def workdir(tmp_path):
    save(linear_regression_model(np.zeros(2), np.zeros(1)), tmp_path / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 2)).astype(np.float32)
    y = (X @ np.array([1.5, -2.0]) + 0.25).astype(np.float32)
    np.savez(tmp_path / "data.npz", X=X, y=y)
    return tmp_path


def train(workdir, *options):
    result = run_in_process(
        "train", "lr.onnx", "--data", "data.npz", "-o", "trained.onnx", "--optimizer", "sgd",
        "--lr", "0.1", "--batch-size", "64", "--reduction", "mean", *options,
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    weights = onnx.load(workdir / "trained.onnx").graph.initializer
    return result.stdout, {i.name: numpy_helper.to_array(i) for i in weights}


def full_batch_sgd(X, y, epochs, lr, l2=0.0, reduction="mean", train_bias=True):
    """``w <- w - lr (dL/dw + 2 l2 w)``, L the squared error over the batch."""
    A = np.hstack([X, np.ones((len(X), 1))]).astype(np.float64)
    w = np.zeros(3)
    for _ in range(epochs):
        g = 2 * A.T @ (A @ w - y) / (len(A) if reduction == "mean" else 1) + 2 * l2 * w
        if not train_bias:
            g[2] = 0
        w = w - lr * g
    return w


def data(workdir):
    arrays = np.load(workdir / "data.npz")
    return arrays["X"], arrays["y"]


def test_prints_the_starting_loss(workdir):
    out, _ = train(workdir, "--epochs", "2")
    _, y = data(workdir)
    start = float(re.search(r"starting loss (\S+)", out).group(1))
    assert start == pytest.approx(np.mean(y.astype(np.float64) ** 2), rel=1e-5)


def test_penalty_and_chosen_weights(workdir):
    X, y = data(workdir)
    _, weights = train(workdir, "--epochs", "3", "--penalty", "l2:0.5", "--weights", "coefs")
    expected = full_batch_sgd(X, y, 3, 0.1, l2=0.5, train_bias=False)
    np.testing.assert_allclose(weights["coefs"].ravel(), expected[:2], rtol=1e-4)
    assert weights["intercept"].tolist() == [0.0]


def test_sum_reduction(workdir):
    X, y = data(workdir)
    _, weights = train(workdir, "--epochs", "2", "--reduction", "sum", "--lr", "0.001")
    expected = full_batch_sgd(X, y, 2, 0.001, reduction="sum")
    np.testing.assert_allclose(weights["coefs"].ravel(), expected[:2], rtol=1e-4)


def test_validation_rows_and_csv_curve(workdir):
    X, y = data(workdir)
    out, weights = train(workdir, "--epochs", "4", "--val-fraction", "0.25", "--curve", "c.csv")
    held = np.sort(np.random.default_rng(0).permutation(64)[:16])
    kept = np.setdiff1d(np.arange(64), held)
    expected = full_batch_sgd(X[kept], y[kept], 4, 0.1)
    np.testing.assert_allclose(weights["coefs"].ravel(), expected[:2], rtol=1e-4)
    residual = X[held] @ weights["coefs"] + weights["intercept"] - y[held, None]
    last = float(re.findall(r"validation (\S+)", out)[-1])
    assert last == pytest.approx(np.mean(residual.astype(np.float64) ** 2), rel=1e-4)
    lines = (workdir / "c.csv").read_text().splitlines()
    assert lines[0] == "epoch,train,validation" and len(lines) == 6
    assert float(lines[1].split(",")[1]) == pytest.approx(np.mean(y[kept] ** 2), rel=1e-5)
    assert float(lines[-1].split(",")[2]) == pytest.approx(last, rel=1e-5)


def test_png_curve(workdir):
    pytest.importorskip("matplotlib")
    out, _ = train(workdir, "--epochs", "2", "--curve", "curve.png")
    assert "wrote curve.png" in out
    assert (workdir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["square_error", "squared_error", "l2", "mse"])
def test_train_and_add_loss_accept_the_same_names(workdir, name):
    train(workdir, "--epochs", "1", "--loss", name)
    result = run_in_process("add-loss", "lr.onnx", "-o", "l.onnx", "--score", name, cwd=workdir)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("option", [("--recompute", "none"), ("--recompute", "auto")])
def test_recompute_choices_train_the_same_weights(workdir, option):
    """``--recompute`` changes what the backward keeps, never the weights (the default,
    ``attention``, has no attention to tile here)."""
    _, default = train(workdir, "--epochs", "3")
    _, chosen = train(workdir, "--epochs", "3", *option)
    for name, value in default.items():
        np.testing.assert_allclose(chosen[name], value, rtol=1e-6)


def test_derivative_tiles_an_attention_on_request(tmp_path):
    from tests.derivative.test_attention_tiles import attention_model

    model = attention_model("causal", np.float32)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "sequence"
    model.graph.ClearField("value_info")
    model.graph.initializer.remove(next(i for i in model.graph.initializer if i.name == "mask"))
    model.graph.node.remove(next(n for n in model.graph.node if "mask" in n.input))
    next(n for n in model.graph.node if n.op_type == "Softmax").input[0] = "s1"
    save(model, tmp_path / "attention.onnx")
    loops = {}
    for mode in ("none", "attention"):
        result = run_in_process(
            "derivative", "attention.onnx", "-o", f"{mode}.onnx", "--recompute", mode,
            cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        ops = [n.op_type for n in onnx.load(tmp_path / f"{mode}.onnx").graph.node]
        loops[mode] = ops.count("Loop")
    assert loops == {"none": 0, "attention": 2}
