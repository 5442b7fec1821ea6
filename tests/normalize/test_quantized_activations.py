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
