"""The composed graphs: valid, pure, with the documented interface."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from onnxgrad import add_loss_output
from onnxgrad.training import (
    LearningRateAdam,
    LearningRateSGD,
    LearningRateSGDNesterov,
    make_eval_step,
    make_predict_model,
    make_train_step,
    with_batch_indices,
)
from tests.models import linear_regression_model, seed004_model


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


@pytest.mark.parametrize("layout", ["per_weight", "flat"])
@pytest.mark.parametrize("opset", [13, 15, 18, 21])
@pytest.mark.parametrize(
    "optimizer", [LearningRateSGD(), LearningRateSGDNesterov(), LearningRateAdam()]
)
def test_train_step_is_valid_and_keeps_the_opset(opset, optimizer, layout):
    model = seed004_model(opset)
    before = model.SerializeToString()
    weights = ["init", "init_1", "init_b10"]
    step = make_train_step(model, weights, learning_rate=optimizer, layout=layout)
    assert model.SerializeToString() == before
    onnx.checker.check_model(step.model, full_check=True)
    assert step.model.ir_version <= 10
    opsets = {o.domain: o.version for o in step.model.opset_import}
    assert opsets[""] == opset
    assert all(node.domain in ("", "ai.onnx") for node in step.model.graph.node)
    inputs = [i.name for i in step.model.graph.input]
    flat = [step.flat_weights] if layout == "flat" else []
    assert inputs == [*step.data_inputs, *step.weights, *flat, *step.state, step.learning_rate]
    outputs = [o.name for o in step.model.graph.output]
    assert outputs == [step.loss, *step.new_weights, *step.new_state]
    assert len(step.new_weights) == (1 if layout == "flat" else 3)
    state = step.initial_state()
    assert set(state) == set(step.state)
    named = step.state_by_weight(state)
    for name, value in step.state_inputs(named).items():
        np.testing.assert_array_equal(value, state[name])


def test_seed004_step_loss_and_update_equal_numpy():
    """One SGD step on seed 004's polynomial, against its numpy formula."""
    model = seed004_model()
    step = make_train_step(model, ["init", "init_1", "init_b10"], learning_rate=LearningRateSGD())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 2)).astype(np.float32)
    y = rng.standard_normal((6, 1)).astype(np.float32)
    w = {
        "init": np.array([[0.5, -0.3]], np.float32),
        "init_1": np.array([[-2.0, 3.0]], np.float32),
        "init_b10": np.array([-1.0], np.float32),
    }
    out = run(
        step.model, {"x": x, step.label: y, **w, step.learning_rate: np.array(0.1, np.float32)}
    )

    x64 = x.astype(np.float64)
    prediction = (x64 * x64 * w["init"] + x64 * w["init_1"]).sum(axis=1, keepdims=True) - 1
    residual = prediction - y
    grads = {  # of the default loss: the squared error summed over the batch
        "init": (2 * residual * x64 * x64).sum(axis=0, keepdims=True),
        "init_1": (2 * residual * x64).sum(axis=0, keepdims=True),
        "init_b10": np.array([2 * residual.sum()]),
    }
    assert out[step.loss] == pytest.approx((residual**2).sum(), rel=1e-5)
    for name, new in zip(step.weights, step.new_weights):
        np.testing.assert_allclose(out[new], w[name] - 0.1 * grads[name], rtol=1e-5)


def test_batch_indices_select_the_rows():
    model = linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5]))
    step = make_train_step(model, learning_rate=LearningRateSGD())
    indexed = with_batch_indices(step)
    onnx.checker.check_model(indexed, full_check=True)
    rng = np.random.default_rng(1)
    X = rng.standard_normal((10, 2)).astype(np.float32)
    y = rng.standard_normal((10, 1)).astype(np.float32)
    rows = np.array([7, 2, 5], dtype=np.int64)
    weights = {
        "coefs": np.array([[1.0], [-1.0]], np.float32),
        "intercept": np.array([0.5], np.float32),
    }
    lr = {step.learning_rate: np.array(0.1, np.float32)}
    batch = run(step.model, {"X": X[rows], step.label: y[rows], **weights, **lr})
    gathered = run(indexed, {"X": X, step.label: y, "batch_indices": rows, **weights, **lr})
    for name, value in batch.items():
        np.testing.assert_array_equal(gathered[name], value)


