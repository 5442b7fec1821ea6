"""The gradient model declares an IR version that its opsets allow (onnx's VERSION_TABLE)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from onnxgrad import onnx_derivative


def _ir_allowing(opset: int) -> int:
    """The first IR version released with ``opset``, read from onnx's VERSION_TABLE."""
    return min(ir for _, ir, default_opset, *_ in helper.VERSION_TABLE if default_opset >= opset)


@pytest.mark.parametrize("opset", [13, 18, 21, 23, 24, 25])
@pytest.mark.parametrize("declared", [0, 7, 10])
def test_gradient_ir_version_allows_its_opset(opset, declared):
    graph = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = declared
    gradient = onnx_derivative(model, weights=[])
    assert gradient.ir_version >= _ir_allowing(opset)
    if _ir_allowing(opset) <= 10:
        assert gradient.ir_version <= 10, "opsets onnxruntime-training loads keep IR <= 10"
