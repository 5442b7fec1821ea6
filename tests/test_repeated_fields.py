"""Helpers rewriting protobuf's repeated fields without extra copies: the same messages as
the plain ways of writing them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import GraphProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    IN_PLACE_DELETIONS,
    replace_repeated,
    retain,
    weightless_bytes,
    weightless_view,
)


def _graph(count: int) -> GraphProto:
    graph = GraphProto()
    for i in range(count):
        graph.node.add(op_type="Relu", name=f"n{i}", input=[f"x{i}"], output=[f"y{i}"])
    return graph


def test_replace_repeated_takes_the_fields_own_items_in_any_order():
    graph = _graph(50)
    expected = [*(f"n{i}" for i in reversed(range(50))), "n3"]
    replace_repeated(graph.node, [*reversed(graph.node), graph.node[3]])
    assert [node.name for node in graph.node] == expected


@pytest.mark.parametrize("dropped", [0, 3, IN_PLACE_DELETIONS + 1])
def test_retain_keeps_the_flagged_items_in_order(dropped):
    count = 2 * IN_PLACE_DELETIONS + 10
    graph = _graph(count)
    keep = [i % 2 == 0 or i >= 2 * dropped for i in range(count)]
    retain(graph.node, keep)
    assert [node.name for node in graph.node] == [f"n{i}" for i in range(count) if keep[i]]


def test_weightless_bytes_parse_into_the_weightless_view():
    graph = _graph(20)
    graph.name, graph.doc_string = "g", "a graph"
    graph.input.append(helper.make_tensor_value_info("x0", TensorProto.FLOAT, ["N"]))
    graph.output.append(helper.make_tensor_value_info("y19", TensorProto.FLOAT, ["N"]))
    graph.value_info.append(helper.make_tensor_value_info("y1", TensorProto.FLOAT, ["N"]))
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.zeros((64, 64), np.float32), "big"),
            numpy_helper.from_array(np.array([1, 2], np.int64), "small"),
        ]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.metadata_props.add(key="k", value="v")
    model.functions.add(name="f", domain="local")
    parsed = onnx.ModelProto()
    parsed.ParseFromString(weightless_bytes(model))
    assert parsed == weightless_view(model)
    assert [i.name for i in parsed.graph.initializer] == ["small"]
    assert [i.name for i in parsed.graph.input] == ["x0", "big"]
