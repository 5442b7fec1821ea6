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


def test_batched_scan_of_opset_8_is_refused_by_name():
    """onnx's converter would drop the batch axis from the model's inputs."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"])],
        "body",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("s_in", "x_t")],
        [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [2])],
    )
    scan = helper.make_node(
        "Scan", ["", "s0", "x"], ["s"], num_scan_inputs=1, body=body, name="batched"
    )
    graph = helper.make_graph(
        [scan],
        "g",
        [
            helper.make_tensor_value_info("s0", TensorProto.FLOAT, [1, 2]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2]),
        ],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=4)
    with pytest.raises(NotImplementedError, match=r"Scan node 'batched' at opset 8"):
        onnx_derivative(model, weights=[], inputs=["s0", "x"])
