"""Control flow the native engine refuses, with a message naming the node and value, and the
batched Scan of opset 8, which it rewrites as an opset-9 Scan for a batch of one."""

import numpy as np
import onnxruntime
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


def _batched_scan(batch: int):
    """``s = s0 + sum_t x[:, t]`` as the batched Scan of opset 8."""
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
            helper.make_tensor_value_info("s0", TensorProto.FLOAT, [batch, 2]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 2]),
        ],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [batch, 2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=4)


def test_batched_scan_of_opset_8_with_a_batch_of_one():
    """onnx's converter drops the batch axis from the model's inputs: the gradient still
    takes the original feeds, (1, 2) and (1, 3, 2), and gives ds/ds0 = g, ds/dx_t = g."""
    model = _batched_scan(1)
    gradient = onnx_derivative(model, weights=[], inputs=["s0", "x"])
    shapes = {
        i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in gradient.graph.input
    }
    assert shapes == {"s0": [1, 2], "x": [1, 3, 2], "s_grad": [1, 2]}
    rng = np.random.default_rng(0)
    feeds = {
        "s0": rng.standard_normal((1, 2)).astype(np.float32),
        "x": rng.standard_normal((1, 3, 2)).astype(np.float32),
        "s_grad": rng.standard_normal((1, 2)).astype(np.float32),
    }
    session = onnxruntime.InferenceSession(
        gradient.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    s0_grad, x_grad = session.run(["s0_grad", "x_grad"], feeds)
    np.testing.assert_allclose(s0_grad, feeds["s_grad"], rtol=1e-6)
    np.testing.assert_allclose(x_grad, np.repeat(feeds["s_grad"][:, None], 3, axis=1), rtol=1e-6)


def test_batched_scan_of_opset_8_with_a_larger_batch_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"Scan node 'batched' at opset 8.*batch"):
        onnx_derivative(_batched_scan(2), weights=[], inputs=["s0", "x"])
