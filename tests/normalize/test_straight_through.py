"""Quantized activations differentiated with the straight-through estimator: values as
onnxruntime computes them, gradients as the estimator defines them (numpy)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from onnxgrad.normalize import normalized_model
from tests.normalize.integer_products import dynamic_quantized_matmul
from tests.normalize.kernels import assert_within, run

RNG = np.random.default_rng(4)


def _linear(k=6, n=3):
    w = RNG.standard_normal((k, n)).astype(np.float32)
    b = RNG.standard_normal(n).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _dequantized_weight(model):
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    codes = next(v for v in inits.values() if v.dtype in (np.int8, np.uint8) and v.ndim == 2)
    name = next(k for k, v in inits.items() if v is codes)
    scale = inits[f"{name.removesuffix('_quantized')}_scale"]
    zero = inits[f"{name.removesuffix('_quantized')}_zero_point"]
    return (codes.astype(np.float64) - zero) * scale


def test_dynamic_int8_linear(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx.save(_linear(), tmp_path / "f.onnx")
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx", weight_type=QuantType.QInt8)
    quantized = onnx.load(tmp_path / "q.onnx")
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in quantized.graph.node}
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    lowered = normalized_model(quantized)
    assert "MatMulInteger" not in {n.op_type for n in lowered.graph.node}
    # the specification in exact integers; onnxruntime's u8s8 kernel within its CPU's error
    inits = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
    weight = [inits[f"w_{part}"] for part in ("quantized", "scale", "zero_point")]
    product, slack = dynamic_quantized_matmul(x, *weight)
    spec = product + inits["b"]
    tolerance = 1e-5 + 1e-5 * np.abs(spec)
    assert_within(run(lowered, {"x": x})[0], spec, tolerance, "the lowering")
    assert_within(run(quantized, {"x": x})[0], spec, tolerance + slack, "onnxruntime's kernels")
    seed = RNG.standard_normal((4, 3)).astype(np.float32)
    gradient = onnx_derivative(quantized, inputs=["x"], weights=[])
    got = run(gradient, {"x": x, "y_grad": seed})[0]
    np.testing.assert_allclose(got, seed @ _dequantized_weight(quantized).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_type", [np.uint8, np.int8])
def test_quantize_dequantize_pair(zero_type):
    scale, zero = np.float32(0.05), zero_type(3)
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 50])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 50])],
        [
            numpy_helper.from_array(np.array(scale), "s"),
            numpy_helper.from_array(np.array(zero), "z"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = (RNG.standard_normal((3, 50)) * 5).astype(np.float32)
    lowered = normalized_model(model)
    np.testing.assert_array_equal(run(lowered, {"x": x})[0], run(model, {"x": x})[0])
    seed = RNG.standard_normal(x.shape).astype(np.float32)
    got = run(onnx_derivative(model, inputs=["x"], weights=[]), {"x": x, "y_grad": seed})[0]
    lo, hi = np.iinfo(zero_type).min, np.iinfo(zero_type).max
    code = np.round(x / scale) + zero
    mask = (code >= lo) & (code <= hi)
    assert 0 < mask.mean() < 1
    np.testing.assert_array_equal(got, seed * mask)


@pytest.mark.parametrize(
    "value", [0.0, 1e-30, -3.5e-20, 1.2345678, -7e5, 3e8, 1e30, -1e4, -3.4e38, -np.inf]
)
@pytest.mark.parametrize("scale", [1e-3, 1.3344406e36])
def test_stop_gradient_is_exact(value, scale):
    """Values as the kernels'; the derivative is the in-range mask, finite even where
    ``x 2^100`` overflows (an attention mask of -3.4e38 quantized with a scale of 1.3e36, as
    onnxruntime calibrates the tiny Llama's, is in range)."""
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.array(np.float32(scale)), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x = np.array([value], dtype=np.float32)
    np.testing.assert_array_equal(
        run(normalized_model(model), {"x": x})[0], run(model, {"x": x})[0]
    )
    seed = np.array([1.5], dtype=np.float32)
    got = run(onnx_derivative(model, inputs=["x"], weights=[]), {"x": x, "y_grad": seed})[0]
    code = np.round(x.astype(np.float64) / np.float32(scale))
    inside = np.isfinite(x) & (code >= 0) & (code <= 255) & ~((x != 0) & (np.abs(x) < 2.0**-76))
    np.testing.assert_array_equal(got, seed * inside)


def test_normalising_twice_keeps_one_estimator_per_pair():
    """A lowered pair is no pair any more: normalising again neither adds nodes nor a second
    straight-through term (which doubled each pair's derivative: 2^depth over a deep model)."""
    scale = np.float32(0.05)
    nodes, previous = [], "x"
    for i in range(3):
        nodes += [
            helper.make_node("QuantizeLinear", [previous, "s"], [f"q{i}"]),
            helper.make_node("DequantizeLinear", [f"q{i}", "s"], [f"d{i}"]),
        ]
        previous = f"d{i}"
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [40])],
        [numpy_helper.from_array(np.array(scale), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    once = normalized_model(model)
    twice = normalized_model(once)
    assert len(twice.graph.node) == len(once.graph.node)
    x = (RNG.standard_normal(40) * 5).astype(np.float32)
    np.testing.assert_array_equal(run(twice, {"x": x})[0], run(model, {"x": x})[0])
    seed = RNG.standard_normal(40).astype(np.float32)
    got = run(onnx_derivative(twice, inputs=["x"], weights=[]), {"x": x, "y_grad": seed})[0]
    inside = (np.round(x / scale) >= 0) & (np.round(x / scale) <= 255)
    assert 0 < inside.mean() < 1
    np.testing.assert_array_equal(got, seed * inside)


def test_a_pair_s_scale_is_no_trainable_weight():
    """Lowered, a pair still reads its scale as a quantization parameter: a float weight
    quantized by the pair (as static quantization writes norm weights) is offered for
    training, its scale and zero point are not."""
    from onnxgrad import get_train_initializer

    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["w", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
            helper.make_node("Mul", ["x", "d"], ["y"]),
        ],
        "qdq_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        [
            numpy_helper.from_array(RNG.standard_normal(4).astype(np.float32), "w"),
            numpy_helper.from_array(np.array(np.float32(0.05)), "s"),
            numpy_helper.from_array(np.array(np.uint8(128)), "z"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert "s" not in get_train_initializer(model)
    assert "s" not in get_train_initializer(normalized_model(model))
