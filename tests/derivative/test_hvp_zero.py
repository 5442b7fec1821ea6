"""``onnx_hvp`` where the Hessian is 0: the gradient of the loss depends on the sources only
through comparisons or indices (ReLU's and MaxPool's masks) or not at all (a linear model),
so ``H v = 0`` wherever the gradient is differentiable; checked against float64 central
differences of the gradient ``(G(x + eps v) - G(x - eps v)) / (2 eps)``."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp

DOUBLE = TensorProto.DOUBLE
EPS = 1e-6
SHAPE = [1, 2, 4, 4]


def _model(nodes, inputs, initializers=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, DOUBLE, shape) for name, shape in inputs],
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
        list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _weighted_sum(value: str, c: np.ndarray):
    """``loss = sum(value * c)``, ``c`` an initializer."""
    return [
        helper.make_node("Mul", [value, "c"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ], [numpy_helper.from_array(c, "c")]


def _relu(rng):
    tail, inits = _weighted_sum("h", rng.standard_normal(SHAPE))
    return _model([helper.make_node("Relu", ["x"], ["h"]), *tail], [("x", SHAPE)], inits)


def _max_pool(rng):
    tail, inits = _weighted_sum("h", rng.standard_normal([1, 2, 2, 2]))
    pool = helper.make_node("MaxPool", ["x"], ["h"], kernel_shape=[2, 2], strides=[2, 2])
    return _model([pool, *tail], [("x", SHAPE)], inits)


def _linear(rng):
    """``loss = sum((x @ W + x) * c)`` in ``x``, ``W`` fixed; an AveragePool beside it."""
    tail, inits = _weighted_sum("s", rng.standard_normal([1, 2, 4, 3]))
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[1, 2], strides=[1, 1]),
        helper.make_node("Add", ["m", "p"], ["s"]),
        *tail,
    ]
    inits.append(numpy_helper.from_array(rng.standard_normal([4, 3]), "W"))
    return _model(nodes, [("x", SHAPE)], inits)


def _floor(rng):
    """``loss = sum(floor(x) * x * c)``: the gradient reaches x through Floor, of derivative 0."""
    tail, inits = _weighted_sum("p", rng.standard_normal(SHAPE))
    nodes = [helper.make_node("Floor", ["x"], ["f"]), helper.make_node("Mul", ["f", "x"], ["p"])]
    return _model([*nodes, *tail], [("x", SHAPE)], inits)


def _mixed(rng):
    """``loss = sum(relu(x) * c) + sum(w * w)`` in ``x`` and the weight ``w``: the Hessian is
    ``[[0, 0], [0, 2 I]]``."""
    tail, inits = _weighted_sum("h", rng.standard_normal(SHAPE))
    nodes = [
        helper.make_node("Relu", ["x"], ["h"]),
        *tail[:1],
        helper.make_node("ReduceSum", ["weighted"], ["linear"], keepdims=0),
        helper.make_node("ReduceSumSquare", ["w"], ["square"], keepdims=0),
        helper.make_node("Add", ["linear", "square"], ["loss"]),
    ]
    inits.append(numpy_helper.from_array(rng.standard_normal([3]), "w"))
    return _model(nodes, [("x", SHAPE)], inits)


def _run(model, feeds):
    names = [o.name for o in model.graph.output]
    known = {i.name for i in model.graph.input}
    outputs = ReferenceEvaluator(model).run(None, {k: v for k, v in feeds.items() if k in known})
    return dict(zip(names, outputs))


def _differences(model, weights, point, v):
    """Central differences of the loss's gradient along ``v``, per source."""
    gradient = onnx_derivative(model, weights=weights, options=DerivativeOptions.Loss)

    def grads(sign):
        return _run(gradient, {s: point[s] + sign * EPS * v[s] for s in v})

    plus, minus = grads(1), grads(-1)
    return {s: (plus[f"{s}_grad"] - minus[f"{s}_grad"]) / (2 * EPS) for s in v}


def _point(rng, model, weights):
    point = {"x": rng.standard_normal(SHAPE)}
    point.update(
        {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name in weights}
    )
    return point


