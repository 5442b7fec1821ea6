"""Older onnxruntime dynamic quantization (as in shipped OCR models): ``ConvInteger`` whose
float bias is quantized to int32 and added before the ``Cast``, ``MatMulInteger`` with a float
bias after it, and an output whose declared rank is wrong. Values are checked against
onnxruntime's integer kernels, gradients against the Jacobian of the float model over the
dequantized weights (onnxruntime's float kernels), the straight-through estimator's reading."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import get_train_initializer, onnx_derivative
from onnxgrad.normalize import normalized_model
from tests.normalize.kernels import run

RNG = np.random.default_rng(12)
C_IN, C_OUT, SIDE, UNITS = 2, 3, 4, 4
FLAT = C_OUT * SIDE * SIDE


def _weights(units=UNITS):
    return {
        "w_quantized": RNG.integers(0, 256, (C_OUT, C_IN, 3, 3)).astype(np.uint8),
        "w_zero_point": np.array(128, dtype=np.uint8),
        "w_scale": np.array(0.01, dtype=np.float32),
        "b": RNG.standard_normal(C_OUT).astype(np.float32),
        "m_quantized": RNG.integers(0, 256, (FLAT, units)).astype(np.uint8),
        "m_zero_point": np.array(120, dtype=np.uint8),
        "m_scale": np.array(0.02, dtype=np.float32),
        "c": RNG.standard_normal(units).astype(np.float32),
        "bias_shape": np.array([1, C_OUT, 1, 1], dtype=np.int64),
        "flat_shape": np.array([1, FLAT], dtype=np.int64),
        "two": np.array([2], dtype=np.int64),
        "one": np.array([1], dtype=np.int64),
        "zero": np.array(0, dtype=np.int64),
    }


def _legacy_model(weights) -> onnx.ModelProto:
    """``Conv -> Reshape -> Gemm -> Reshape`` as an old ``quantize_dynamic`` writes it; the
    output is declared ``[1, seqlen]`` but computed ``[2, 1, 2]`` (its shape a ``Concat``)."""
    node = helper.make_node
    nodes = [
        node("DynamicQuantizeLinear", ["x"], ["xq", "x_scale", "x_zero"]),
        node("Mul", ["x_scale", "w_scale"], ["bias_scale"]),
        node("Div", ["b", "bias_scale"], ["b_div"]),
        node("Floor", ["b_div"], ["b_floor"]),
        node("Cast", ["b_floor"], ["b_int"], to=TensorProto.INT32),
        node(
            "ConvInteger", ["xq", "w_quantized", "x_zero", "w_zero_point"], ["conv"], pads=[1] * 4
        ),
        node("Reshape", ["b_int", "bias_shape"], ["b_reshaped"]),
        node("Add", ["conv", "b_reshaped"], ["conv_bias"]),
        node("Cast", ["conv_bias"], ["conv_float"], to=TensorProto.FLOAT),
        node("Mul", ["x_scale", "w_scale"], ["conv_scale"]),
        node("Mul", ["conv_float", "conv_scale"], ["h"]),
        node("Reshape", ["h", "flat_shape"], ["flat"]),
        node("DynamicQuantizeLinear", ["flat"], ["fq", "f_scale", "f_zero"]),
        node("MatMulInteger", ["fq", "m_quantized", "f_zero", "m_zero_point"], ["mm"]),
        node("Cast", ["mm"], ["mm_float"], to=TensorProto.FLOAT),
        node("Mul", ["f_scale", "m_scale"], ["mm_scale"]),
        node("Mul", ["mm_float", "mm_scale"], ["mm_scaled"]),
        node("Add", ["mm_scaled", "c"], ["z"]),
        node("Shape", ["z"], ["z_shape"]),
        node("Gather", ["z_shape", "zero"], ["batch"], axis=0),
        node("Unsqueeze", ["batch"], ["batch_1d"], axes=[0]),
        node("Concat", ["two", "batch_1d", "two"], ["y_shape"], axis=0),
        node("Reshape", ["z", "y_shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "legacy_quantized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C_IN, SIDE, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seqlen"])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], ir_version=7)


def _dequantized(weights, name):
    codes = weights[f"{name}_quantized"].astype(np.float32)
    return (codes - weights[f"{name}_zero_point"]) * weights[f"{name}_scale"]


def _float_linear_part(weights) -> onnx.ModelProto:
    """``x -> flatten(Conv(x, W)) M`` over the dequantized weights, no bias: linear in ``x``."""
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["h"], pads=[1] * 4),
            helper.make_node("Reshape", ["h", "flat_shape"], ["flat"]),
            helper.make_node("MatMul", ["flat", "m"], ["y"]),
        ],
        "float_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, C_IN, SIDE, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, UNITS])],
        [
            numpy_helper.from_array(_dequantized(weights, "w"), "w"),
            numpy_helper.from_array(_dequantized(weights, "m"), "m"),
            numpy_helper.from_array(np.array([-1, FLAT], dtype=np.int64), "flat_shape"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_legacy_conv_integer_is_lowered_and_matches_onnxruntime():
    weights = _weights()
    model = _legacy_model(weights)
    lowered = normalized_model(model)
    ops = {n.op_type for n in lowered.graph.node}
    assert not ops & {"ConvInteger", "MatMulInteger"}, ops
    x = RNG.standard_normal((1, C_IN, SIDE, SIDE)).astype(np.float32)
    expected = run(model, {"x": x})[0]
    assert expected.shape == (2, 1, 2)
    np.testing.assert_allclose(run(lowered, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("units", [UNITS, 1])
def test_quantization_scales_are_not_weights(units):
    """Only the float bias left after the quantized product is trained: the scales (and the
    int32-quantized conv bias, which no gradient reaches) stay structural, also where they
    scale a single feature (``units=1``)."""
    assert set(get_train_initializer(_legacy_model(_weights(units)))) == {"c"}


def test_wrong_output_rank_is_replaced_and_the_gradient_runs():
    weights = _weights()
    model = _legacy_model(weights)
    (output,) = normalized_model(model).graph.output
    assert len(output.type.tensor_type.shape.dim) == 3
    gradient = onnx_derivative(model, inputs=["x"], weights=[])
    grad_input = next(i for i in gradient.graph.input if i.name == "y_grad")
    assert len(grad_input.type.tensor_type.shape.dim) == 3
    x = RNG.standard_normal((1, C_IN, SIDE, SIDE)).astype(np.float32)
    seed = RNG.standard_normal((2, 1, 2)).astype(np.float32)
    got = run(gradient, {"x": x, "y_grad": seed})[0]
    basis = np.eye(C_IN * SIDE * SIDE, dtype=np.float32).reshape(-1, C_IN, SIDE, SIDE)
    jacobian = run(_float_linear_part(weights), {"x": basis})[0]
    expected = (jacobian.astype(np.float64) @ seed.reshape(-1)).reshape(x.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_a_scale_read_as_a_float_beside_its_rescales():
    """The conv's activation scale also an output: its derivative reaches ``x`` (numpy: the
    range's two ends, ``+-1/255``), while the ``Mul(Cast(ConvInteger + int32 bias), s_x s_w)``
    rescale and the bias quantization still read it held: the rest of the gradient stays the
    float model's Jacobian."""
    weights = _weights()
    model = _legacy_model(weights)
    model.graph.output.append(helper.make_tensor_value_info("x_scale", TensorProto.FLOAT, []))
    gradient = onnx_derivative(model, inputs=["x"], weights=[])
    x = RNG.standard_normal((1, C_IN, SIDE, SIDE)).astype(np.float32)
    seed = RNG.standard_normal((2, 1, 2)).astype(np.float32)
    seed_scale = np.array(50.0, dtype=np.float32)
    got = run(gradient, {"x": x, "y_grad": seed, "x_scale_grad": seed_scale})[0]
    basis = np.eye(C_IN * SIDE * SIDE, dtype=np.float32).reshape(-1, C_IN, SIDE, SIDE)
    jacobian = run(_float_linear_part(weights), {"x": basis})[0]
    expected = (jacobian.astype(np.float64) @ seed.reshape(-1)).reshape(x.shape)
    slope = np.zeros(x.shape)
    slope[np.unravel_index(np.argmax(x), x.shape)] = 1 / 255
    slope[np.unravel_index(np.argmin(x), x.shape)] = -1 / 255
    np.testing.assert_allclose(got, expected + seed_scale * slope, rtol=1e-4, atol=1e-5)


SHIPPED = Path(os.environ.get("ONNXGRAD_MODEL_CACHE", Path.home() / ".cache/onnxgrad-models"))
COMMON_OLD = SHIPPED / "extract" / "ddddocr" / "common_old.onnx"


@pytest.mark.slow
@pytest.mark.skipif(
    not COMMON_OLD.exists(), reason=f"ddddocr's common_old.onnx not at {COMMON_OLD}"
)
def test_shipped_legacy_quantized_ocr_model():
    """ddddocr 1.6.1's ``common_old.onnx``: scales are not weights, the output gradient has
    the computed rank 3 and the input gradient runs, finite and nonzero."""
    weights = get_train_initializer(str(COMMON_OLD))
    assert not [name for name in weights if name.endswith(("_scale", "_zero_point"))]
    gradient = onnx_derivative(str(COMMON_OLD), inputs=["input1"], weights=[])
    x = np.random.default_rng(0).random((1, 1, 64, 96)).astype(np.float32)
    (y,) = run(onnx.load(COMMON_OLD), {"input1": x})
    seed = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    got = run(gradient, {"input1": x, "387_grad": seed})[0]
    assert got.shape == x.shape and np.isfinite(got).all() and np.abs(got).max() > 0
