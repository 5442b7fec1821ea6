"""Models with inputs besides X: per-row arrays batched with X and fixed feeds, through
``fit``/``predict``/``score`` and ``onnxgrad train --feed``.

The model is ``y = sr * (x W + state V + offset)`` with a per-row ``state [N, 2]``, an int64
0-d sample rate ``sr`` and a fixed ``offset [1, 1]``; the reference is full-batch gradient
descent in numpy on the squared error summed over the batch (the default reduction), with a
learning rate :data:`LR` of 0.02 per row.
"""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.training import LearningRateSGD, OrtGradientForwardBackwardOptimizer
from tests.cli.helpers import run_in_process, save

RNG = np.random.default_rng(0)
W0, V0 = RNG.normal(size=(3, 1)), RNG.normal(size=(2, 1))
X, STATE, Y = RNG.normal(size=(24, 3)), RNG.normal(size=(24, 2)), RNG.normal(size=24)
OFFSET = np.array([[0.25]])
#: 0.02 per row on the loss summed over the batch of all 24 rows
LR = 0.02 / len(X)


def two_input_model(dtype=np.float64):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"]),
        helper.make_node("MatMul", ["state", "V"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Add", ["c", "offset"], ["d"]),
        helper.make_node("Cast", ["sr"], ["srf"], to=elem),
        helper.make_node("Mul", ["d", "srf"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "two_inputs",
        [
            helper.make_tensor_value_info("x", elem, ["N", 3]),
            helper.make_tensor_value_info("state", elem, ["N", 2]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
            helper.make_tensor_value_info("offset", elem, [1, 1]),
        ],
        [helper.make_tensor_value_info("y", elem, ["N", 1])],
        [
            numpy_helper.from_array(W0.astype(dtype), "W"),
            numpy_helper.from_array(V0.astype(dtype), "V"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def forward(W, V, x, state, sr):
    return sr * (x @ W + state @ V + OFFSET)


def numpy_descent(sr, lr, epochs):
    W, V = W0.copy(), V0.copy()
    for _ in range(epochs):
        d = 2 * (forward(W, V, X, STATE, sr)[:, 0] - Y)[:, None] * sr
        W, V = W - lr * X.T @ d, V - lr * STATE.T @ d
    return W, V


def estimator(**kwargs):
    sgd = LearningRateSGD(LR, learning_rate="constant")
    params = {"max_iter": 4, "batch_size": len(X), "learning_rate": sgd, **kwargs}
    return OrtGradientForwardBackwardOptimizer(two_input_model(), **params)


@pytest.mark.parametrize("as_dict", [False, True])
def test_fit_with_per_row_and_fixed_feeds_matches_numpy(as_dict):
    fixed = {"sr": np.array(2), "offset": OFFSET}
    if as_dict:
        est = estimator().fit({"x": X, "state": STATE}, Y, feeds=fixed)
    else:
        est = estimator().fit(X, Y, feeds={**fixed, "state": STATE})
    W, V = numpy_descent(2, LR, 4)
    np.testing.assert_allclose(est.get_state()["W"], W, rtol=1e-10)
    np.testing.assert_allclose(est.get_state()["V"], V, rtol=1e-10)
    assert sorted(est.runner_.feeds.arrays) == ["offset", "sr"]
    expected = forward(W, V, X[:5], STATE[:5], 2)
    np.testing.assert_allclose(est.predict(X[:5], feeds={"state": STATE[:5]}), expected)
    np.testing.assert_allclose(est.predict({"x": X[:5], "state": STATE[:5]}), expected)
    # a fixed feed given at prediction replaces the fit's for that call only
    tripled = forward(W, V, X[:5], STATE[:5], 3)
    np.testing.assert_allclose(est.predict(X[:5], feeds={"state": STATE[:5], "sr": 3}), tripled)
    sse = np.sum((forward(W, V, X, STATE, 2)[:, 0] - Y) ** 2)
    assert est.score(X, Y, feeds={"state": STATE}) == pytest.approx(-sse, rel=1e-10)
    losses = est.losses(X[:3], Y[:3], feeds={"state": STATE[:3]})
    rows = (forward(W, V, X[:3], STATE[:3], 2)[:, 0] - Y[:3]) ** 2
    np.testing.assert_allclose(losses, rows, rtol=1e-10)
    restored = pickle.loads(pickle.dumps(est))
    np.testing.assert_allclose(restored.predict(X[:5], feeds={"state": STATE[:5]}), expected)


def test_minibatches_select_the_same_rows_of_every_per_row_input():
    fixed = {"sr": np.array(1), "offset": OFFSET}
    # 0.05 per row on the loss summed over batches of 5 rows
    est = estimator(batch_size=5, max_iter=30, learning_rate=LearningRateSGD(0.05 / 5))
    est.fit(X, Y, feeds={**fixed, "state": STATE})
    # the target is linear in (x, state): a mix-up of rows would leave the loss high
    W, *_ = np.linalg.lstsq(np.hstack([X, STATE, np.ones((24, 1))]), Y, rcond=None)
    best = np.mean((np.hstack([X, STATE, np.ones((24, 1))]) @ W - Y) ** 2)
    start = np.mean((forward(W0, V0, X, STATE, 1)[:, 0] - Y) ** 2)
    mse = -est.score(X, Y, feeds={"state": STATE}) / len(X)
    assert mse < best + 0.2 * (start - best)


def test_warm_fits_keep_the_fixed_feeds():
    est = estimator(warm_start=True)
    est.fit(X, Y, feeds={"sr": 2, "offset": OFFSET, "state": STATE})
    est.fit(X, Y, feeds={"state": STATE})
    W, _ = numpy_descent(2, LR, 8)
    np.testing.assert_allclose(est.get_state()["W"], W, rtol=1e-10)


def test_feed_errors_name_the_input():
    with pytest.raises(ValueError, match=r"inputs \['state', 'sr', 'offset'\] have no value"):
        estimator().fit(np.zeros((4, 3)), np.zeros(4))
    with pytest.raises(ValueError, match=r"inputs \['offset'\] have no value"):
        estimator().fit(X, Y, feeds={"sr": 2, "state": STATE})
    with pytest.raises(ValueError, match=r"feeds names \['rate'\]"):
        estimator().fit(X, Y, feeds={"rate": 2})
    with pytest.raises(ValueError, match=r"feed 'offset' has shape \[2\], the input declares"):
        estimator().fit(X, Y, feeds={"sr": 2, "state": STATE, "offset": np.ones(2)})
    with pytest.raises(ValueError, match=r"feed 'sr' does not fit the input's type int64"):
        estimator().fit(X, Y, feeds={"sr": 2.5, "state": STATE, "offset": OFFSET})


def test_cli_train_with_feeds(tmp_path):
    model = two_input_model(np.float32)
    save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "data.npz", X=X.astype(np.float32), y=Y.astype(np.float32))
    np.save(tmp_path / "state.npy", STATE.astype(np.float32))
    np.save(tmp_path / "sr.npy", np.array(2, dtype=np.int64))
    np.save(tmp_path / "offset.npy", OFFSET.astype(np.float32))
    result = run_in_process(
        "train", "m.onnx", "--data", "data.npz", "-o", "t.onnx", "--optimizer", "sgd",
        "--lr", repr(LR), "--batch-size", "24", "--epochs", "4",
        "--feed", "state=state.npy", "--feed", "sr=sr.npy", "--feed", "offset=offset.npy",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trained = {
        i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "t.onnx").graph.initializer
    }
    W, V = numpy_descent(2, LR, 4)
    np.testing.assert_allclose(trained["W"], W, rtol=2e-4)
    np.testing.assert_allclose(trained["V"], V, rtol=2e-4)
    missing = run_in_process(
        "train", "m.onnx", "--data", "data.npz", "-o", "t.onnx", "--feed", "state=state.npy",
        cwd=tmp_path,
    )  # fmt: skip
    assert missing.returncode != 0 and "['sr', 'offset'] have no value" in missing.stderr


def two_input_classifier():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["a"]),
        helper.make_node("MatMul", ["state", "V"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 3]),
            helper.make_tensor_value_info("state", TensorProto.DOUBLE, ["N", 2]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.DOUBLE, ["N", 3])],
        [
            numpy_helper.from_array(np.zeros((3, 3)), "W"),
            numpy_helper.from_array(np.zeros((2, 3)), "V"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_classifier_with_a_per_row_feed_matches_numpy():
    from onnxgrad.training import OrtGradientClassifier

    labels = np.array(["a", "b", "c"])[RNG.integers(0, 3, size=len(X))]
    est = OrtGradientClassifier(
        two_input_classifier(),
        learning_loss="cross_entropy_logits",
        max_iter=3,
        batch_size=len(X),
        learning_rate=LearningRateSGD(0.5 / len(X), learning_rate="constant"),
    ).fit(X, labels, feeds={"state": STATE})
    onehot = (labels[:, None] == np.array(["a", "b", "c"])).astype(float)
    W, V = np.zeros((3, 3)), np.zeros((2, 3))
    for _ in range(3):
        z = X @ W + STATE @ V
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        d = p - onehot
        W, V = W - 0.5 / len(X) * X.T @ d, V - 0.5 / len(X) * STATE.T @ d
    np.testing.assert_allclose(est.get_state()["W"], W, rtol=1e-10, atol=1e-12)
    z = X @ W + STATE @ V
    proba = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(est.predict_proba(X, feeds={"state": STATE}), proba, rtol=1e-10)
    accuracy = np.mean(np.array(["a", "b", "c"])[proba.argmax(axis=1)] == labels)
    assert est.score({"x": X, "state": STATE}, labels) == pytest.approx(accuracy)


def test_runner_binds_fixed_inputs_to_every_step():
    from onnxgrad.training.running.devices import check_device
    from onnxgrad.training.running.feeds import Rows, data_loader
    from onnxgrad.training.running.runner import TrainingRunner
    from onnxgrad.training.step.composition import make_train_step

    step = make_train_step(
        two_input_model(),
        learning_rate=LearningRateSGD(LR, learning_rate="constant"),
        fixed_inputs=["sr", "offset"],
    )
    assert step.features == ("x", "state") and step.fixed == ("sr", "offset")
    runner = TrainingRunner(step, check_device("cpu"), {"W": W0, "V": V0})
    loader = data_loader(Rows({"x": X, "state": STATE}), Y[:, None], batch_size=len(X))
    with pytest.raises(ValueError, match=r"no value for the fixed inputs \['sr', 'offset'\]"):
        runner.run_epoch(loader, LR)
    runner.set_feeds({"sr": np.array(2), "offset": OFFSET})
    runner.run_epoch(loader, LR)
    W, V = numpy_descent(2, LR, 1)
    np.testing.assert_allclose(runner.get_weights()["W"], W, rtol=1e-10)
    np.testing.assert_allclose(runner.get_weights()["V"], V, rtol=1e-10)


def test_classifier_fit_takes_the_regressors_arguments_in_order():
    """``use_numpy`` (the seeds' position) comes before ``feeds`` in every estimator."""
    from inspect import signature

    from onnxgrad.training import OrtGradientClassifier

    regressor = signature(OrtGradientForwardBackwardOptimizer.fit).parameters
    assert list(signature(OrtGradientClassifier.fit).parameters) == list(regressor)
