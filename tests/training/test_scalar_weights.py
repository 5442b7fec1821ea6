"""0-d (scalar) float weights through the runner, the estimators, checkpoints and artifacts.

The model is ``f(x) = (x @ W) * s`` with a 0-d weight ``s``; the reference is plain
gradient descent in numpy on the squared error summed over the batch (the default reduction),
with a learning rate :data:`LR` of 0.05 per row.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from onnx import helper, numpy_helper

from onnxgrad import ConvergenceError
from onnxgrad.training import LearningRateSGD, OrtGradientForwardBackwardOptimizer
from onnxgrad.training.artifacts.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxgrad.training.artifacts.generate import (
    generate_artifacts,
    load_train_step,
    merge_checkpoint,
)
from onnxgrad.training.running.data import OrtDataLoader, to_ortvalue
from onnxgrad.training.running.devices import check_device
from onnxgrad.training.running.runner import TrainingRunner
from onnxgrad.training.step.composition import make_train_step

W0 = np.array([[0.1], [0.2], [0.3]])
S0 = 0.5
#: 0.05 per row on the loss summed over a batch of 40 rows
LR = 0.05 / 40


def scalar_weight_model(dtype=np.float64):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["t"]), helper.make_node("Mul", ["t", "s"], ["Y"])],
        "scalar_weight",
        [helper.make_tensor_value_info("X", elem, ["N", 3])],
        [helper.make_tensor_value_info("Y", elem, ["N", 1])],
        [
            numpy_helper.from_array(W0.astype(dtype), "W"),
            numpy_helper.from_array(np.array(S0, dtype=dtype), "s"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def data(n=40, dtype=np.float64):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 3)).astype(dtype)
    return X, (X @ np.array([1.0, -2.0, 0.5])).astype(dtype)


def numpy_descent(X, y, lr, epochs):
    """Full-batch gradient descent on ``sum((X W s - y)^2)``."""
    W, s = W0.copy(), S0
    for _ in range(epochs):
        t = X @ W
        d = 2 * (t[:, 0] * s - y)
        W, s = W - lr * s * (X.T @ d)[:, None], s - lr * float(d @ t[:, 0])
    return W, s


def estimator(model, **kwargs):
    params = dict(
        max_iter=5, batch_size=40, learning_rate=LearningRateSGD(LR, learning_rate="constant")
    )
    return OrtGradientForwardBackwardOptimizer(model, **{**params, **kwargs})


def test_ortvalue_of_a_0d_array_is_0d():
    assert to_ortvalue(np.array(1.5, dtype=np.float32), check_device("cpu")).shape() == []


def test_fit_matches_numpy_gradient_descent():
    X, y = data()
    est = estimator(scalar_weight_model()).fit(X, y)
    state = est.get_state()
    W, s = numpy_descent(X, y, LR, 5)
    assert state["s"].shape == () and state["W"].shape == (3, 1)
    np.testing.assert_allclose(state["W"], W, rtol=1e-10)
    np.testing.assert_allclose(state["s"], s, rtol=1e-10)


def test_state_round_trips_and_fits_again():
    X, y = data()
    est = estimator(scalar_weight_model(), learning_rate="Adam", random_state=0).fit(X, y)
    full = est.get_full_state()
    est.set_state(full)
    assert all(np.array_equal(v, est.get_full_state()[k]) for k, v in full.items())
    assert est.get_full_state()["s_m"].shape == ()
    est.set_state({"s": np.array(2.0)})
    assert est.get_state()["s"] == 2.0
    first = est.fit(X, y).get_state()
    again = est.fit(X, y).get_state()
    np.testing.assert_array_equal(first["s"], again["s"])
    est.set_params(warm_start=True).partial_fit(X, y)
    restored = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(restored.get_state()["s"], est.get_state()["s"])
    restored.fit(X, y)
    assert restored.get_state()["s"].shape == ()


def test_diverging_fit_raises_convergence_error_and_keeps_finite_weights():
    X, y = data()
    est = estimator(scalar_weight_model(np.float32), learning_rate=1e4, max_iter=50)
    with pytest.raises(ConvergenceError, match="diverged"):
        est.fit(X.astype(np.float32), 1e6 * y)
    state = est.get_state()
    assert state["s"].shape == () and np.isfinite(state["s"])


def test_per_weight_runner_keeps_a_0d_weight():
    X, y = data()
    step = make_train_step(
        scalar_weight_model(), learning_rate=LearningRateSGD(LR, learning_rate="constant")
    )
    runner = TrainingRunner(step, check_device("cpu"), {"W": W0, "s": np.array(S0)})
    runner.run_epoch(OrtDataLoader(X, y[:, None], batch_size=40), LR)
    W, s = numpy_descent(X, y, LR, 1)
    np.testing.assert_allclose(runner.get_weights()["W"], W, rtol=1e-10)
    np.testing.assert_allclose(runner.get_weights()["s"], s, rtol=1e-10)
    runner.set_values({"s": np.array(3.0)})
    assert runner.get_weights()["s"].shape == ()


def test_checkpoint_keeps_0d_tensors(tmp_path):
    path = tmp_path / "c.json"
    save_checkpoint(Checkpoint({"s": np.array(1.25, np.float32)}, {"s_m": np.array(0.0)}), path)
    loaded = load_checkpoint(path)
    assert loaded.weights["s"].shape == () and loaded.weights["s"] == np.float32(1.25)
    assert loaded.optimizer_state["s_m"].shape == ()


def test_artifacts_train_and_merge_a_0d_weight(tmp_path):
    X, y = data(dtype=np.float32)
    artifacts = generate_artifacts(
        scalar_weight_model(np.float32), optimizer="sgd", learning_rate=LR, folder=tmp_path
    )
    checkpoint = load_checkpoint(artifacts.path("checkpoint.json"))
    assert checkpoint.weights["s"].shape == ()
    runner = TrainingRunner(load_train_step(tmp_path), check_device("cpu"), checkpoint.weights)
    runner.run_epoch(OrtDataLoader(X, y[:, None], batch_size=40), LR)
    _, s = numpy_descent(X.astype(np.float64), y.astype(np.float64), LR, 1)
    np.testing.assert_allclose(runner.get_weights()["s"], s, rtol=1e-5)
    save_checkpoint(Checkpoint(runner.get_weights(), runner.get_state()), tmp_path / "t.json")
    merged = merge_checkpoint(tmp_path, tmp_path / "t.json")
    s_init = next(i for i in merged.graph.initializer if i.name == "s")
    assert list(s_init.dims) == []
    np.testing.assert_allclose(numpy_helper.to_array(s_init), s, rtol=1e-5)
