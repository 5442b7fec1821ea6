"""``MaxPool(Relu(x))`` is differentiated as ``Relu(MaxPool(x))``: same outputs, same
gradients (ties included), the ReLU on the pooled tensor; pairs it must not touch stay."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxgrad import onnx_derivative
from onnxgrad.derivative.autodiff.forward_rewrites import pool_before_relu
from tests.derivative.autodiff.test_rules_extra import run_ort

POOLS = {
    "tiles": {"kernel_shape": [2, 2], "strides": [2, 2]},
    "overlapping-pads-ceil": {
        "kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1,
    },
}  # fmt: skip


def relu_pool_model(pool_attrs: dict, extra_output: bool = False, chained: bool = False):
    """x -> Relu -> MaxPool (-> MaxPool) -> y, optionally with the ReLU output as an output."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", **pool_attrs),
    ]
    last = "p"
    if chained:
        nodes.append(helper.make_node("MaxPool", ["p"], ["q"], name="pool2", **pool_attrs))
        last = "q"
    nodes.append(helper.make_node("Mul", [last, "w"], ["y"], name="scale"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3, 8, 8]))
    graph = helper.make_graph(
        nodes,
        "relu_pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        outputs,
        [onnx.numpy_helper.from_array(np.float32(1.5).reshape(1), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return onnx.shape_inference.infer_shapes(model)


def tied_input(seed=0) -> np.ndarray:
    """Negative windows, zero windows, ties between positive values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    x[:, :, :2, :2] = -1.0
    x[:, :, 2:4, :2] = 0.0
    x[:, :, 4:6, 4:6] = 0.7
    x[:, :, 6, 6] = np.where(x[:, :, 6, 7] > 0, x[:, :, 6, 7], 0.3)
    return x


def reference_gradients(model, x, w, seed):
    """The gradient of the model as written, ReLU then pool: the pair is kept apart by
    making the ReLU output a graph output too (with a zero output gradient)."""
    kept = onnx.ModelProto()
    kept.CopyFrom(model)
    kept.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, x.shape))
    grad = onnx_derivative(kept, weights=["w"], backend="onnx")
    zeros = np.zeros_like(x)
    return run_ort(grad, {"x": x, "w": w, "y_grad": seed, "r_grad": zeros})


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("chained", [False, True])
def test_pool_before_relu_keeps_outputs_and_gradients(pool, chained):
    model = relu_pool_model(POOLS[pool], chained=chained)
    grad = onnx_derivative(model, weights=["w"], backend="onnx")
    order = [n.op_type for n in grad.graph.node if n.op_type in ("Relu", "MaxPool")]
    assert order[0] == "MaxPool", f"the pool comes first: {order}"
    x, w = tied_input(), np.array([1.5], np.float32)
    y = run_ort(model, {"x": x})["y"]
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert pool_before_relu(rewritten.graph) == 1 + chained
    np.testing.assert_array_equal(run_ort(rewritten, {"x": x})["y"], y)
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    got = run_ort(grad, {"x": x, "w": w, "y_grad": seed})
    expected = reference_gradients(model, x, w, seed)
    np.testing.assert_array_equal(got["x_grad"], expected["x_grad"])
    np.testing.assert_allclose(got["w_grad"], expected["w_grad"], rtol=1e-6)


def test_pool_before_relu_leaves_what_others_read():
    """A ReLU output that is a graph output (or read twice), or a pool with Indices."""
    shared = relu_pool_model(POOLS["tiles"], extra_output=True)
    assert pool_before_relu(shared.graph) == 0
    read_twice = relu_pool_model(POOLS["tiles"])
    read_twice.graph.node.append(helper.make_node("Neg", ["r"], ["z"]))
    read_twice.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    assert pool_before_relu(read_twice.graph) == 0
    with_indices = relu_pool_model(POOLS["tiles"])
    pool = next(n for n in with_indices.graph.node if n.op_type == "MaxPool")
    pool.output.append("indices")
    assert pool_before_relu(with_indices.graph) == 0
    plain = relu_pool_model(POOLS["tiles"], chained=True)
    assert pool_before_relu(plain.graph) == 2
    assert [n.op_type for n in plain.graph.node] == ["MaxPool", "MaxPool", "Relu", "Mul"]
    onnx.checker.check_model(plain, full_check=True)


# -- Gathers of every slice as one Split ---------------------------------------------------------
def unbind_model(indices=(0, 1, 2), opset: int = 18) -> onnx.ModelProto:
    """``loss = sum(q * k + v)``, ``q, k, v`` Gathers of ``Reshape(x W, [0, 3, 4])`` along
    axis 1 (PyTorch's unbind of a packed projection), at the constant scalar ``indices``."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["packed"]),
        helper.make_node("Reshape", ["packed", "shape"], ["parts"]),
    ]
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((5, 12)), "W"),
        onnx.numpy_helper.from_array(np.array([0, 3, 4], np.int64), "shape"),
    ]
    picked = []
    for position, index in enumerate(indices):
        inits.append(onnx.numpy_helper.from_array(np.array(index, np.int64), f"i{position}"))
        nodes.append(
            helper.make_node("Gather", ["parts", f"i{position}"], [f"g{position}"], axis=1)
        )
        picked.append(f"g{position}")
    nodes.append(helper.make_node("Mul", picked[:2], ["qk"]))
    nodes.append(helper.make_node("Add", ["qk", picked[-1]], ["s"]))
    nodes.append(helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0))
    graph = helper.make_graph(
        nodes,
        "unbind",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 5])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("indices", [(0, 1, 2), (2, -2, 0), (0, 2, 0)])
def test_gathers_of_every_slice_become_a_split(indices, opset):
    from onnx.reference import ReferenceEvaluator

    from onnxgrad.derivative import DerivativeOptions
    from tests.derivative.fd import onnx_numerical_vjp

    model = unbind_model(indices, opset)
    gradient = onnx_derivative(model, ["W"], ["x"], DerivativeOptions.Loss, loss="loss")
    ops = [n.op_type for n in gradient.graph.node]
    every_slice = sorted(i % 3 for i in indices) == [0, 1, 2]
    assert ("Split" in ops) == every_slice
    feeds = {
        "x": np.random.default_rng(1).standard_normal((4, 5)),
        "W": onnx.numpy_helper.to_array(model.graph.initializer[0]),
    }
    names = [o.name for o in gradient.graph.output]
    result = dict(zip(names, ReferenceEvaluator(gradient).run(None, feeds)))
    expected = onnx_numerical_vjp(model, feeds, ["x", "W"])
    for name, value in expected.items():
        np.testing.assert_allclose(result[f"{name}_grad"], value, rtol=1e-7, atol=1e-9)
