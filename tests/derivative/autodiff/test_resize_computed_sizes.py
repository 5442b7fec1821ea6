"""An opset-11 Resize with empty ``roi`` and ``scales`` and ``sizes`` computed from shapes
(``Concat(Shape(c)[:2], [8, 6])``, as PyTorch's exporter writes ``F.interpolate(size=...)``):
its train step passes onnx's checker and its weight gradient equals central differences.

onnx's data propagation loses the value of such ``sizes`` (it saw 0 elements), so the
interpolation matrices of the gradient read the resized sizes from the output's shape."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from onnxgrad.training import generate_artifacts
from tests.derivative.fd import onnx_numerical_vjp

FLOAT = TensorProto.FLOAT


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.array(value, dtype), name)


@pytest.fixture(scope="module")
def model():
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "two"], ["nc"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["c", "roi", "scales", "sizes"], ["y"], mode="linear"),
    ]
    initializers = [
        _const("w", rng.standard_normal((2, 2, 3, 3))),
        _const("roi", np.zeros(0)),
        _const("scales", np.zeros(0)),
        _const("zero", [0], np.int64),
        _const("two", [2], np.int64),
        _const("hw", [8, 6], np.int64),
    ]
    graph = helper.make_graph(
        nodes,
        "resize11",
        [helper.make_tensor_value_info("x", FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", FLOAT, [1, 2, 8, 6])],
        initializers,
    )
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)
    onnx.checker.check_model(built, full_check=True)
    return built


def test_the_train_step_passes_the_checker_and_learns(model, tmp_path):
    art = generate_artifacts(model, folder=tmp_path)
    training = onnx.load(str(art.path("training_model.onnx")))
    onnx.checker.check_model(training, full_check=True)
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    step = art.train_step
    x = np.random.default_rng(1).standard_normal((1, 2, 4, 4)).astype(np.float32)
    values = {**art.checkpoint.weights, **art.checkpoint.optimizer_state}
    wanted = {i.name for i in session.get_inputs()}
    losses = []
    for _ in range(4):
        feeds = {"x": x, step.label: np.zeros((1, 2, 8, 6), np.float32), **values}
        feeds[step.learning_rate] = np.array(art.learning_rate, np.float32)
        loss, *new = session.run(
            [step.loss, *step.new_weights, *step.new_state],
            {k: v for k, v in feeds.items() if k in wanted},
        )
        losses.append(float(loss))
        values = dict(zip([*step.weights, *step.state], new))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_the_weight_gradient_equals_central_differences(model):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    seed = rng.standard_normal((1, 2, 8, 6)).astype(np.float32)
    w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w"))
    gradient = onnx_derivative(model, weights=["w"], inputs=[])
    session = ort.InferenceSession(gradient.SerializeToString(), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    feeds = {k: v for k, v in {"x": x, "w": w, "y_grad": seed}.items() if k in wanted}
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))["w_grad"]
    expected = onnx_numerical_vjp(model, {"x": x, "w": w}, ["w"], [seed])["w"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
