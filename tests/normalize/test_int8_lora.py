"""``quantize_dynamic``'s int8 products (``DynamicQuantizeLinear`` + ``MatMulInteger``) and
``DynamicQuantizeMatMul`` read as float products over the dequantized weight: values against
the operators' specification in exact integer arithmetic (numpy) and onnxruntime's integer
kernels within the error of their CPU path, gradients against numpy, LoRA adapters over the
frozen int8 weight against numpy and finite differences."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import add_lora, get_train_initializer, merge_lora, onnx_derivative
from onnxgrad.graph.lora import lora_adapters
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import numerical_vjp
from tests.normalize.integer_products import (
    dynamic_quantize,
    dynamic_quantized_matmul,
    with_exact_integer_products,
)
from tests.normalize.kernels import assert_within, run

RNG = np.random.default_rng(20)
K, N = 12, 5


def _quantize_dynamic(tmp_path, per_channel: bool, unsigned: bool) -> onnx.ModelProto:
    """``x W + b`` quantized by onnxruntime's ``quantize_dynamic``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    w = RNG.standard_normal((K, N)).astype(np.float32)
    b = RNG.standard_normal(N).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, N])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, tmp_path / "float.onnx")
    kind = QuantType.QUInt8 if unsigned else QuantType.QInt8
    quantize_dynamic(
        tmp_path / "float.onnx", tmp_path / "int8.onnx", weight_type=kind, per_channel=per_channel
    )
    return onnx.load(tmp_path / "int8.onnx")


def _hand_written() -> onnx.ModelProto:
    """The same pattern with the factors of each ``Mul`` swapped, a per-column scale and
    one zero point for the whole weight."""
    node = helper.make_node
    inits = {
        "w_quantized": RNG.integers(-128, 128, (K, N), dtype=np.int8),
        "w_scale": (RNG.random(N) * 0.02 + 0.005).astype(np.float32),
        "w_zero_point": np.array(3, np.int8),
    }
    graph = helper.make_graph(
        [
            node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
            node("MatMulInteger", ["xq", "w_quantized", "xz", "w_zero_point"], ["p"]),
            node("Cast", ["p"], ["pf"], to=TensorProto.FLOAT),
            node("Mul", ["w_scale", "xs"], ["scales"]),
            node("Mul", ["scales", "pf"], ["y"]),
        ],
        "hand_written",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, N])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _dynamic_quantize_matmul() -> onnx.ModelProto:
    """onnxruntime's fused ``DynamicQuantizeMatMul`` with per-column scales and a bias."""
    inits = {
        "w_quantized": RNG.integers(-128, 128, (K, N), dtype=np.int8),
        "w_scale": (RNG.random(N) * 0.02 + 0.005).astype(np.float32),
        "w_zero_point": RNG.integers(-4, 4, N, dtype=np.int8),
        "bias": RNG.standard_normal(N).astype(np.float32),
    }
    graph = helper.make_graph(
        [
            helper.make_node(
                "DynamicQuantizeMatMul",
                ["x", "w_quantized", "w_scale", "w_zero_point", "bias"],
                ["y"],
                domain="com.microsoft",
            )
        ],
        "fused",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, N])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    imports = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=8)


FORMS = {
    "per_tensor_int8": lambda tmp: _quantize_dynamic(tmp, per_channel=False, unsigned=False),
    "per_channel_int8": lambda tmp: _quantize_dynamic(tmp, per_channel=True, unsigned=False),
    "per_channel_uint8": lambda tmp: _quantize_dynamic(tmp, per_channel=True, unsigned=True),
    "hand_written": lambda tmp: _hand_written(),
    "DynamicQuantizeMatMul": lambda tmp: _dynamic_quantize_matmul(),
}


