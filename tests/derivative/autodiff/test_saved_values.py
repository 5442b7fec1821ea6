"""The values a gradient keeps from the forward: rules reading their node's output instead of
its input let the forward free the input (the pre-softmax scores of an attention, the input
of a ReLU) as soon as the output is computed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative


def chain(op: str, elem_type: int = TensorProto.FLOAT, opset: int = 17, **attrs):
    """``y = op(x * 2)``: the op's input ``s`` is an intermediate the forward may free."""
    nodes = [
        helper.make_node("Add", ["x", "x"], ["s"]),
        helper.make_node(op, ["s"], ["y"], **attrs),
    ]
    graph = helper.make_graph(
        nodes,
        op,
        [helper.make_tensor_value_info("x", elem_type, [2, 3])],
        [helper.make_tensor_value_info("y", elem_type, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(
    ("op", "attrs"),
    [("Softmax", {"axis": -1}), ("Relu", {}), ("Elu", {}), ("Selu", {}), ("Celu", {})],
)
def test_gradient_reads_the_output_not_the_input(op, attrs):
    grad = onnx_derivative(chain(op, **attrs), weights=[], inputs=["x"], backend="onnx")
    backward = [n for n in grad.graph.node if n.output[0] not in ("s", "y")]
    readers = [n.name or n.op_type for n in backward if "s" in n.input]
    assert readers == []
    assert any("y" in n.input for n in backward)


def test_elu_with_a_negative_alpha_reads_the_input():
    """``y > 0`` is not ``x > 0`` when ``alpha < 0``."""
    grad = onnx_derivative(chain("Elu", alpha=-0.5), weights=[], inputs=["x"], backend="onnx")
    assert any("s" in n.input for n in grad.graph.node if n.output[0] not in ("s", "y"))


def test_softmax_gradient_in_float16_before_opset_20():
    """Valid at opset 17 (no float16 ``IsInf``), and equal to the float64 gradient."""
    grad = onnx_derivative(
        chain("Softmax", TensorProto.FLOAT16, axis=-1), weights=[], inputs=["x"], backend="onnx"
    )
    onnx.checker.check_model(grad, full_check=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3))
    g = rng.standard_normal((2, 3))
    (got,) = ReferenceEvaluator(grad).run(
        ["x_grad"], {"x": x.astype(np.float16), "y_grad": g.astype(np.float16)}
    )
    y = np.exp(2 * x) / np.exp(2 * x).sum(axis=-1, keepdims=True)
    expected = 2 * y * (g - (g * y).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(got.astype(np.float64), expected, atol=5e-3)