def test_eval_and_predict_graphs_take_weights_as_inputs():
    model = linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5]))
    evaluation = make_eval_step(model)
    prediction = make_predict_model(model)
    for graph in (evaluation.model, prediction):
        onnx.checker.check_model(graph, full_check=True)
        assert not graph.graph.initializer
    X = np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)
    y = np.array([[0.0], [1.0]], np.float32)
    w = {"coefs": np.array([[2.0], [1.0]], np.float32), "intercept": np.array([1.0], np.float32)}
    expected = X @ w["coefs"] + w["intercept"]
    np.testing.assert_allclose(run(prediction, {"X": X, **w})["Y"], expected)
    loss = run(evaluation.model, {"X": X, evaluation.label: y, **w})[evaluation.loss]
    assert loss == pytest.approx(((expected - y) ** 2).sum())


def test_existing_loss_model_with_sample_weight():
    model = add_loss_output(
        linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5])), weight_name="weight"
    )
    step = make_train_step(model, ["coefs"], loss=None, weight_name="weight")
    assert step.data_inputs == ("X", "label", "weight")
    assert step.weights == ("coefs",)
    X = np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)
    y = np.array([[0.0], [1.0]], np.float32)
    sw = np.array([1.0, 3.0], np.float32)
    feeds = {"X": X, "label": y, "weight": sw, "coefs": np.array([[2.0], [1.0]], np.float32)}
    out = run(step.model, {**feeds, step.learning_rate: np.array(0.01, np.float32)})
    residual = X @ feeds["coefs"] + 0.5 - y
    # add_loss_output's squared_error is the weighted sum by default
    assert out["loss"] == pytest.approx(float((sw[:, None] * residual**2).sum()))
    grad = 2 * X.T @ (sw[:, None] * residual)
    np.testing.assert_allclose(out[step.new_weights[0]], feeds["coefs"] - 0.01 * grad, rtol=1e-5)


def test_composition_errors_name_the_culprit():
    model = linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5]))
    with pytest.raises(ValueError, match=r"unknown weights \['bias'\]"):
        make_train_step(model, ["bias"])
    with pytest.raises(TypeError, match="not the string"):
        make_train_step(model, "coefs")
    with pytest.raises(ValueError, match="loss output 'loss' not found"):
        make_train_step(model, loss=None)
    with pytest.raises(TypeError, match="learning_rate must be an optimizer"):
        make_train_step(model, learning_rate="SGD")
    shape = onnx.numpy_helper.from_array(np.array([-1, 1], np.int64), "shape")
    with_int = helper.make_model(model.graph, opset_imports=model.opset_import)
    with_int.graph.initializer.append(shape)
    with pytest.raises(ValueError, match=r"weights \['shape'\] are not float"):
        make_train_step(with_int, ["coefs", "shape"])


def test_a_weight_that_does_not_reach_the_loss_is_named():
    model = add_loss_output(linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5])))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(2, np.float32), "unused"))
    unreached = r"weights \['unused'\] do not reach the loss output 'loss'"
    with pytest.raises(ValueError, match=unreached):
        make_train_step(model, ["coefs", "unused"], loss=None)
    predicting = linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5]))
    predicting.graph.initializer.append(
        onnx.numpy_helper.from_array(np.zeros(2, np.float32), "unused")
    )
    with pytest.raises(ValueError, match=r"weights \['unused'\] do not reach the loss output"):
        make_train_step(predicting, ["coefs", "unused"])


def test_batch_indices_need_a_free_batch_axis():
    model = linear_regression_model(np.array([[1.0, -1.0]]), np.array([0.5]))
    for info in (model.graph.input[0], model.graph.output[0]):
        info.type.tensor_type.shape.dim[0].dim_value = 4
    step = make_train_step(model, learning_rate=LearningRateSGD())
    with pytest.raises(ValueError, match=r"input 'X' has a fixed first dimension 4 \(shape"):
        with_batch_indices(step)
