"""Control flow the native engine refuses, with a message naming the node and value."""

import pytest
from onnx import TensorProto, helper

from onnxgrad import onnx_derivative


def test_loop_carrying_a_sequence_is_refused_by_name():
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("SequenceInsert", ["seq_in", "v"], ["seq_out"]),
            helper.make_node("Tanh", ["v"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("seq_in", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("seq_out", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [3]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("SequenceEmpty", [], ["empty"], dtype=TensorProto.FLOAT),
            helper.make_node(
                "Loop", ["trips", "", "empty", "x"], ["seq", "y"], name="carry", body=body
            ),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [helper.make_tensor("trips", TensorProto.INT64, [], [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    with pytest.raises(
        NotImplementedError, match=r"'carry'.*non-tensor loop-carried value 'seq_in'"
    ):
        onnx_derivative(model, weights=[], inputs=["x"])
