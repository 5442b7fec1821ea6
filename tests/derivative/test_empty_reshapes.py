"""Gradients through empty tensors whose shapes are computed at run time (issue 33).

The engine reshapes gradients back to shapes read at run time (``Shape(x)``). A 0 in such a
shape is a size, but ``Reshape`` reads it as "copy this dimension" unless ``allowzero=1``,
which exists from opset 14 only; below (and for Tile's gradient at every opset), onnxruntime
refused the graph (an out-of-bounds Slice, an empty batch, a Tile of one). Each model here
is run on an empty and a non-empty point, at opsets 11 (raised to 13 by normalisation), 13
and 14: the reverse gradient and the JVP (tangent pass and transposition) in onnxruntime
against float64 central differences of the model (run by onnxruntime too; an empty output
has zeros of the input's shape for gradient), the HVP against central differences of the
reverse gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from benchmarks.coverage_modes import transposition_only
from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp, onnx_jvp
from tests.derivative.fd import numerical_vjp, run_onnxruntime

DOUBLE = TensorProto.DOUBLE
EPS = 1e-6


def _model(nodes, inputs, initializers, opset: int):
    graph = helper.make_graph(
        nodes,
        f"empty_{opset}",
        inputs,
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model


def _axes(op: str, data: str, axes: list[int], out: str, opset: int) -> list:
    """A Squeeze/Unsqueeze with ``axes`` as an attribute (opset < 13) or an input."""
    if opset < 13:
        return [helper.make_node(op, [data], [out], axes=axes)]
    name = f"{out}_axes"
    constant = helper.make_tensor(name, TensorProto.INT64, [len(axes)], axes)
    return [
        helper.make_node("Constant", [], [name], value=constant),
        helper.make_node(op, [data, name], [out]),
    ]


def slice_model(opset: int):
    """``loss = sum(tanh(x[:, starts:ends])^2)`` with bounds fed at run time: an empty
    slice when ``starts`` is past the end (onnx's test_slice_start_out_of_bounds)."""
    x = helper.make_tensor_value_info("x", DOUBLE, [4, 3, 2])
    bounds = [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in ("s", "e")]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    nodes = [
        helper.make_node("Slice", ["x", "s", "e", "axes"], ["y"]),
        helper.make_node("Tanh", ["y"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["q"]),
        helper.make_node("ReduceSum", ["q"], ["loss"], keepdims=0),
    ]
    return _model(nodes, [x, *bounds], [axes], opset)


def chain_model(opset: int):
    """An empty batch (``N = 0``, on axis 1: a 0 read as "copy" takes another axis's size)
    through Unsqueeze, Flatten, Reshape and Squeeze: ``loss = sum(tanh(squeeze(reshape(
    reshape(flatten(unsqueeze(x))^2, [-1]), [3, -1, 1])))^2)``, ``N`` unknown."""
    x = helper.make_tensor_value_info("x", DOUBLE, [3, "N"])
    flat = helper.make_tensor("flat", TensorProto.INT64, [1], [-1])
    cube = helper.make_tensor("cube", TensorProto.INT64, [3], [3, -1, 1])
    nodes = [
        *_axes("Unsqueeze", "x", [0], "a", opset),
        helper.make_node("Flatten", ["a"], ["b"], axis=2),
        helper.make_node("Mul", ["b", "b"], ["c"]),
        helper.make_node("Reshape", ["c", "flat"], ["d"]),
        helper.make_node("Reshape", ["d", "cube"], ["e"]),
        *_axes("Squeeze", "e", [2], "f", opset),
        helper.make_node("Tanh", ["f"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["q"]),
        helper.make_node("ReduceSum", ["q"], ["loss"], keepdims=0),
    ]
    return _model(nodes, [x], [flat, cube], opset)


def tile_model(opset: int):
    """``loss = sum(tanh(tile(x, [1, 2]))^2)``, ``x`` of shape ``[3, N]``: the gradient
    splits each axis into (repeat, size) pairs, ``[1, 3, 2, N]``, read at run time."""
    x = helper.make_tensor_value_info("x", DOUBLE, [3, "N"])
    repeats = helper.make_tensor("repeats", TensorProto.INT64, [2], [1, 2])
    nodes = [
        helper.make_node("Tile", ["x", "repeats"], ["y"]),
        helper.make_node("Tanh", ["y"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["q"]),
        helper.make_node("ReduceSum", ["q"], ["loss"], keepdims=0),
    ]
    return _model(nodes, [x], [repeats], opset)


def _cases():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 2))
    bounds = {"out of bounds": (1000, 1000), "inside": (1, 3)}
    for opset in (11, 13, 14):
        for label, (s, e) in bounds.items():
            feeds = {"x": x, "s": np.array([s]), "e": np.array([e])}
            empty = s >= 4
            yield pytest.param(slice_model(opset), feeds, empty, id=f"slice-{label}-opset{opset}")
        for n in (0, 2):
            feeds = {"x": rng.standard_normal((3, n))}
            yield pytest.param(chain_model(opset), feeds, n == 0, id=f"chain-batch{n}-opset{opset}")
            yield pytest.param(tile_model(opset), feeds, n == 0, id=f"tile-batch{n}-opset{opset}")


CASES = list(_cases())


def _run(model, feeds: dict) -> dict:
    """``{output: value}`` from onnxruntime. The transposition's graphs sum gradients over
    axes computed at run time, which onnxruntime 1.19 got wrong on empty tensors until the
    sum was expanded to the target's shape (``builder.unbroadcast``)."""
    return run_onnxruntime(model, feeds)


def _function(model):
    """The float64 model run by onnxruntime (onnx's reference Flatten refuses an empty
    batch)."""
    return lambda feeds: [run_onnxruntime(model, feeds)["loss"]]


@pytest.mark.parametrize(("model", "feeds", "empty"), CASES)
def test_reverse_gradient(model, feeds, empty):
    gradient = onnx_derivative(model, weights=[], inputs=["x"], options=DerivativeOptions.Loss)
    got = run_onnxruntime(gradient, feeds)["x_grad"]
    expected = numerical_vjp(_function(model), feeds, ["x"])["x"]
    assert got.shape == feeds["x"].shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("transposed", [False, True], ids=["tangent", "transposed"])
@pytest.mark.parametrize(("model", "feeds", "empty"), CASES)
def test_jvp(model, feeds, empty, transposed):
    v = np.random.default_rng(1).standard_normal(feeds["x"].shape)
    if transposed:
        with transposition_only():
            jvp = onnx_jvp(model, inputs=["x"])
    else:
        jvp = onnx_jvp(model, inputs=["x"])
    got = _run(jvp, {**feeds, "x_tangent": v})["loss_tangent"]
    f = _function(model)
    plus, minus = f({**feeds, "x": feeds["x"] + EPS * v}), f({**feeds, "x": feeds["x"] - EPS * v})
    np.testing.assert_allclose(got, (plus[0] - minus[0]) / (2 * EPS), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("transposed", [False, True], ids=["tangent", "transposed"])
@pytest.mark.parametrize(("model", "feeds", "empty"), CASES)
def test_hvp(model, feeds, empty, transposed):
    v = np.random.default_rng(2).standard_normal(feeds["x"].shape)
    if transposed:
        with transposition_only():
            hvp = onnx_hvp(model, inputs=["x"])
    else:
        hvp = onnx_hvp(model, inputs=["x"])
    got = _run(hvp, {**feeds, "x_tangent": v})["x_grad_tangent"]
    gradient = onnx_derivative(model, weights=[], inputs=["x"], options=DerivativeOptions.Loss)
    moved = [
        run_onnxruntime(gradient, {**feeds, "x": feeds["x"] + sign * EPS * v})["x_grad"]
        for sign in (1, -1)
    ]
    assert got.shape == feeds["x"].shape
    np.testing.assert_allclose(got, (moved[0] - moved[1]) / (2 * EPS), rtol=1e-6, atol=1e-7)


SEEDED = [c for c in CASES if not c.id.startswith("chain")]


@pytest.mark.parametrize(("model", "feeds", "empty"), SEEDED)
def test_batched_seeds(model, feeds, empty):
    """``seeds=3`` in one run equals 3 single runs. Below opset 14 the seed axis meets the
    reshape's ``Expand`` with an input whose rank onnx does not infer (a Reshape to a shape
    computed at run time); it fell back to a ``Scan`` that onnxruntime refused (its outputs
    without shapes). The chain model's seeded HVP still falls back there at a ``Mul``."""
    tangents = np.random.default_rng(3).standard_normal((3, *feeds["x"].shape))
    batched = onnx_hvp(model, inputs=["x"], seeds=3)
    single = onnx_hvp(model, inputs=["x"])
    got = _run(batched, {**feeds, "x_tangent": tangents})["x_grad_tangent"]
    one_by_one = [_run(single, {**feeds, "x_tangent": t})["x_grad_tangent"] for t in tangents]
    np.testing.assert_allclose(got, np.stack(one_by_one), rtol=1e-12, atol=1e-12)