@pytest.mark.parametrize("make", [_relu, _max_pool, _linear, _floor])
def test_a_hessian_zero_wherever_it_exists_is_zeros(make):
    """Was refused (the second derivative saw no float path) where the gradient reaches x
    through masks only (Relu, MaxPool) or not at all (linear)."""
    rng = np.random.default_rng(0)
    model = make(rng)
    point = _point(rng, model, ())
    v = {"x": rng.standard_normal(SHAPE)}
    hvp = onnx_hvp(model)
    assert [i.name for i in hvp.graph.input] == ["x", "x_tangent"]
    got = _run(hvp, {**point, "x_tangent": v["x"]})["x_grad_tangent"]
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.zeros(SHAPE))
    np.testing.assert_allclose(_differences(model, (), point, v)["x"], got, atol=1e-8)
    infinite = _run(hvp, {**point, "x_tangent": np.full(SHAPE, np.inf)})["x_grad_tangent"]
    np.testing.assert_array_equal(infinite, np.zeros(SHAPE))  # zeros, not 0 * inf


def test_a_zero_block_beside_a_nonzero_one():
    rng = np.random.default_rng(1)
    model = _mixed(rng)
    point = _point(rng, model, ("w",))
    v = {"x": rng.standard_normal(SHAPE), "w": rng.standard_normal(3)}
    hvp = onnx_hvp(model, weights=["w"])
    got = _run(hvp, {**point, "x_tangent": v["x"], "w_tangent": v["w"]})
    np.testing.assert_array_equal(got["x_grad_tangent"], np.zeros(SHAPE))
    np.testing.assert_allclose(got["w_grad_tangent"], 2 * v["w"], rtol=1e-12)
    expected = _differences(model, ["w"], point, v)
    for s in v:
        np.testing.assert_allclose(got[f"{s}_grad_tangent"], expected[s], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("make", [_relu, _mixed])
def test_three_seeds_are_three_single_runs(make):
    rng = np.random.default_rng(2)
    model = make(rng)
    weights = ["w"] if make is _mixed else []
    point = _point(rng, model, weights)
    sources = ["x", *weights]
    v = {s: rng.standard_normal((3, *point[s].shape)) for s in sources}
    single, batched = onnx_hvp(model, weights=weights), onnx_hvp(model, weights=weights, seeds=3)
    got = _run(batched, {**point, **{f"{s}_tangent": v[s] for s in sources}})
    for k in range(3):
        one = _run(single, {**point, **{f"{s}_tangent": v[s][k] for s in sources}})
        for s in sources:
            assert got[f"{s}_grad_tangent"].shape == v[s].shape
            np.testing.assert_array_equal(got[f"{s}_grad_tangent"][k], one[f"{s}_grad_tangent"])


def test_the_hvp_is_refused_where_the_gradient_is():
    """``loss = table[argmax(x)]`` reaches x through indices only: the first derivative is
    refused, naming x, and so is the HVP (not zeros)."""
    nodes = [
        helper.make_node("ArgMax", ["x"], ["i"], axis=1, keepdims=0),
        helper.make_node("Gather", ["table", "i"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [("x", [2, 3])], [numpy_helper.from_array(np.arange(3.0), "table")])
    with pytest.raises(NotImplementedError, match=r"not differentiable with respect to \['x'\]"):
        onnx_hvp(model)


def test_the_rule_table_case_of_a_constant_power():
    """``x^0``: its gradient (zeros) depends on nothing, which reverse-over-reverse refuses to
    differentiate (``autodiff/test_closure.py``'s ``NOT_CHECKED``); its HVP is 0, and so are
    the differences of the gradient."""
    from tests.derivative.autodiff.gradcheck import check_hvp
    from tests.derivative.autodiff.test_closure import FIRST_ORDER

    case = next(c for c in FIRST_ORDER if c.id == "Pow-zero-exponent")
    check_hvp(case, case.evaluator, case.eps)


def test_the_refusal_survives_a_worker_process():
    """``NoFloatPath`` pickles with its sources (a sweep's worker sends it back whole)."""
    import pickle

    from onnxgrad.derivative.native import NoFloatPath

    error = pickle.loads(pickle.dumps(NoFloatPath(["x"])))
    assert error.sources == ["x"]
    assert str(error).startswith("the model is not differentiable with respect to ['x']")
