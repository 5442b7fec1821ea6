"""The Loop gradient names the node, not only its body input, when a type is unknown."""

from __future__ import annotations

import pytest
from onnx import TensorProto, ValueInfoProto, helper

from onnxgrad.derivative.autodiff.builder import NodeView
from onnxgrad.derivative.autodiff.rules.control_flow import _typed_like


@pytest.mark.parametrize(("name", "label"), [("loop7", "loop7"), ("", "s_out")])
def test_untyped_loop_body_input_names_the_loop_node(name, label):
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["s"], ["s_next"]),
            helper.make_node("Identity", ["c"], ["c2"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            ValueInfoProto(name="s"),
        ],
        [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), ValueInfoProto(name="s_next")],
    )
    proto = helper.make_node("Loop", ["M", "", "s0"], ["s_out"], name=name, body=body)
    with pytest.raises(NotImplementedError, match=rf"Loop node '{label}'.*body input 's'"):
        _typed_like(None, NodeView(proto, 17), body.input[2], None)
