"""Helpers rewriting protobuf's repeated fields without extra copies: the same messages as
the plain ways of writing them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import GraphProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
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


def test_replace_repeated_moves_the_fields_own_items_without_copying_them():
    # a copy would leave the held message detached: the renaming below would not show
    graph, other = _graph(6), _graph(2)
    held = list(graph.node)
    replace_repeated(graph.node, [held[4], other.node[1], held[0], held[4]])
    assert [node.name for node in graph.node] == ["n4", "n1", "n0", "n4"]
    held[4].name, held[0].name = "renamed4", "renamed0"
    assert [node.name for node in graph.node] == ["renamed4", "n1", "renamed0", "n4"]
    other.node[1].name = "changed"  # an item from elsewhere is copied
    assert graph.node[1].name == "n1"
    assert [node.name for node in held[1:4]] == ["n1", "n2", "n3"]  # dropped, still readable


@pytest.mark.parametrize("dropped", [0, 3, 300])
def test_retain_keeps_the_flagged_items_in_order(dropped):
    count = 2 * 300 + 10
    graph = _graph(count)
    first = graph.node[0]
    keep = [i % 2 == 0 or i >= 2 * dropped for i in range(count)]
    retain(graph.node, keep)
    assert [node.name for node in graph.node] == [f"n{i}" for i in range(count) if keep[i]]
    first.name = "renamed"
    assert graph.node[0].name == "renamed"


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
    model.graph.node[3].metadata_props.add(key="trace", value="an exporter's stack trace")
    parsed = onnx.ModelProto()
    parsed.ParseFromString(weightless_bytes(model))
    assert parsed == weightless_view(model)
    assert [i.name for i in parsed.graph.initializer] == ["small"]
    assert [i.name for i in parsed.graph.input] == ["x0", "big"]
    assert parsed.metadata_props == model.metadata_props
    assert not any(node.metadata_props for node in parsed.graph.node), "not read by checks"
    assert len(model.graph.node[3].metadata_props) == 1, "the model keeps its own"
