"""``onnxgrad train`` with no --optimizer and no --lr: Adam at 0.003, chosen by
benchmarks/bench_defaults.py; checked against numpy's Adam and on a small CNN classifier."""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.cli.helpers import run_in_process, run_model, save
from tests.models import linear_regression_model


def _numpy_adam(X, y, steps, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    """Full-batch Adam on the summed squared error of ``y ~ X w + b`` from zeros."""
    A = np.hstack([X, np.ones((len(X), 1))]).astype(np.float64)
    w, m, v = np.zeros(A.shape[1]), np.zeros(A.shape[1]), np.zeros(A.shape[1])
    for k in range(1, steps + 1):
        g = 2 * A.T @ (A @ w - y)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        w = w - lr * (m / (1 - beta1**k)) / (np.sqrt(v / (1 - beta2**k)) + eps)
    return w


def test_the_default_optimizer_is_adam_at_0_003(tmp_path):
    save(linear_regression_model(np.zeros(2), np.zeros(1)), tmp_path / "lr.onnx")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 2)).astype(np.float32)
    y = (X @ np.array([1.5, -2.0]) + 0.25).astype(np.float32)
    np.savez(tmp_path / "data.npz", X=X, y=y)
    result = run_in_process(
        "train", "lr.onnx", "--data", "data.npz", "-o", "trained.onnx", "--epochs", "5",
        "--batch-size", "64", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trained = {
        i.name: numpy_helper.to_array(i)
        for i in onnx.load(tmp_path / "trained.onnx").graph.initializer
    }
    expected = _numpy_adam(X, y.astype(np.float64), 5, 0.003)
    np.testing.assert_allclose(trained["coefs"].ravel(), expected[:2], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(trained["intercept"], expected[2:], rtol=1e-4, atol=1e-6)


def _cnn(classes: int, rng) -> onnx.ModelProto:
    """Conv(1->8, 3x3) ReLU MaxPool Conv(8->16) ReLU MaxPool Flatten Gemm: logits of 8x8
    images, weights drawn as PyTorch's default initialisation does (uniform, 1/sqrt(fan in))."""

    def uniform(name, shape, fan_in):
        bound = 1 / np.sqrt(fan_in)
        return numpy_helper.from_array(rng.uniform(-bound, bound, shape).astype(np.float32), name)

    weights = [
        uniform("c1", (8, 1, 3, 3), 9), uniform("b1", (8,), 9),
        uniform("c2", (16, 8, 3, 3), 72), uniform("b2", (16,), 72),
        uniform("fc", (classes, 64), 64), uniform("fb", (classes,), 64),
    ]  # fmt: skip
    pads = {"pads": [1, 1, 1, 1]}
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node("Conv", ["x", "c1", "b1"], ["h1"], **pads),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], **pool),
        helper.make_node("Conv", ["p1", "c2", "b2"], ["h2"], **pads),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], **pool),
        helper.make_node("Flatten", ["p2"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fb"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_small_cnn_classifier_trains_with_the_defaults(tmp_path):
    """3 digits of scikit-learn's set, 240 training rows, the default 10 epochs."""
    from sklearn.datasets import load_digits

    X, y = load_digits(n_class=3, return_X_y=True)
    X = (X / 16).astype(np.float32).reshape(-1, 1, 8, 8)
    order = np.random.default_rng(0).permutation(len(X))
    train, test = order[:240], order[240:]
    save(_cnn(3, np.random.default_rng(0)), tmp_path / "cnn.onnx")
    np.savez(tmp_path / "data.npz", X=X[train], y=y[train].astype(np.int64))
    result = run_in_process(
        "train", "cnn.onnx", "--data", "data.npz", "-o", "trained.onnx",
        "--loss", "cross_entropy_logits", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    start = float(re.search(r"starting loss (\S+)", result.stdout).group(1))
    last = float(re.findall(r"epoch +10/10 +loss (\S+)", result.stdout)[0])
    assert last < 0.2 * start, result.stdout
    logits = run_model(tmp_path / "trained.onnx", {"x": X[test]})["logits"]
    assert np.mean(logits.argmax(axis=1) == y[test]) >= 0.9