def _dequantized_weight(model: onnx.ModelProto) -> np.ndarray:
    """``(q - z) s`` of the model's one integer matrix, in numpy (per column where ``s`` is)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    codes = inits["w_quantized"].astype(np.float64)
    return (codes - inits["w_zero_point"]) * inits["w_scale"]


def _dynamic_round_trip(x: np.ndarray) -> np.ndarray:
    """``DynamicQuantizeLinear`` then dequantization, as the ONNX specification defines it."""
    codes, scale, zero = dynamic_quantize(x)
    return ((codes.astype(np.float64) - zero) * scale).astype(np.float32)


def _specified_output(model: onnx.ModelProto, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The model's output as its operators' specification defines it, in exact integer
    arithmetic (``(q_x - z_x)(q - z)``, scaled once, plus the bias), and the error
    onnxruntime's u8s8 kernel may add to it on a CPU without VNNI (zero for a uint8 weight)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    weight = [inits[f"w_{part}"] for part in ("quantized", "scale", "zero_point")]
    product, slack = dynamic_quantized_matmul(x, *weight)
    bias = next((inits[n] for n in ("b", "bias") if n in inits), 0)
    return product + bias, slack


@pytest.mark.parametrize("form", list(FORMS))
def test_int8_product_reads_the_dequantized_weight(tmp_path, form):
    model = FORMS[form](tmp_path)
    lowered = normalized_model(model)
    ops = {n.op_type for n in lowered.graph.node}
    assert not ops & {"MatMulInteger", "DynamicQuantizeMatMul"}, ops
    producers = {o: n for n in lowered.graph.node for o in n.output}
    (matmul,) = [n for n in lowered.graph.node if n.op_type == "MatMul"]
    weight = producers[matmul.input[1]]
    assert weight.op_type == "DequantizeLinear" and weight.input[0] == "w_quantized"
    x = (RNG.standard_normal((2, 3, K)) * 3).astype(np.float32)
    spec, slack = _specified_output(model, x)
    tolerance = 1e-5 + 1e-5 * np.abs(spec)
    assert_within(run(lowered, {"x": x})[0], spec, tolerance, "the lowering")
    assert_within(run(model, {"x": x})[0], spec, tolerance + slack, "onnxruntime's kernels")
    seed = RNG.standard_normal(spec.shape).astype(np.float32)
    got = run(onnx_derivative(model, inputs=["x"], weights=[]), {"x": x, "y_grad": seed})[0]
    np.testing.assert_allclose(got, seed @ _dequantized_weight(model).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", list(FORMS))
def test_lora_over_a_frozen_int8_weight(tmp_path, form):
    model = FORMS[form](tmp_path)
    adapted = add_lora(model, rank=2)
    (adapter,) = lora_adapters(adapted)
    assert adapter["weight"] == "w_quantized"
    biases = {"b", "bias"} & {i.name for i in model.graph.initializer}
    assert set(get_train_initializer(adapted)) == {adapter["a"], adapter["b"], *biases}
    inits = {i.name: i for i in adapted.graph.initializer}
    assert inits["w_quantized"].data_type in (TensorProto.INT8, TensorProto.UINT8)
    x = (RNG.standard_normal((2, 3, K)) * 3).astype(np.float32)
    # the adapted model runs the deployed integer kernel itself: equal on every CPU
    np.testing.assert_allclose(run(adapted, {"x": x})[0], run(model, {"x": x})[0], atol=1e-5)

    a = numpy_helper.to_array(inits[adapter["a"]])
    b = RNG.standard_normal((2, N)).astype(np.float32)
    trained = _with_values(adapted, {adapter["b"]: b})
    # a float branch beside the untouched integer product: it reads x itself
    expected = run(model, {"x": x})[0] + x @ (a @ b)
    np.testing.assert_allclose(run(trained, {"x": x})[0], expected, rtol=1e-4, atol=1e-4)

    seed = RNG.standard_normal(expected.shape).astype(np.float32)
    values = {adapter["a"]: a, adapter["b"]: b}
    gradient = onnx_derivative(trained, weights=list(values), inputs=[])
    names = [o.name for o in gradient.graph.output]
    got = dict(zip(names, run(gradient, {"x": x, "y_grad": seed, **values}), strict=True))

    def function(point):
        cast = {k: np.asarray(v, dtype=np.float32) for k, v in point.items()}
        return [run(_with_values(trained, cast), {"x": x})[0].astype(np.float64)]

    reference = numerical_vjp(function, values, list(values), [seed], eps=1e-2)
    for name in values:
        np.testing.assert_allclose(got[f"{name}_grad"], reference[name], rtol=2e-3, atol=2e-3)
    merged = merge_lora(trained)
    assert lora_adapters(merged) == [adapter]
    kept = {i.name: i for i in merged.graph.initializer}["w_quantized"]
    assert kept.SerializeToString() == inits["w_quantized"].SerializeToString()
    np.testing.assert_array_equal(run(merged, {"x": x})[0], run(trained, {"x": x})[0])
    # folded and quantized again in the product's own format: the deployed operators, and
    # the product of x_hat and the new codes within the activation's and new codes' rounding
    requantized = merge_lora(trained, quantized="requantize")
    assert sorted(n.op_type for n in requantized.graph.node) == sorted(
        n.op_type for n in model.graph.node
    )
    low_rank = (a @ b).astype(np.float64)
    folded = _specified_output(model, x)[0] + x @ low_rank  # the branch at its product
    new_spec, new_slack = _specified_output(requantized, x)
    ((_, _, bound),) = _products(requantized, x, ["w_"], [low_rank])
    assert_within(new_spec, folded, bound + 1e-6 * np.abs(folded), "the re-quantized model")
    tight = 1e-5 + 1e-5 * np.abs(new_spec)
    exact = run(with_exact_integer_products(requantized), {"x": x})[0]
    assert_within(exact, new_spec, tight, "the re-quantized model, its products summed exactly")
    tolerance = tight + new_slack
    assert_within(run(requantized, {"x": x})[0], new_spec, tolerance, "onnxruntime's kernels")


def _rounding_bound(x: np.ndarray, scale: np.ndarray, low_rank: np.ndarray) -> np.ndarray:
    """The largest ``|q(x) W_q - (q(x) W + x L)|`` the specification allows once ``W + L`` is
    quantized again (``W_q``, within half its new step ``scale`` per column) and the branch
    ``x L`` is read through the quantized activation ``q(x)`` instead of ``x``:
    ``|q(x)| s / 2 + |q(x) - x| |L|``."""
    x_hat = _dynamic_round_trip(x).astype(np.float64)
    half_step = np.abs(x_hat).sum(axis=-1, keepdims=True) * np.asarray(scale, np.float64) / 2
    return half_step + np.abs(x_hat - x) @ np.abs(low_rank)


def _products(model, x, prefixes, low_ranks) -> list[tuple[np.ndarray, ...]]:
    """For each product of ``model`` (weights ``{prefix}quantized``, ``_scale``,
    ``_zero_point``): its value as the specification defines it, the error onnxruntime's
    u8s8 kernel may add to it, and the bound ``_rounding_bound`` of its re-quantization
    after the branch ``x L`` (``low_ranks``) was folded into it."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found = []
    for prefix, low_rank in zip(prefixes, low_ranks, strict=True):
        weight = [inits[f"{prefix}{part}"] for part in ("quantized", "scale", "zero_point")]
        product, slack = dynamic_quantized_matmul(x, *weight)
        found.append((product, slack, _rounding_bound(x, weight[1], low_rank)))
    return found


