"""onnxruntime's quantized operators, lowered over dequantized weights, against onnxruntime's
own kernels on random inputs; the integer products against their specification computed with
numpy, and onnxruntime's kernels within the error of their CPU path (``integer_products``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.normalize.integer_products import (
    INT16_MAX,
    conv_patches,
    dynamic_quantized_matmul,
    exact_matmul,
    requantize,
    saturation_slack,
    weights_by_patch,
)
from tests.normalize.kernels import (
    assert_lowering_and_kernel_match_spec,
    assert_lowering_matches,
    lowered_outputs,
    one_node_model,
)

RNG = np.random.default_rng(2)


def _nbits_inputs(n, k, block, bits, zero_points, dtype):
    blocks = -(-k // block)
    packed = RNG.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = (RNG.random(n * blocks) * 0.1 + 0.01).astype(dtype)
    zp = None
    if zero_points:
        per_row = -(-blocks * bits // 8)
        zp = RNG.integers(0, 256, n * per_row, dtype=np.uint8)
    return packed, scales, zp


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    ("k", "block", "bits", "zero_points"),
    [
        (32, 16, 4, False),
        (32, 16, 4, True),
        (40, 16, 4, True),
        (48, 16, 4, True),
        (32, 32, 8, True),
        (32, 16, 8, False),
    ],
)
def test_matmul_nbits(k, block, bits, zero_points, dtype):
    n = 6
    packed, scales, zp = _nbits_inputs(n, k, block, bits, zero_points, dtype)
    a = RNG.standard_normal((2, 3, k)).astype(dtype)
    inputs = [("a", a), ("b", packed), ("s", scales), ("z", zp) if zp is not None else None]
    model, feeds = one_node_model(
        "MatMulNBits",
        inputs,
        initializers=("b", "s", "z"),
        K=k,
        N=n,
        bits=bits,
        block_size=block,
    )
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == np.float16 else {"rtol": 1e-4, "atol": 1e-4}
    assert_lowering_matches(model, feeds, **tol)


@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("with_zero_point", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dynamic_quantize_matmul(per_column, with_zero_point, with_bias):
    """``(q_a - z_a) s_a (B - z) s + bias`` with ``q_a, s_a, z_a`` the input's dynamic
    quantization: the lowering to float32 rounding, the kernel within its int16 saturation."""
    k, n = 8, 5
    a = RNG.standard_normal((3, k)).astype(np.float32)
    b = RNG.integers(-128, 128, (k, n), dtype=np.int8)
    shape = (n,) if per_column else ()
    scale = (RNG.random(shape) * 0.1 + 0.01).astype(np.float32)
    zero = RNG.integers(-5, 5, shape, dtype=np.int8)
    bias = RNG.standard_normal(n).astype(np.float32)
    inputs = [
        ("a", a),
        ("b", b),
        ("s", scale),
        ("z", zero) if with_zero_point else None,
        ("bias", bias) if with_bias else None,
    ]
    model, feeds = one_node_model("DynamicQuantizeMatMul", inputs, initializers=("b", "s", "z"))
    product, slack = dynamic_quantized_matmul(a, b, scale, zero if with_zero_point else 0)
    spec = product + (bias if with_bias else 0)
    tolerance = 1e-5 + 1e-5 * np.abs(spec)
    assert_lowering_and_kernel_match_spec(model, feeds, spec, tolerance, slack)


@pytest.mark.parametrize("per_column", [False, True])
def test_qlinear_matmul(per_column):
    """The kernel requantizes in integers, the lowering in floats: a tie may round to the
    next code of the specification's."""
    m, k, n = 3, 8, 4
    a = RNG.integers(0, 256, (m, k), dtype=np.uint8)
    b = RNG.integers(-128, 128, (k, n), dtype=np.int8)
    b_scale = (RNG.random((n,) if per_column else ()) * 0.01 + 0.001).astype(np.float32)
    b_zero = np.zeros(b_scale.shape, dtype=np.int8)
    inputs = [
        ("a", a),
        ("as", np.array(0.02, dtype=np.float32)),
        ("az", np.array(128, dtype=np.uint8)),
        ("b", b),
        ("bs", b_scale),
        ("bz", b_zero),
        ("ys", np.array(0.05, dtype=np.float32)),
        ("yz", np.array(120, dtype=np.uint8)),
    ]
    model, feeds = one_node_model(
        "QLinearMatMul", inputs, domain="", out_types=(np.uint8,), initializers=("b", "bs", "bz")
    )
    multiplier = 0.02 * b_scale.astype(np.float64) / 0.05
    spec = requantize(exact_matmul(a, b, 128, b_zero), multiplier, 120)
    slack = saturation_slack(a, b) * multiplier
    assert_lowering_and_kernel_match_spec(model, feeds, spec, 1, slack)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qlinear_conv(per_channel, with_bias):
    c_in, c_out = 3, 4
    x = RNG.integers(0, 256, (1, c_in, 6, 6), dtype=np.uint8)
    w = RNG.integers(-128, 128, (c_out, c_in, 3, 3), dtype=np.int8)
    w_scale = (RNG.random((c_out,) if per_channel else ()) * 0.01 + 0.001).astype(np.float32)
    inputs = [
        ("x", x),
        ("xs", np.array(0.02, dtype=np.float32)),
        ("xz", np.array(128, dtype=np.uint8)),
        ("w", w),
        ("ws", w_scale),
        ("wz", np.zeros(w_scale.shape, dtype=np.int8)),
        ("ys", np.array(0.3, dtype=np.float32)),
        ("yz", np.array(100, dtype=np.uint8)),
        ("bias", RNG.integers(-500, 500, c_out, dtype=np.int32)) if with_bias else None,
    ]
    model, feeds = one_node_model(
        "QLinearConv",
        inputs,
        domain="",
        out_types=(np.uint8,),
        initializers=("w", "ws", "wz", "bias"),
        pads=[1, 1, 1, 1],
    )
    patches, weights = conv_patches(x, (3, 3), 1, fill=128), weights_by_patch(w)
    accumulator = exact_matmul(patches, weights, 128) + (inputs[-1][1] if with_bias else 0)
    multiplier = 0.02 * w_scale.astype(np.float64) / 0.3
    spec = requantize(accumulator, multiplier, 100).transpose(0, 3, 1, 2)
    slack = (saturation_slack(patches, weights) * multiplier).transpose(0, 3, 1, 2)
    assert_lowering_and_kernel_match_spec(model, feeds, spec, 1, slack)


