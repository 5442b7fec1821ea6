"""Models exported with a fixed batch dimension of 1 trained with batches of 8: the batch
axis is made free once checked; a model that mixes rows is refused.

Reference: full-batch gradient descent in numpy on ``sum((tanh(x W + s V) - y)^2)`` (the
default reduction sums over the batch), with a learning rate :data:`LR` of 0.1 per row.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.training import LearningRateSGD, OrtGradientForwardBackwardOptimizer
from onnxgrad.training.running.batch_axis import free_batch_axis

RNG = np.random.default_rng(0)
W0 = RNG.normal(size=(3, 1))
V0 = RNG.normal(size=(2, 1))
X, S = RNG.normal(size=(8, 3)), RNG.normal(size=(8, 2))
Y = np.tanh(X @ np.array([1.0, 2.0, -1.0]) + S @ np.array([0.5, 0.5]))
#: 0.1 per row on the loss summed over the batch of all 8 rows
LR = 0.1 / len(X)


def batch_one_model(nodes, inputs=("x",), initializers=()):
    shapes = {"x": [1, 3], "s": [1, 2]}
    graph = helper.make_graph(
        nodes,
        "batch_one",
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, shapes[n]) for n in inputs],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 1])],
        [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(V0, "V"), *initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def tanh_model():
    return batch_one_model(
        [
            helper.make_node("MatMul", ["x", "W"], ["a"]),
            helper.make_node("MatMul", ["s", "V"], ["b"]),
            helper.make_node("Add", ["a", "b"], ["h"]),
            helper.make_node("Tanh", ["h"], ["y"]),
        ],
        inputs=("x", "s"),
    )


def numpy_descent(lr, epochs):
    W, V = W0.copy(), V0.copy()
    for _ in range(epochs):
        t = np.tanh(X @ W + S @ V)
        d = 2 * (t[:, 0] - Y)[:, None] * (1 - t**2)
        W, V = W - lr * X.T @ d, V - lr * S.T @ d
    return W, V


def estimator(model, **kwargs):
    sgd = LearningRateSGD(LR, learning_rate="constant")
    return OrtGradientForwardBackwardOptimizer(
        model, **{"max_iter": 3, "batch_size": 8, "learning_rate": sgd, **kwargs}
    )


def test_batch_one_model_trains_with_batches_of_eight():
    est = estimator(tanh_model()).fit(X, Y, feeds={"s": S})
    W, V = numpy_descent(LR, 3)
    np.testing.assert_allclose(est.get_state()["W"], W, rtol=1e-10)
    np.testing.assert_allclose(est.get_state()["V"], V, rtol=1e-10)
    expected = np.tanh(X[:5] @ W + S[:5] @ V)
    np.testing.assert_allclose(est.predict({"x": X[:5], "s": S[:5]}), expected, rtol=1e-10)
    restored = pickle.loads(pickle.dumps(est))
    np.testing.assert_allclose(restored.predict(X[:5], feeds={"s": S[:5]}), expected, rtol=1e-10)
    # the trained model keeps the batch dimension it was exported with
    trained = est.get_trained_onnx()
    assert trained.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1


def test_a_model_mixing_rows_is_refused():
    model = batch_one_model(
        [
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=1),
            helper.make_node("Add", ["x", "total"], ["z"]),
            helper.make_node("MatMul", ["z", "W"], ["y"]),
        ]
    )
    with pytest.raises(ValueError, match=r"'y' on 4 rows at once differs.*the model mixes rows"):
        estimator(model).fit(X, Y)


def test_a_constant_reshape_over_the_batch_is_refused():
    shape = numpy_helper.from_array(np.array([1, -1], dtype=np.int64), "shape")
    model = batch_one_model(
        [
            helper.make_node("Reshape", ["x", "shape"], ["z"]),
            helper.make_node("MatMul", ["z", "W"], ["y"]),
        ],
        initializers=[shape],
    )
    with pytest.raises(ValueError, match=r"fixed batch dimension 1 .* output 'y' gets the shape"):
        free_batch_axis(model, {"x": X})


def test_a_free_batch_axis_is_left_alone():
    model = tanh_model()
    for info in model.graph.input:
        info.type.tensor_type.shape.dim[0].dim_param = "batch"
    assert free_batch_axis(model, {"x": X, "s": S}) is model
