"""Quantized activations by choice: ``quantized_activations="exact"`` gives the derivative of
the deployed file itself (checked against float64 central finite differences of the file, run
by onnx's reference evaluator, at points away from every rounding boundary), the default
straight-through estimator the derivative of the file with its activation rounding removed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from onnxgrad.normalize import normalized_model
from onnxgrad.training import make_train_step
from tests.derivative.fd import onnx_numerical_vjp
from tests.normalize.kernels import run

RNG = np.random.default_rng(30)
K, N = 6, 3
OPSET = 19  # the reference evaluator's QuantizeLinear and DequantizeLinear


def _file_vjp(model: onnx.ModelProto, point: dict, name: str, seed, eps) -> np.ndarray:
    """``seed . dy/d(name)`` by float64 central differences of ``model`` itself."""
    return onnx_numerical_vjp(model, point, [name], [seed], eps=eps)[name]


def _gradients(model, mode: str, feeds: dict, weights: list[str], seed) -> dict:
    gradient = onnx_derivative(model, weights=weights, inputs=["x"], quantized_activations=mode)
    declared = {i.name for i in gradient.graph.input}
    values = {k: v for k, v in {**feeds, "y_grad": seed}.items() if k in declared}
    names = [o.name for o in gradient.graph.output]
    return dict(zip(names, run(gradient, values), strict=True))


def _static_qdq() -> tuple[onnx.ModelProto, dict]:
    """``y = QDQ(x W) V``, per-tensor uint8, the codes of ``x W`` a third of a step from every
    rounding boundary."""
    scale = np.float32(0.05)
    w = RNG.standard_normal((K, N)).astype(np.float32)
    v = RNG.standard_normal((N, 2)).astype(np.float32)
    x = RNG.standard_normal((4, K)).astype(np.float32)
    h = x @ w
    # move the last column of x so each code sits at an integer plus a third
    shift = (np.round(h / scale) + 1 / 3) * scale - h
    x[:, -1] += (shift / w[-1]).mean(axis=1)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("QuantizeLinear", ["h", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
            helper.make_node("MatMul", ["d", "V"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        [
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(v, "V"),
            numpy_helper.from_array(np.array(scale), "s"),
            numpy_helper.from_array(np.array(128, np.uint8), "z"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    return model, {"x": x, "V": v}


def _dynamic_int8(tmp_path) -> tuple[onnx.ModelProto, np.ndarray]:
    """``x W + b`` by onnxruntime's ``quantize_dynamic``, at a point where the activation's
    range is ``[-2, 3.1]`` (scale ``0.02``, zero point 100, both exact) and every other
    code a third of a step from a rounding boundary."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    w = RNG.standard_normal((K, N)).astype(np.float32)
    b = RNG.standard_normal(N).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    onnx.save(model, tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "int8.onnx", weight_type=QuantType.QInt8)
    step = 5.1 / 255
    codes = RNG.integers(-90, 140, (3, K)) + 1 / 3
    x = codes * step
    x[0, 0], x[1, 1] = -2.0, 3.1
    return onnx.load(tmp_path / "int8.onnx"), x.astype(np.float32)


def test_exact_derivative_of_a_static_qdq_file():
    model, point = _static_qdq()
    seed = RNG.standard_normal((4, 2)).astype(np.float32)
    got = _gradients(model, "exact", point, ["V"], seed)
    for name in ("x", "V"):
        expected = _file_vjp(model, point, name, seed, eps=1e-4)
        np.testing.assert_allclose(got[f"{name}_grad"], expected, rtol=1e-4, atol=1e-5)
    assert not np.any(got["x_grad"])  # the codes are constant around the point
    straight = _gradients(model, "straight_through", point, ["V"], seed)
    w = numpy_helper.to_array(model.graph.initializer[0])
    # the file without its rounding: y = x W V, every code inside [0, 255]
    np.testing.assert_allclose(straight["x_grad"], seed @ point["V"].T @ w.T, rtol=1e-5, atol=1e-5)


