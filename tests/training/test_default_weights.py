"""The default trained weights are those that reach the chosen loss; models without any
weight say why.

The multi-output model is ``h = x W0``, ``Y1 = h W1``, ``Y2 = h W2``: a loss on ``Y2``
trains ``W0`` and ``W2``. The reference gradient is a float64 central finite difference
of the squared error of the original model's output summed over every element (the default
reduction), computed in numpy; the learning rate :data:`LR` is 0.1 per row.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.training import LearningRateSGD, OrtGradientForwardBackwardOptimizer
from onnxgrad.training.artifacts.generate import generate_artifacts
from onnxgrad.training.step.composition import make_train_step

RNG = np.random.default_rng(3)
WEIGHTS = {
    "W0": RNG.normal(size=(3, 4)),
    "W1": RNG.normal(size=(4, 1)),
    "W2": RNG.normal(size=(4, 2)),
}
#: 0.1 per row on the loss summed over a batch of 16 rows
LR = 0.1 / 16


def model_of(nodes, outputs, initializers, dtype=np.float64):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        nodes,
        "m",
        [helper.make_tensor_value_info("X", elem, ["N", 3])],
        [helper.make_tensor_value_info(name, elem, ["N", k]) for name, k in outputs],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def two_heads(dtype=np.float64):
    nodes = [
        helper.make_node("MatMul", ["X", "W0"], ["h"]),
        helper.make_node("MatMul", ["h", "W1"], ["Y1"]),
        helper.make_node("MatMul", ["h", "W2"], ["Y2"]),
    ]
    inits = [numpy_helper.from_array(v.astype(dtype), k) for k, v in WEIGHTS.items()]
    return model_of(nodes, [("Y1", 1), ("Y2", 2)], inits, dtype)


def y2_loss(W, X, y):
    return np.sum((X @ W["W0"] @ W["W2"] - y) ** 2)


def finite_difference(W, name, X, y, eps=1e-6):
    grad = np.zeros_like(W[name])
    for index in np.ndindex(grad.shape):
        plus = {**W, name: W[name].copy()}
        minus = {**W, name: W[name].copy()}
        plus[name][index] += eps
        minus[name][index] -= eps
        grad[index] = (y2_loss(plus, X, y) - y2_loss(minus, X, y)) / (2 * eps)
    return grad


def data(n=16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 3)), rng.normal(size=(n, 2))


def test_artifacts_with_a_loss_on_one_output_train_the_weights_that_reach_it(tmp_path):
    X, y = data()
    art = generate_artifacts(
        two_heads(), output="Y2", optimizer="sgd", learning_rate=LR, folder=tmp_path
    )
    step = art.train_step
    assert step.weights == ("W0", "W2")
    session = ort.InferenceSession(
        str(tmp_path / "training_model.onnx"), providers=["CPUExecutionProvider"]
    )
    feeds = {step.features[0]: X, step.label: y, step.learning_rate: np.array(LR)}
    feeds.update({w: WEIGHTS[w] for w in step.weights})
    feeds.update(step.initial_state())
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    for w, new in zip(step.weights, step.new_weights):
        expected = WEIGHTS[w] - LR * finite_difference(WEIGHTS, w, X, y)
        np.testing.assert_allclose(outputs[new], expected, rtol=1e-6, atol=1e-8)


def test_default_output_trains_its_own_weights(tmp_path):
    art = generate_artifacts(two_heads(), folder=tmp_path)
    assert art.train_step.weights == ("W0", "W1")


def test_named_weights_that_do_not_reach_the_loss_stay_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"weights \['W1'\] do not reach the loss"):
        generate_artifacts(two_heads(), ["W0", "W1"], output="Y2", folder=tmp_path)
    with pytest.raises(ValueError, match=r"weights \['W1'\] do not reach the loss"):
        make_train_step(two_heads(), ["W1"], output="Y2")


def test_estimator_fits_the_weights_of_its_output():
    X, y = data()
    est = OrtGradientForwardBackwardOptimizer(
        two_heads(),
        output="Y2",
        max_iter=3,
        batch_size=len(X),
        learning_rate=LearningRateSGD(LR, learning_rate="constant"),
    ).fit(X, y)
    W = dict(WEIGHTS)
    for _ in range(3):
        grads = {w: finite_difference(W, w, X, y) for w in ("W0", "W2")}
        W = {**W, **{w: W[w] - LR * g for w, g in grads.items()}}
    state = est.get_state()
    assert sorted(state) == ["W0", "W2"]
    for w in ("W0", "W2"):
        np.testing.assert_allclose(state[w], W[w], rtol=1e-6, atol=1e-8)
    trained = {i.name: numpy_helper.to_array(i) for i in est.get_trained_onnx().graph.initializer}
    np.testing.assert_array_equal(trained["W1"], WEIGHTS["W1"])


def test_weights_stored_as_constants_are_trained(tmp_path):
    """A kernel held by a Constant node (paddle2onnx, spox) is promoted by normalisation and
    trained, not reported as missing."""
    kernel = numpy_helper.from_array(np.ones((3, 2)), "kernel")
    nodes = [
        helper.make_node("Constant", [], ["K"], value=kernel, name="conv_w"),
        helper.make_node("MatMul", ["X", "K"], ["Y"]),
    ]
    model = model_of(nodes, [("Y", 2)], [])
    assert generate_artifacts(model, folder=tmp_path).train_step.weights == ("K",)
    X, y = data()
    estimator = OrtGradientForwardBackwardOptimizer(model, max_iter=2).fit(X, y)
    trained = estimator.get_trained_onnx()
    assert not trained.graph.initializer, "the trained model keeps its own form"
    value = numpy_helper.to_array(trained.graph.node[0].attribute[0].t)
    np.testing.assert_array_equal(value, estimator.runner_.get_weights()["K"])
    assert not np.allclose(value, 1.0)


def test_no_weight_names_integer_initializers_as_the_cause(tmp_path):
    nodes = [
        helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.DOUBLE),
        helper.make_node("MatMul", ["X", "qf"], ["Y"]),
    ]
    q = numpy_helper.from_array(np.ones((3, 2), np.int8), "q")
    with pytest.raises(ValueError, match=r"no weight to train: its 1 initializers are all int8"):
        generate_artifacts(model_of(nodes, [("Y", 2)], [q]), folder=tmp_path)


def test_no_weight_names_structural_initializers(tmp_path):
    shape = numpy_helper.from_array(np.array([-1, 3], np.int64), "shape")
    low = numpy_helper.from_array(np.array(0.0), "low")
    nodes = [
        helper.make_node("Reshape", ["X", "shape"], ["r"]),
        helper.make_node("Clip", ["r", "low"], ["Y"]),
    ]
    model = model_of(nodes, [("Y", 3)], [shape, low])
    with pytest.raises(ValueError, match=r"float initializers \['low'\] reach no output"):
        generate_artifacts(model, folder=tmp_path)


def test_frozen_message_only_when_weights_were_frozen(tmp_path):
    with pytest.raises(ValueError, match=r"every weight is frozen by frozen_params"):
        generate_artifacts(two_heads(), frozen_params=["W0", "W1", "W2"], folder=tmp_path)


def test_no_weight_names_constants_that_reach_the_output_but_are_no_parameters(tmp_path):
    """A number scaling every feature (an attention scale, GELU's 0.5) reaches the output
    but is no weight by role: the error says so (before: "reach no output", false here, as
    for openwakeword's melspectrogram.onnx, whose DFT kernels and mel filterbank do)."""
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    model = model_of([helper.make_node("Mul", ["X", "half"], ["Y"])], [("Y", 3)], [half])
    match = r"initializers \['half'\] reach an output but play no parameter role"
    with pytest.raises(ValueError, match=match):
        generate_artifacts(model, folder=tmp_path)