@pytest.mark.parametrize("op", ["QuantizeLinear", "DequantizeLinear"])
@pytest.mark.parametrize("per_axis", [False, True])
def test_microsoft_quantize_dequantize(op, per_axis):
    scale = (RNG.random((4,) if per_axis else ()) * 0.1 + 0.01).astype(np.float32)
    zero = RNG.integers(-3, 3, scale.shape, dtype=np.int8)
    if op == "QuantizeLinear":
        x, out = RNG.standard_normal((2, 4, 3)).astype(np.float32), np.int8
    else:
        x, out = RNG.integers(-128, 128, (2, 4, 3), dtype=np.int8), np.float32
    model, feeds = one_node_model(
        op, [("x", x), ("s", scale), ("z", zero)], out_types=(out,), initializers=("s", "z"), axis=1
    )
    assert_lowering_matches(model, feeds, rtol=1e-6, atol=1e-6)


def test_nbits_quantizer_output_differentiates():
    """onnxruntime's 4-bit quantizer's file: the input gradient through the frozen 4-bit
    weights agrees with central finite differences of onnxruntime's MatMulNBits kernel."""
    quantizer_module = pytest.importorskip(
        "onnxruntime.quantization.matmul_nbits_quantizer",
        reason="this onnxruntime build has no 4-bit quantizer kernel",
    )
    from onnx import TensorProto, helper, numpy_helper

    from onnxgrad import onnx_derivative
    from tests.derivative.fd import numerical_vjp
    from tests.normalize.kernels import run

    w1, w2 = (RNG.standard_normal(s).astype(np.float32) for s in [(32, 48), (48, 16)])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("MatMul", ["t", "w2"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 16])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    quantizer = quantizer_module.MatMulNBitsQuantizer(model, block_size=16, is_symmetric=False)
    quantizer.process()
    quantized = quantizer.model.model
    assert [n.op_type for n in quantized.graph.node].count("MatMulNBits") == 2
    x = RNG.standard_normal((3, 32)).astype(np.float32)
    seed = RNG.standard_normal((3, 16)).astype(np.float32)

    def function(values):
        return [run(quantized, {"x": values["x"].astype(np.float32)})[0].astype(np.float64)]

    expected = numerical_vjp(function, {"x": x}, ["x"], [seed], eps=1e-3)["x"]
    gradient = onnx_derivative(quantized, inputs=["x"], weights=[])
    assert not [i.name for i in gradient.graph.input if i.name not in ("x", "y_grad")]
    got = run(gradient, {"x": x, "y_grad": seed})[0]
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-2)


