"""Inputs and outputs (names, order, types) of the gradient graph for each option.

Written against the interface of :mod:`onnxgrad.derivative.api`, so every backend must
pass it: inputs are the model's inputs, the differentiated weights, then ``<output>_grad``
(``Zero``); outputs are ``<input>_grad``, ``<weight>_grad``, then kept outputs or the loss.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.derivative import DerivativeOptions, onnx_derivative
from onnxgrad.graph import add_loss_output
from tests.models import linear_regression_model

D = DerivativeOptions
pytestmark = pytest.mark.parametrize("backend", ["ort", "onnx"])


def _derivative(model: onnx.ModelProto, backend: str, **kwargs) -> onnx.ModelProto:
    return onnx_derivative(model, backend=backend, **kwargs)


def _names(infos) -> list[str]:
    return [i.name for i in infos]


def _types(infos) -> dict[str, tuple[int, list]]:
    return {
        i.name: (
            i.type.tensor_type.elem_type,
            [d.dim_value or None for d in i.type.tensor_type.shape.dim],
        )
        for i in infos
    }


@pytest.fixture(scope="module")
def regression() -> onnx.ModelProto:
    """Y = X @ coefs + intercept with X [N, 3], coefs [3, 2], intercept [2]."""
    coef = np.arange(6, dtype=np.float32).reshape((2, 3)) / 10
    return linear_regression_model(coef, np.array([0.5, -0.5], dtype=np.float32))


@pytest.fixture(scope="module")
def two_outputs() -> onnx.ModelProto:
    """Y = tanh(X @ W) and its arg-max I (an int64 output), a constant int initializer."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Tanh", ["XW"], ["Y"]),
            helper.make_node("ArgMax", ["Y"], ["I"], axis=1, keepdims=1),
            helper.make_node("Reshape", ["I", "shape"], ["I1"]),
        ],
        "two_outputs",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 2])],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 3]),
            helper.make_tensor_value_info("I1", TensorProto.INT64, [None]),
        ],
        [
            numpy_helper.from_array(np.ones((2, 3), dtype=np.float32), "W"),
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "shape"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    ("options", "inputs", "outputs"),
    [
        (D.Zero, ["X", "coefs", "intercept", "Y_grad"], []),
        (D.KeepOutputs, ["X", "coefs", "intercept", "Y_grad"], ["Y"]),
        (D.FillGrad, ["X", "coefs", "intercept"], []),
        (D.FillGrad | D.KeepOutputs, ["X", "coefs", "intercept"], ["Y"]),
    ],
    ids=["Zero", "KeepOutputs", "FillGrad", "FillGrad|KeepOutputs"],
)
def test_options(regression, backend, options, inputs, outputs):
    grad = _derivative(regression, backend, options=options)
    assert _names(grad.graph.input) == inputs
    assert _names(grad.graph.output) == ["X_grad", "coefs_grad", "intercept_grad", *outputs]
    assert not {"coefs", "intercept"} & set(_names(grad.graph.initializer))
    types = _types(grad.graph.input)
    f = TensorProto.FLOAT
    assert types["X"] == (f, [None, 3])
    assert types["coefs"] == (f, [3, 2])
    assert types["intercept"] == (f, [2])
    if "Y_grad" in types:
        assert types["Y_grad"] == (f, [None, 2])
    grads = _types(grad.graph.output)
    assert grads["coefs_grad"] == (f, [3, 2])
    assert grads["intercept_grad"] == (f, [2])
    assert grads["X_grad"][0] == f


def test_loss(regression, backend):
    with_loss = add_loss_output(regression)
    grad = _derivative(with_loss, backend, options=D.Loss, label="label")
    assert _names(grad.graph.input) == ["X", "label", "coefs", "intercept"]
    assert _names(grad.graph.output) == ["X_grad", "coefs_grad", "intercept_grad", "loss"]


def test_loss_with_label_differentiated(regression, backend):
    with_loss = add_loss_output(regression)
    grad = _derivative(with_loss, backend, options=D.Loss, inputs=["label"], weights=["intercept"])
    assert _names(grad.graph.input) == ["X", "label", "intercept"]
    assert _names(grad.graph.output) == ["label_grad", "intercept_grad", "loss"]
    assert "coefs" in _names(grad.graph.initializer)


def test_keep_yield_op(regression, backend):
    if backend != "ort":
        with pytest.raises(ValueError, match="KeepYieldOp"):
            _derivative(regression, backend, options=D.KeepYieldOp)
        return
    grad = _derivative(regression, backend, options=D.KeepYieldOp)
    assert _names(grad.graph.input) == ["X", "coefs", "intercept"]
    assert _names(grad.graph.output) == ["X_grad", "coefs_grad", "intercept_grad"]
    yields = [n for n in grad.graph.node if n.op_type == "YieldOp"]
    assert len(yields) == 1
    assert list(yields[0].input) == ["Y"]
    assert list(yields[0].output) == ["Y_grad"]


def test_weights_follow_the_requested_order(regression, backend):
    grad = _derivative(regression, backend, weights=["intercept", "coefs"], inputs=[])
    assert _names(grad.graph.input) == ["X", "intercept", "coefs", "Y_grad"]
    assert _names(grad.graph.output) == ["intercept_grad", "coefs_grad"]


def test_inputs_only(regression, backend):
    grad = _derivative(regression, backend, weights=[])
    assert _names(grad.graph.input) == ["X", "Y_grad"]
    assert _names(grad.graph.output) == ["X_grad"]
    assert "coefs" in _names(grad.graph.initializer)


def test_one_output_gradient_per_float_output(two_outputs, backend):
    """The int64 output I1 has no gradient: no ``I1_grad`` input (see test_output_selection)."""
    grad = _derivative(two_outputs, backend)
    assert _names(grad.graph.input) == ["X", "W", "Y_grad"]
    assert _names(grad.graph.output) == ["X_grad", "W_grad"]
    assert "shape" not in _names(grad.graph.input)


def test_fill_grad_keeps_every_output(two_outputs, backend):
    grad = _derivative(two_outputs, backend, options=D.FillGrad | D.KeepOutputs)
    assert _names(grad.graph.input) == ["X", "W"]
    assert _names(grad.graph.output) == ["X_grad", "W_grad", "Y", "I1"]