def test_exact_derivative_of_a_dynamically_quantized_file(tmp_path):
    model, x = _dynamic_int8(tmp_path)
    seed = RNG.standard_normal((3, N)).astype(np.float32)
    got = _gradients(model, "exact", {"x": x}, [], seed)["x_grad"]
    expected = _file_vjp(model, {"x": x}, "x", seed, eps=1e-3)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)
    moved = np.zeros_like(got, dtype=bool)
    moved[0, 0] = moved[1, 1] = True  # the scale reads the range: its two ends only
    assert np.all(got[~moved] == 0) and np.all(got[moved] != 0)
    straight = _gradients(model, "straight_through", {"x": x}, [], seed)["x_grad"]
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    weight = (inits["w_quantized"].astype(np.float64) - inits["w_zero_point"]) * inits["w_scale"]
    np.testing.assert_allclose(straight, seed @ weight.T, rtol=1e-5, atol=1e-5)


def test_the_option_reaches_the_train_step_and_is_checked():
    model, _ = _static_qdq()
    exact = make_train_step(model, ["W", "V"], quantized_activations="exact")
    straight = make_train_step(model, ["W", "V"])
    # rounding held, nothing reaches W through the codes: its update reads no gradient
    assert len(exact.model.graph.node) < len(straight.model.graph.node)
    with pytest.raises(ValueError, match="quantized_activations must be one of"):
        onnx_derivative(model, quantized_activations="ste")


def test_info_says_how_each_quantized_node_is_differentiated(tmp_path):
    """A QDQ model whose gradient and train step build: ``info`` reports no stop (its
    ``QuantizeLinear`` gives integers, no gradient asks for its rule) and names the estimator,
    or, asked, the rounding held."""
    from tests.cli.helpers import run_in_process

    model, _ = _static_qdq()
    onnx.save(model, tmp_path / "qdq.onnx")
    onnx_derivative(model)  # builds
    make_train_step(model)
    default = run_in_process("info", "qdq.onnx", cwd=tmp_path)
    assert default.returncode == 0, default.stderr
    assert "QuantizeLinear x1: activations: straight-through estimator" in default.stdout
    assert "nothing: the gradient and the train step build" in default.stdout
    assert "ops without a native gradient rule:\n  none" in default.stdout
    exact = run_in_process("info", "qdq.onnx", "--quantized-activations", "exact", cwd=tmp_path)
    assert exact.returncode == 0, exact.stderr
    assert "QuantizeLinear x1: activations: the file's own derivative" in exact.stdout


