"""A rank-0 weight (a constant trained because it is named) keeps its shape in the runner."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.exceptions import ConvergenceError
from onnxgrad.training import LearningRateSGD, OrtGradientForwardBackwardOptimizer
from onnxgrad.training.losses import select_learning_loss

F = TensorProto.FLOAT


def _model():
    """``Y = (X * s) @ W`` with a rank-0 ``s``."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "s"], ["h"]), helper.make_node("MatMul", ["h", "W"], ["Y"])],
        "scaled",
        [helper.make_tensor_value_info("X", F, [None, 3])],
        [helper.make_tensor_value_info("Y", F, [None, 1])],
        [
            numpy_helper.from_array(np.array(1.0, np.float32), "s"),
            numpy_helper.from_array(np.array([[1.0], [-1.0], [0.5]], np.float32), "W"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _data(scale=1.0):
    X = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32) * scale
    return X, (X @ np.array([[2.0], [1.0], [0.0]], np.float32)).astype(np.float32)


def test_a_named_scalar_weight_is_trained_with_its_shape():
    X, y = _data()
    est = OrtGradientForwardBackwardOptimizer(
        _model(),
        weights_to_train=["s"],
        learning_rate=LearningRateSGD(eta0=0.05),
        learning_loss=select_learning_loss("squared_error", "mean"),
        max_iter=1,
        batch_size=8,
    )
    est.fit(X, y)
    W = np.array([[1.0], [-1.0], [0.5]])
    xw = X.astype(np.float64) @ W
    grad = 2 * np.mean((xw - y) * xw)  # d/ds mean((s x W - y)^2) at s = 1
    assert est.trained_coef_["s"].shape == ()
    assert float(est.trained_coef_["s"]) == pytest.approx(1.0 - 0.05 * grad, rel=1e-5)


def test_divergence_with_a_scalar_weight_raises_convergence_error():
    X, y = _data(scale=100.0)
    est = OrtGradientForwardBackwardOptimizer(
        _model(),
        weights_to_train=["s", "W"],
        learning_rate=LearningRateSGD(eta0=10.0),
        max_iter=5,
        batch_size=4,
    )
    with pytest.raises(ConvergenceError, match="diverged"):
        est.fit(X, y)