def _product_error(factors, errors) -> np.ndarray:
    """The largest error of ``f1 f2`` when each factor ``f_i`` is off by up to ``e_i``:
    ``e1 |f2| + |f1| e2 + e1 e2``."""
    (f1, f2), (e1, e2) = factors, errors
    return e1 * np.abs(f2) + np.abs(f1) * e2 + e1 * e2


def _with_values(model, values):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for init in model.graph.initializer:
        if init.name in values:
            init.CopyFrom(numpy_helper.from_array(values[init.name], init.name))
    return model


def test_product_of_two_dynamically_quantized_activations():
    """Both factors quantized by their own ``DynamicQuantizeLinear``: the gradient reaches
    both, through the straight-through estimator (numpy: the product of the round trips)."""
    node = helper.make_node
    graph = helper.make_graph(
        [
            node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
            node("DynamicQuantizeLinear", ["w"], ["wq", "ws", "wz"]),
            node("MatMulInteger", ["xq", "wq", "xz", "wz"], ["p"]),
            node("Cast", ["p"], ["pf"], to=TensorProto.FLOAT),
            node("Mul", ["xs", "ws"], ["scales"]),
            node("Mul", ["pf", "scales"], ["y"]),
        ],
        "two_activations",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [K, N]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {
        "x": RNG.standard_normal((3, K)).astype(np.float32),
        "w": RNG.standard_normal((K, N)).astype(np.float32),
    }
    expected = run(model, feeds)[0]
    np.testing.assert_allclose(run(normalized_model(model), feeds)[0], expected, atol=1e-5)
    seed = RNG.standard_normal(expected.shape).astype(np.float32)
    gradient = onnx_derivative(model, inputs=["x", "w"], weights=[])
    names = [o.name for o in gradient.graph.output]
    got = dict(zip(names, run(gradient, {**feeds, "y_grad": seed}), strict=True))
    x_hat, w_hat = (_dynamic_round_trip(feeds[k]) for k in ("x", "w"))
    np.testing.assert_allclose(got["x_grad"], seed @ w_hat.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["w_grad"], x_hat.T @ seed, rtol=1e-5, atol=1e-5)


def test_adapters_sit_at_their_own_product_in_a_gated_int8_block(tmp_path):
    """``(x W1) * (x W2)`` quantized by ``quantize_dynamic``: the output ``Mul`` of the
    second product reads data, so it is no scale of that product; each adapter's branch is
    added to its own product, not to the gate (checked against numpy), and folding it with
    re-quantization gives the same values within the new quantization step."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weights = {f"w{i}": RNG.standard_normal((K, N)).astype(np.float32) for i in (1, 2)}
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h1"]),
            helper.make_node("MatMul", ["x", "w2"], ["h2"]),
            helper.make_node("Mul", ["h1", "h2"], ["y"]),
        ],
        "gated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "int8.onnx", weight_type=QuantType.QInt8)
    model = onnx.load(tmp_path / "int8.onnx")
    adapted = add_lora(model, rank=2)
    inits = {i.name: numpy_helper.to_array(i) for i in adapted.graph.initializer}
    adapters = lora_adapters(adapted)
    update = {a["b"]: RNG.standard_normal((2, N)).astype(np.float32) for a in adapters}
    trained = _with_values(adapted, update)
    x = RNG.standard_normal((4, K)).astype(np.float32)
    ordered = sorted(lora_adapters(trained), key=lambda a: a["weight"])
    assert [a["weight"] for a in ordered] == ["w1_quantized", "w2_quantized"]
    low_ranks = [inits[a["a"]] @ update[a["b"]] * a["scale"] for a in ordered]
    # each branch added to its own product (the specification's, exact), not to the gate
    found = _products(model, x, ["w1_", "w2_"], low_ranks)
    factors = [p + x @ low_rank for (p, _, _), low_rank in zip(found, low_ranks, strict=True)]
    expected = factors[0] * factors[1]
    tight = 1e-4 * np.abs(expected) + 1e-3
    exact = run(with_exact_integer_products(trained), {"x": x})[0]
    assert_within(exact, expected, tight, "the adapted model, its products summed exactly")
    slack = _product_error(factors, [s for _, s, _ in found])
    assert_within(run(trained, {"x": x})[0], expected, tight + slack, "the adapted model")
    requantized = merge_lora(trained, quantized="requantize")
    assert sorted(n.op_type for n in requantized.graph.node) == sorted(
        n.op_type for n in model.graph.node
    )
    found = _products(requantized, x, ["w1_", "w2_"], low_ranks)
    spec = found[0][0] * found[1][0]
    bound = _product_error(factors, [b for _, _, b in found])
    assert_within(spec, expected, bound + 1e-6 * np.abs(expected), "the re-quantized model")
    tight = 1e-5 + 1e-5 * np.abs(spec)
    exact = run(with_exact_integer_products(requantized), {"x": x})[0]
    assert_within(exact, spec, tight, "the re-quantized model, its products summed exactly")
    slack = _product_error([p for p, _, _ in found], [s for _, s, _ in found])
    assert_within(run(requantized, {"x": x})[0], spec, tight + slack, "onnxruntime's kernels")