def _numpy_lstm(x, w, r, b):
    """ONNX's LSTM, one direction, no peepholes, from zero states, in float64: ``W`` of shape
    ``(size, 4 hidden)`` (gates i, o, f, c), ``R`` of ``(hidden, 4 hidden)``, ``b = Wb + Rb``;
    returns Y ``(seq, 1, batch, hidden)``, Y_h and Y_c."""
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    h = c = np.zeros((x.shape[1], r.shape[0]))
    outputs = []
    for step in x.astype(np.float64):
        i, o, f, g = np.split(step @ w + h @ r + b, 4, axis=-1)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
        h = sigmoid(o) * np.tanh(c)
        outputs.append(h)
    return np.stack(outputs)[:, None], h[None], c[None]


@pytest.mark.parametrize("per_gate", [False, True])
def test_dynamic_quantize_lstm(per_gate):
    """The lowering is ONNX's LSTM over the dequantized weights (numpy's, to float32
    rounding). The kernel quantizes its input and state at each step, the lowering keeps them
    float: outputs agree to the activations' quantization error (under 1e-2 here). Weight codes
    within +-64 keep every pair of uint8 x int8 products under int16's 32767 (2 * 255 * 64 =
    32640), so the kernel's sums are exact on every CPU, with VNNI or without."""
    seq, batch, size, hidden = 4, 2, 5, 3
    w = RNG.integers(-64, 65, (1, size, 4 * hidden), dtype=np.int8)
    r = RNG.integers(-64, 65, (1, hidden, 4 * hidden), dtype=np.int8)
    assert 2 * 255 * int(max(np.abs(w).max(), np.abs(r).max())) <= INT16_MAX
    shape = (1, 4 * hidden) if per_gate else (1,)
    scale = lambda: (RNG.random(shape) * 0.004 + 0.002).astype(np.float32)  # noqa: E731
    inputs = [
        ("x", RNG.standard_normal((seq, batch, size)).astype(np.float32)),
        ("w", w),
        ("r", r),
        ("b", (RNG.standard_normal((1, 8 * hidden)) * 0.1).astype(np.float32)),
        None,
        None,
        None,
        None,
        ("ws", scale()),
        ("wz", np.zeros(shape, dtype=np.int8)),
        ("rs", scale()),
        ("rz", np.zeros(shape, dtype=np.int8)),
    ]
    model, feeds = one_node_model(
        "DynamicQuantizeLSTM",
        inputs,
        n_outputs=3,
        initializers=("w", "r", "b", "ws", "wz", "rs", "rz"),
        hidden_size=hidden,
    )
    values = dict(entry for entry in inputs if entry is not None)
    biases = values["b"][0].astype(np.float64)
    spec = _numpy_lstm(
        values["x"],
        w[0] * values["ws"][0].astype(np.float64),
        r[0] * values["rs"][0].astype(np.float64),
        biases[: 4 * hidden] + biases[4 * hidden :],
    )
    for got, want in zip(lowered_outputs(model, feeds), spec, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_lowering_matches(model, feeds, rtol=0, atol=1.5e-2)


@pytest.mark.parametrize("rows", [8, 40000])
def test_lookup_into_a_quantized_table_dequantizes_the_table_first(rows):
    """``DQ(Transpose(Gather(q)))`` (quantize_dynamic's relative-bias lookup) lowers to the
    moves over ``DQ(q)``: the same values, the DequantizeLinear reading the initializer;
    a vocabulary-sized table is not dequantized whole."""
    from onnx import TensorProto, helper, numpy_helper

    from onnxgrad.normalize import normalized_model
    from tests.normalize.kernels import run

    table = np.random.default_rng(0).integers(0, 255, (rows, 2)).astype(np.uint8)
    nodes = [
        helper.make_node("Gather", ["table", "idx"], ["g"]),
        helper.make_node("Transpose", ["g"], ["t"], perm=[2, 0, 1]),
        helper.make_node("DequantizeLinear", ["t", "s", "z"], ["d"]),
        helper.make_node("Unsqueeze", ["d", "axes"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(181, np.uint8), "z"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        "lookup",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"idx": np.random.default_rng(1).integers(0, 8, (3, 3))}
    lowered = normalized_model(model)
    dequantize = [n for n in lowered.graph.node if n.op_type == "DequantizeLinear"]
    assert ([n.input[0] for n in dequantize] == ["table"]) == (rows == 8)
    np.testing.assert_array_equal(run(lowered, feeds)[0], run(model, feeds)[0])
