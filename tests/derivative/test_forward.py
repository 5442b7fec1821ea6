"""Forward mode: onnx_jvp against central finite differences, onnx_hvp (forward-over-reverse)
against finite differences of the gradient and against reverse-over-reverse."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp, onnx_jvp

DOUBLE = TensorProto.DOUBLE
EPS = 1e-6


def _mlp(rng, loss: bool):
    """``t = softplus(tanh(x @ W + b) * x2)``, and ``loss = ReduceSumSquare(t)`` if asked."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Tanh", ["a"], ["h"]),
        helper.make_node("Mul", ["h", "x2"], ["p"]),
        helper.make_node("Softplus", ["p"], ["t"]),
    ]
    outputs = [helper.make_tensor_value_info("t", DOUBLE, [2, 4])]
    if loss:
        nodes.append(helper.make_node("ReduceSumSquare", ["t"], ["loss"], keepdims=0))
        outputs = [helper.make_tensor_value_info("loss", DOUBLE, [])]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [
            helper.make_tensor_value_info("x", DOUBLE, [2, 3]),
            helper.make_tensor_value_info("x2", DOUBLE, [1, 4]),
        ],
        outputs,
        [
            numpy_helper.from_array(rng.standard_normal((3, 4)), "W"),
            numpy_helper.from_array(rng.standard_normal(4), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    values = {
        "x": rng.standard_normal((2, 3)),
        "x2": rng.standard_normal((1, 4)),
        "W": numpy_helper.to_array(graph.initializer[0]),
        "b": numpy_helper.to_array(graph.initializer[1]),
    }
    return model, values


def _run(model, feeds):
    names = [o.name for o in model.graph.output]
    known = {i.name for i in model.graph.input}
    outputs = ReferenceEvaluator(model).run(None, {k: v for k, v in feeds.items() if k in known})
    return dict(zip(names, outputs))


def _with_weights(model, values):
    """The model with its initializers as inputs, so finite differences can move them."""
    from onnxgrad import replace_initializers_into_onnx  # noqa: F401  (public name check)

    graph = model.graph
    inputs = list(graph.input) + [
        helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in graph.initializer
    ]
    new = helper.make_graph(list(graph.node), graph.name, inputs, list(graph.output))
    return helper.make_model(new, opset_imports=list(model.opset_import))


@pytest.mark.parametrize("weights", [(), ("W", "b")], ids=["inputs", "inputs-and-weights"])
def test_jvp_against_finite_differences(weights):
    rng = np.random.default_rng(0)
    model, values = _mlp(rng, loss=False)
    jvp = onnx_jvp(model, weights=list(weights), keep_outputs=True)
    sources = ["x", "x2", *weights]
    assert [i.name for i in jvp.graph.input] == ["x", "x2", *weights] + [
        f"{s}_tangent" for s in sources
    ]
    tangents = {f"{s}_tangent": rng.standard_normal(values[s].shape) for s in sources}
    got = _run(jvp, {**values, **tangents})
    plain = _with_weights(model, values)

    def shifted(sign):
        moved = {s: values[s] + sign * EPS * tangents[f"{s}_tangent"] for s in sources}
        return _run(plain, {**values, **moved})["t"]

    expected = (shifted(1) - shifted(-1)) / (2 * EPS)
    np.testing.assert_allclose(got["t_tangent"], expected, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["t"], _run(model, values)["t"], rtol=1e-12)


def _softmax_model(rng, loss: bool):
    """``y = Softmax(x @ W)`` (a rule that reads its cotangent by value: the all-zero rows
    of a masked attention), and ``loss = ReduceSumSquare(y * c)`` if asked."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Softmax", ["m"], ["y"], axis=-1),
    ]
    outputs = [helper.make_tensor_value_info("y", DOUBLE, [2, 4])]
    initializers = [numpy_helper.from_array(rng.standard_normal((3, 4)), "W")]
    if loss:
        nodes += [
            helper.make_node("Mul", ["y", "c"], ["yc"]),
            helper.make_node("ReduceSumSquare", ["yc"], ["loss"], keepdims=0),
        ]
        outputs = [helper.make_tensor_value_info("loss", DOUBLE, [])]
        initializers.append(numpy_helper.from_array(rng.standard_normal(4), "c"))
    graph = helper.make_graph(
        nodes, "softmax", [helper.make_tensor_value_info("x", DOUBLE, [2, 3])], outputs
    )
    graph.initializer.extend(initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    values = {"x": rng.standard_normal((2, 3))}
    values.update({i.name: numpy_helper.to_array(i) for i in initializers})
    return model, values


@pytest.mark.parametrize("make", [_mlp, _softmax_model], ids=["mlp", "softmax"])
def test_hvp_forward_over_reverse_equals_reverse_over_reverse_and_finite_differences(make):
    """Through a Softmax too (a rule that reads its cotangent by value)."""
    rng = np.random.default_rng(1)
    model, values = make(rng, loss=True)
    hvp = onnx_hvp(model, weights=["W"], inputs=["x"])
    v = {"x": rng.standard_normal((2, 3)), "W": rng.standard_normal((3, 4))}
    got = _run(hvp, {**values, "x_tangent": v["x"], "W_tangent": v["W"]})

    gradient = onnx_derivative(model, weights=["W"], inputs=["x"], options=DerivativeOptions.Loss)
    plain_gradient = _with_weights(gradient, values)

    def grads(sign):
        moved = {s: values[s] + sign * EPS * v[s] for s in v}
        return _run(plain_gradient, {**values, **moved})

    plus, minus = grads(1), grads(-1)
    second = onnx_derivative(gradient, weights=[], inputs=["x", "W"])
    seeds = {f"{o.name}_grad": np.zeros(()) for o in gradient.graph.output}
    seeds.update({f"{s}_grad_grad": v[s] for s in v})
    reverse = _run(second, {**values, **seeds})
    for s in v:
        expected = (plus[f"{s}_grad"] - minus[f"{s}_grad"]) / (2 * EPS)
        np.testing.assert_allclose(got[f"{s}_grad_tangent"], expected, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got[f"{s}_grad_tangent"], reverse[f"{s}_grad"], rtol=1e-10)


def test_jvp_of_an_operator_without_rule_names_it():
    graph = helper.make_graph(
        [helper.make_node("Scaled", ["x"], ["y"], domain="unknown.domain")],
        "g",
        [helper.make_tensor_value_info("x", DOUBLE, [2])],
        [helper.make_tensor_value_info("y", DOUBLE, [2])],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("unknown.domain", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    with pytest.raises(NotImplementedError, match="Scaled"):
        onnx_jvp(model)


def test_jvp_after_a_softmax_is_sorted_and_agrees_with_finite_differences():
    rng = np.random.default_rng(2)
    model, values = _softmax_model(rng, loss=False)
    jvp = onnx_jvp(model, weights=["W"])
    tangents = {"x": rng.standard_normal((2, 3)), "W": rng.standard_normal((3, 4))}
    got = _run(jvp, {**values, "x_tangent": tangents["x"], "W_tangent": tangents["W"]})
    plain = _with_weights(model, values)

    def shifted(sign):
        moved = {s: values[s] + sign * EPS * t for s, t in tangents.items()}
        return _run(plain, {**values, **moved})

    expected = (shifted(1)["y"] - shifted(-1)["y"]) / (2 * EPS)
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got["y_tangent"], expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("op_type", ["Hardmax", "Floor", "Sign", "Round"])
def test_piecewise_constant_outputs_have_the_zero_derivative(op_type):
    """``y = op(x) * 2``: float all along, constant almost everywhere: gradient and tangent 0."""
    graph = helper.make_graph(
        [
            helper.make_node(op_type, ["x"], ["h"]),
            helper.make_node("Add", ["h", "h"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("y", DOUBLE, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(4).standard_normal((2, 3)) + 0.5
    gradient = _run(onnx_derivative(model), {"x": x, "y_grad": np.ones((2, 3))})
    np.testing.assert_array_equal(gradient["x_grad"], np.zeros((2, 3)))
    tangent = _run(onnx_jvp(model), {"x": x, "x_tangent": np.ones((2, 3))})
    np.testing.assert_array_equal(tangent["y_tangent"], np.zeros((2, 3)))


def test_an_output_reached_through_indices_beside_a_piecewise_constant_one():
    """``y = table[topk_indices(x)]``, ``z = floor(x)``: z reaches x through float values,
    so neither derivative is refused; both are 0, in reverse and forward mode."""
    graph = helper.make_graph(
        [
            helper.make_node("TopK", ["x", "k"], ["values", "i"], axis=1),
            helper.make_node("Gather", ["table", "i"], ["y"]),
            helper.make_node("Floor", ["x"], ["z"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", DOUBLE, [2, 3])],
        [
            helper.make_tensor_value_info("y", DOUBLE, [2, 2]),
            helper.make_tensor_value_info("z", DOUBLE, [2, 3]),
        ],
        [
            numpy_helper.from_array(np.array([2]), "k"),
            numpy_helper.from_array(np.arange(3.0), "table"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(5).standard_normal((2, 3)) + 0.5
    seeds = {"y_grad": np.ones((2, 2)), "z_grad": np.ones((2, 3))}
    gradient = _run(onnx_derivative(model), {"x": x, **seeds})
    np.testing.assert_array_equal(gradient["x_grad"], np.zeros((2, 3)))
    tangent = _run(onnx_jvp(model), {"x": x, "x_tangent": np.ones((2, 3))})
    np.testing.assert_array_equal(tangent["y_tangent"], np.zeros((2, 2)))
    np.testing.assert_array_equal(tangent["z_tangent"], np.zeros((2, 3)))


def test_outputs_reached_through_indices_only_are_still_refused():
    """An output reached only through ArgMax's integer indices has no float path: refused."""
    graph = helper.make_graph(
        [
            helper.make_node("ArgMax", ["x"], ["i"], axis=1, keepdims=0),
            helper.make_node("Gather", ["table", "i"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("y", DOUBLE, [2])],
        [numpy_helper.from_array(np.arange(3.0), "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(NotImplementedError, match="not differentiable with respect to"):
        onnx_derivative(model, weights=[])
    with pytest.raises(NotImplementedError, match=r"not differentiable with respect to \['x'\]"):
        onnx_jvp(model)
