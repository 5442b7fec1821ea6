"""Models written the way shipped files are: weights as Constant nodes, -1 dims, wrong
declarations, old opsets (built by hand with onnx.helper, no exporter involved)."""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
RNG = np.random.default_rng(7)


def _normal(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def constant(name: str, value: np.ndarray) -> helper.NodeProto:
    """A ``Constant`` node holding ``value`` under the output ``name`` (as paddle2onnx)."""
    return helper.make_node(
        "Constant", [], [name], name=f"{name}_node", value=numpy_helper.from_array(value, name)
    )


def paddle_like(opset: int = 11) -> ModelProto:
    """Conv -> scale by a scalar -> Relu -> global pool -> MatMul -> Softmax; every weight a
    ``Constant`` node, the input declared ``[-1, 3, ?, ?]`` and the output ``[-1, 2]``."""
    f32 = np.float32
    nodes = [
        constant("conv_w", RNG.normal(size=(4, 3, 3, 3)).astype(f32) * 0.3),
        constant("conv_b", RNG.normal(size=4).astype(f32)),
        constant("half", np.array(0.5, f32)),
        constant("shape", np.array([-1, 4], np.int64)),
        constant("fc_w", RNG.normal(size=(4, 2)).astype(f32)),
        constant("fc_b", RNG.normal(size=2).astype(f32)),
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c", "half"], ["s"]),
        helper.make_node("Relu", ["s"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Reshape", ["p", "shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc_w"], ["m"]),
        helper.make_node("Add", ["m", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["prob"], axis=1),
    ]
    x = helper.make_tensor_value_info("x", F, [-1, 3, None, None])
    prob = helper.make_tensor_value_info("prob", F, [-1, 2])
    graph = helper.make_graph(nodes, "paddle_like", [x], [prob])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


def wrong_output_rank() -> ModelProto:
    """``y = x W + b`` of shape ``[N, 2]``, declared ``[N]`` (onnxruntime only warns)."""
    f32 = np.float32
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
        ],
        "wrong_rank",
        [helper.make_tensor_value_info("x", F, ["N", 3])],
        [helper.make_tensor_value_info("y", F, ["N"])],
        [
            numpy_helper.from_array(RNG.normal(size=(3, 2)).astype(f32), "W"),
            numpy_helper.from_array(np.zeros(2, f32), "b"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def weights_in_branches() -> ModelProto:
    """``If(flag)`` choosing between two Constant-weighted branches (as spox writes them)."""
    f32 = np.float32

    def branch(tag: str, scale: float) -> helper.GraphProto:
        w = f"w_{tag}"
        return helper.make_graph(
            [
                constant(w, (RNG.normal(size=(3, 3)) * scale).astype(f32)),
                helper.make_node("MatMul", ["x", w], [f"y_{tag}"]),
            ],
            tag,
            [],
            [helper.make_tensor_value_info(f"y_{tag}", F, ["N", 3])],
        )

    graph = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["flag"],
                ["y"],
                then_branch=branch("then", 1.0),
                else_branch=branch("else", 2.0),
            )
        ],
        "branches",
        [
            helper.make_tensor_value_info("x", F, ["N", 3]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", F, ["N", 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)


def resize_opset11() -> ModelProto:
    """Linear ``Resize``-11 (scales 2x) then a weighted sum: the form older exporters wrote."""
    f32 = np.float32
    graph = helper.make_graph(
        [
            helper.make_node(
                "Resize", ["x", "roi", "scales"], ["up"], mode="linear",
                coordinate_transformation_mode="half_pixel",
            ),
            helper.make_node("Mul", ["up", "w"], ["y"]),
        ],
        "resize11",
        [helper.make_tensor_value_info("x", F, [1, 1, 3, 3])],
        [helper.make_tensor_value_info("y", F, [1, 1, 6, 6])],
        [
            numpy_helper.from_array(np.zeros(0, f32), "roi"),
            numpy_helper.from_array(np.array([1, 1, 2, 2], f32), "scales"),
            numpy_helper.from_array(RNG.normal(size=(1, 1, 6, 6)).astype(f32), "w"),
        ],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)


def lstm_opset12() -> ModelProto:
    """A one-layer LSTM at opset 12 with its weights as initializers, output summed."""
    hidden, features = 3, 2
    graph = helper.make_graph(
        [
            helper.make_node("LSTM", ["x", "W", "R", "B"], ["seq", "h"], hidden_size=hidden),
            helper.make_node("ReduceSum", ["seq"], ["y"], keepdims=0),
        ],
        "lstm12",
        [helper.make_tensor_value_info("x", F, [4, 1, features])],
        [helper.make_tensor_value_info("y", F, [])],
        [
            numpy_helper.from_array(_normal(1, 4 * hidden, features, scale=0.5), "W"),
            numpy_helper.from_array(_normal(1, 4 * hidden, hidden, scale=0.5), "R"),
            numpy_helper.from_array(_normal(1, 8 * hidden, scale=0.1), "B"),
        ],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], ir_version=7)


def with_constant_value(model: ModelProto, name: str, value: np.ndarray) -> ModelProto:
    """A copy of ``model`` whose Constant node (anywhere) producing ``name`` holds ``value``:
    the original model moved along one weight, for finite differences."""
    from onnxgrad._onnx_utils import subgraphs

    copy = ModelProto()
    copy.CopyFrom(model)

    def visit(graph) -> None:
        for node in graph.node:
            if node.op_type == "Constant" and node.output[0] == name:
                node.attribute[0].t.CopyFrom(numpy_helper.from_array(value, name))
            for sub in subgraphs(node):
                visit(sub)

    visit(copy.graph)
    return copy