def test_info_reports_no_stop_for_a_dynamic_quantization_whose_gradient_builds(tmp_path):
    """``quantize_dynamic``'s ``DynamicQuantizeLinear`` has no rule, and no gradient flows
    through it (its codes are integers, its scale is read held): ``info`` listed it as
    stopping the build, which builds."""
    from tests.cli.helpers import run_in_process

    model, _ = _dynamic_int8(tmp_path)
    onnx.save(model, tmp_path / "int8.onnx")
    onnx_derivative(model)  # builds
    make_train_step(model)
    result = run_in_process("info", "int8.onnx", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    stops = result.stdout.split("what stops differentiation or training")[1]
    assert "nothing: the gradient and the train step build" in stops, stops


def _scale_slope(x: np.ndarray) -> np.ndarray:
    """``d s / d x`` of ``s = (max(0, max x) - min(0, min x)) / 255`` (numpy) where the
    maximum and the minimum are single elements on either side of 0."""
    slope = np.zeros(x.shape)
    slope[np.unravel_index(np.argmax(x), x.shape)] = 1 / 255
    slope[np.unravel_index(np.argmin(x), x.shape)] = -1 / 255
    return slope


def _with_scale_output(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its ``DynamicQuantizeLinear``'s ``y_scale`` as a second output."""
    (dynamic,) = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear"]
    model.graph.output.append(
        helper.make_tensor_value_info(dynamic.output[1], TensorProto.FLOAT, [])
    )
    return model


@pytest.mark.parametrize("mode", ["straight_through", "exact"])
def test_the_dynamic_scale_read_as_a_float_has_its_derivative(tmp_path, mode):
    """``quantize_dynamic``'s product with its activation scale also an output: the scale's
    derivative reaches ``x`` in both modes (it was 0 under the estimator), while the scale
    that rescales the integer product stays held under the estimator."""
    model, x = _dynamic_int8(tmp_path)
    model = _with_scale_output(model)
    seed = RNG.standard_normal((3, N)).astype(np.float32)
    seed_scale = np.array(RNG.standard_normal() * 100, dtype=np.float32)
    gradient = onnx_derivative(model, inputs=["x"], weights=[], quantized_activations=mode)
    feeds = {"x": x, "y_grad": seed, f"{model.graph.output[1].name}_grad": seed_scale}
    got = run(gradient, feeds)[0]
    # the scale alone: float64 central differences of the file, and the formula's slope
    alone = onnx_numerical_vjp(model, {"x": x}, ["x"], [np.zeros_like(seed), seed_scale], eps=1e-3)
    slope = seed_scale * _scale_slope(x)
    np.testing.assert_allclose(alone["x"], slope, rtol=1e-3)  # the evaluator's float32 scale
    if mode == "exact":
        expected = onnx_numerical_vjp(model, {"x": x}, ["x"], [seed, seed_scale], eps=1e-3)["x"]
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)  # as alone
        return
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    codes = inits["w_quantized"].astype(np.float64) - inits["w_zero_point"]
    expected = seed @ (codes * inits["w_scale"]).T + slope
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _dequantized_dynamic() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """``y = DequantizeLinear(DynamicQuantizeLinear(x)) * v`` at a point of range ``[-2,
    3.1]`` (scale ``0.02``, zero point 100) whose other codes sit a third of a step from a
    rounding boundary."""
    v = RNG.standard_normal((3, K)).astype(np.float32)
    codes = RNG.integers(-90, 140, (3, K)) + 1 / 3
    x = codes * (5.1 / 255)
    x[0, 0], x[1, 1] = -2.0, 3.1
    graph = helper.make_graph(
        [
            helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
            helper.make_node("Mul", ["d", "v"], ["y"]),
        ],
        "dq_dynamic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, K])],
        [numpy_helper.from_array(v, "v")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    return model, x.astype(np.float32), v


@pytest.mark.parametrize("mode", ["straight_through", "exact"])
def test_a_dequantized_dynamic_quantization(mode):
    """``DequantizeLinear`` of a ``DynamicQuantizeLinear``'s own outputs: the identity under
    the estimator (it was a silent 0: codes constant, scale held), the file's derivative
    ``(q - z) ds/dx`` with rounding held (float64 central differences of the file)."""
    model, x, v = _dequantized_dynamic()
    seed = RNG.standard_normal((3, K)).astype(np.float32)
    got = _gradients(model, mode, {"x": x}, [], seed)["x_grad"]
    if mode == "exact":
        expected = _file_vjp(model, {"x": x}, "x", seed, eps=1e-3)
        assert np.count_nonzero(expected) == 2  # the two ends of the range
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)  # a float32 scale
    else:  # every code inside [0, 255]: the round trip is the identity
        np.testing.assert_allclose(got, seed * v, rtol=1e-6, atol=1e-6)
    value = run(normalized_model(model), {"x": x})[0]
    np.testing.assert_array_equal(value, run(model, {"x": x})[0])


def test_the_scale_output_keeps_the_kernels_values_and_shares_ties():
    """The differentiable scale is the kernel's value bit for bit (onnxruntime writes 1 for
    an all-zero ``x``; subnormal and huge ranges), and at ties the derivative is shared:
    equally between tied maxima, half of it where the minimum is 0 (``min(0, min x)``)."""
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    lowered = normalized_model(model)
    for x in ([[0] * 3] * 2, [[1e-40, 2e-41, 0], [0, 0, -3e-42]], [[3e30, -1, 0], [2, 2, 2]]):
        x = np.array(x, dtype=np.float32)
        np.testing.assert_array_equal(run(lowered, {"x": x})[0], run(model, {"x": x})[0])
    gradient = onnx_derivative(model, inputs=["x"], weights=[])
    x = np.array([[2, 1, 0], [2, 0, 1]], dtype=np.float32)
    (got,) = run(gradient, {"x": x, "s_grad": np.array(255, dtype=np.float32)})
    np.testing.assert_array_equal(got, [[0.5, 0, -0.25], [0.5, -0.25, 0]])


def _fake_quantized(layout: str) -> tuple[onnx.ModelProto, dict, np.ndarray]:
    """``y = DequantizeLinear(QuantizeLinear(x)) * v`` with per-axis (one scale per column),
    blocked (one per pair of columns) or float16 per-tensor parameters, at a point a third
    of a step from rounding boundaries where some codes saturate, and the in-range mask."""
    x = RNG.standard_normal((3, 4)) * 4
    dtype, opset, attrs = np.float32, 13, {"axis": 1}
    if layout == "per_axis":
        scale, zero = np.array([0.01, 0.02, 0.03, 0.05]), np.array([0, 100, 128, 200])
        full_scale, full_zero = scale, zero
    elif layout == "blocked":
        scale, zero = np.array([[0.01, 0.05]] * 3), np.array([[120, 10]] * 3)
        full_scale, full_zero = np.repeat(scale, 2, axis=1), np.repeat(zero, 2, axis=1)
        opset, attrs = 21, {"axis": 1, "block_size": 2}
    else:
        scale, zero = np.array(0.03), np.array(128)
        full_scale, full_zero, dtype, opset, attrs = scale, zero, np.float16, 19, {}
    codes = np.round(x / full_scale) + 1 / 3
    x = (codes * full_scale).astype(dtype)
    mask = (np.round(x / full_scale) + full_zero >= 0) & (
        np.round(x / full_scale) + full_zero <= 255
    )
    assert 0 < mask.sum() < mask.size
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    v = RNG.standard_normal((3, 4)).astype(dtype)
    params = [
        numpy_helper.from_array(v, "v"),
        numpy_helper.from_array(scale.astype(dtype), "s"),
        numpy_helper.from_array(zero.astype(np.uint8), "z"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], **attrs),
            helper.make_node("Mul", ["d", "v"], ["y"]),
        ],
        "fake_quantized",
        [helper.make_tensor_value_info("x", elem, [3, 4])],
        [helper.make_tensor_value_info("y", elem, [3, 4])],
        params,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return model, {"x": x}, mask


@pytest.mark.parametrize("layout", ["per_axis", "blocked", "float16"])
def test_straight_through_for_every_quantization_layout(layout):
    """Per-axis, blocked and float16 activation pairs get the estimator (they were kept as
    they are, a silent 0 through the integer codes): the gradient is ``seed * v * mask``
    (numpy), the values the file's, and normalising again adds nothing."""
    model, feeds, mask = _fake_quantized(layout)
    lowered = normalized_model(model)
    np.testing.assert_array_equal(run(lowered, feeds)[0], run(model, feeds)[0])
    assert len(normalized_model(lowered).graph.node) == len(lowered.graph.node)
    v = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float32)
    seed = RNG.standard_normal((3, 4)).astype(v.dtype)
    gradient = onnx_derivative(model, inputs=["x"], weights=[])
    (got,) = run(gradient, {**feeds, "y_grad": seed.astype(feeds["x"].dtype)})
    np.testing.assert_allclose(got.astype(np.float32), seed * v * mask, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("code", [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2])
def test_straight_through_for_float8_codes(code):
    """A pair through float8 codes gets the estimator too (it was a silent 0): ``seed * v``
    where ``|x / s|`` is within the largest finite code (448, 57344), 0 where it saturates."""
    x = (RNG.standard_normal((3, 4)) * 3).astype(np.float32)
    x[0, 0] = 500.0
    v = RNG.standard_normal((3, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
            helper.make_node("Mul", ["d", "v"], ["y"]),
        ],
        "float8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        [
            numpy_helper.from_array(v, "v"),
            numpy_helper.from_array(np.array(1.0, dtype=np.float32), "s"),
            helper.make_tensor("z", code, [], [0]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    np.testing.assert_array_equal(
        run(normalized_model(model), {"x": x})[0], run(model, {"x": x})[0]
    )
    seed = RNG.standard_normal((3, 4)).astype(np.float32)
    (got,) = run(onnx_derivative(model, inputs=["x"], weights=[]), {"x": x, "y_grad": seed})
    largest = 448 if code == TensorProto.FLOAT8E4M3FN else 57344
    np.testing.assert_allclose(got, seed * v * (np.abs(x) <= largest), rtol=1e-6, atol=1e-6)
