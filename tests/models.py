"""Small models shared by the tests, built exactly as the seeds print them."""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper


def seed004_model(opset: int = 14) -> ModelProto:
    """z = -1 - 2x + 3y + x^2/2 - y^2/3, the graph printed in seed 004 (opset 14)."""
    f32 = np.float32
    inits = {
        "init": np.array([[0.5, -0.33333]], dtype=f32),
        "init_1": np.array([[-2.0, 3.0]], dtype=f32),
        "init_2": np.array([1], dtype=np.int64),
        "init_3": np.array([2], dtype=np.int64),
        "init_5": np.array([0], dtype=np.int64),
        "init_b10": np.array([-1.0], dtype=f32),
        "init_b11": np.array([-1, 1], dtype=np.int64),
    }
    node = helper.make_node
    nodes = [
        node("Mul", ["x", "x"], ["out_mul_0"]),
        node("Mul", ["out_mul_0", "init"], ["out_mul_0_1"]),
        node("Mul", ["x", "init_1"], ["out_mul_0_2"]),
        node("Add", ["out_mul_0_2", "out_mul_0_1"], ["out_add_0"]),
        node("Slice", ["out_add_0", "init_2", "init_3", "init_2"], ["out_sli_0"]),
        node("Squeeze", ["out_sli_0", "init_2"], ["out_squ_0"]),
        node("Slice", ["out_add_0", "init_5", "init_2", "init_2"], ["out_sli_0_1"]),
        node("Squeeze", ["out_sli_0_1", "init_2"], ["out_squ_0_1"]),
        node("Add", ["out_squ_0_1", "out_squ_0"], ["out_add_0_1"]),
        node("Add", ["out_add_0_1", "init_b10"], ["out_add_0_2"]),
        node("Reshape", ["out_add_0_2", "init_b11"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "seed004",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])],
        [numpy_helper.from_array(v, name=k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def seed004_function(x: np.ndarray) -> np.ndarray:
    """numpy reference of :func:`seed004_model` with its initial weights."""
    poly = x * np.array([[-2.0, 3.0]]) + x * x * np.array([[0.5, -0.33333]])
    return (poly[:, 0] + poly[:, 1] - 1.0).reshape((-1, 1))


def linear_regression_model(coef: np.ndarray, intercept: np.ndarray) -> ModelProto:
    """Y = X @ coefs + intercept, the graph of seed 000 (opset 14)."""
    coef = coef.reshape((1, -1)) if coef.ndim == 1 else coef
    coefs = coef.T.astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "coefs"], ["y1"], name="N1"),
            helper.make_node("Add", ["y1", "intercept"], ["Y"], name="N2"),
        ],
        "lr",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, coefs.shape[0]])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, coefs.shape[1]])],
        [
            numpy_helper.from_array(coefs, name="coefs"),
            numpy_helper.from_array(np.asarray(intercept, dtype=np.float32), name="intercept"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=7)


def tanh_mlp_loss_model(n_features: int = 3, hidden: int = 4, dtype=np.float64, seed: int = 0):
    """loss = sum((tanh(X W1 + b1) W2 + b2 - label)^2), weights W1, b1, W2, b2 (opset 18)."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    weights = {
        "W1": rng.standard_normal((n_features, hidden)).astype(dtype),
        "b1": rng.standard_normal(hidden).astype(dtype),
        "W2": rng.standard_normal((hidden, 1)).astype(dtype),
        "b2": rng.standard_normal(1).astype(dtype),
    }
    node = helper.make_node
    nodes = [
        node("MatMul", ["X", "W1"], ["h0"]),
        node("Add", ["h0", "b1"], ["h1"]),
        node("Tanh", ["h1"], ["h2"]),
        node("MatMul", ["h2", "W2"], ["o0"]),
        node("Add", ["o0", "b2"], ["y"]),
        node("Sub", ["y", "label"], ["d"]),
        node("Mul", ["d", "d"], ["d2"]),
        node("ReduceSum", ["d2"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "tanh_mlp",
        [
            helper.make_tensor_value_info("X", elem, ["N", n_features]),
            helper.make_tensor_value_info("label", elem, ["N", 1]),
        ],
        [helper.make_tensor_value_info("loss", elem, [])],
        [numpy_helper.from_array(v, name=k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return model, weights


def cast_mlp_model(weights: dict, elem: int, io: int = TensorProto.FLOAT) -> ModelProto:
    """``y = tanh(x w1 + b1) w2`` computed in element type ``elem`` between two Casts, inputs
    and outputs of type ``io``; ``weights`` holds ``w1`` [6, h], ``b1`` [h], ``w2`` [h, 2]."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xh"], to=elem),
            helper.make_node("MatMul", ["xh", "w1"], ["h"]),
            helper.make_node("Add", ["h", "b1"], ["hb"]),
            helper.make_node("Tanh", ["hb"], ["a"]),
            helper.make_node("MatMul", ["a", "w2"], ["yh"]),
            helper.make_node("Cast", ["yh"], ["y"], to=io),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", io, [None, 6])],
        [helper.make_tensor_value_info("y", io, [None, 2])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
