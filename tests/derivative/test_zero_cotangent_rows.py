"""A Softmax whose cotangent row is zero while its output is finite: the gradient is still the
linear map ``g -> y (g - sum(g y))``, also in its derivatives with respect to ``g``.

The rule used to read ``y`` as 0 on every row of all-zero ``g`` (meant for the NaN rows of a
fully masked attention row), which gave the gradient's derivative with respect to ``g`` as 0
on such rows. Two paths differentiate the gradient with respect to ``g`` and were wrong:

* the transposition (``onnx_jvp`` where the tangent pass stops), which feeds cotangents of
  ones: a cotangent constant along the row reaches the Softmax as ``ones @ W^T``, zero when
  the rows of ``W`` sum to zero (onnx's Attention case with a mask cancelled so: 256 of 384
  entries of an HVP wrong);
* forward-over-reverse (``onnx_hvp``) at a point where the gradient reaching the Softmax is
  zero: attention ``softmax(x) @ V`` at ``V = 0``, whose scores get ``g = dY V^T = 0``.

Both against float64 central differences.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp, onnx_jvp

DOUBLE = TensorProto.DOUBLE
EPS = 1e-6
X = np.array([[0.1, -0.3, 0.7], [1.0, 0.2, -0.4]])
TANGENT = np.array([[1.0, 0.5, -0.25], [0.3, -1.0, 2.0]])


def _run(model, feeds) -> dict:
    outputs = ReferenceEvaluator(model).run(None, feeds)
    return dict(zip([o.name for o in model.graph.output], outputs))


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_transposed_jvp_where_the_cotangent_of_a_softmax_cancels():
    """``z = softmax(x) @ W`` with rows of ``W`` summing to 0, beside ``ReduceProd(x)`` (no
    tangent rule: the transposition builds the JVP); its cotangent of ones reaches the
    Softmax as 0 on every row. The JVP was 0."""
    w = np.array([[1.0, -1.0], [2.0, -2.0], [-0.5, 0.5]])
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "W"], ["z"]),
            helper.make_node("ReduceProd", ["x"], ["q"], keepdims=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", DOUBLE, [2, 3])],
        [
            helper.make_tensor_value_info("z", DOUBLE, [2, 2]),
            helper.make_tensor_value_info("q", DOUBLE, []),
        ],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got = _run(onnx_jvp(model), {"x": X, "x_tangent": TANGENT})
    up, down = (_softmax(X + s * EPS * TANGENT) @ w for s in (1, -1))
    expected = (up - down) / (2 * EPS)
    assert np.abs(expected).min() > 0.1
    np.testing.assert_allclose(got["z_tangent"], expected, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(got["q_tangent"], np.prod(X) * np.sum(TANGENT / X), rtol=1e-9)


def test_hvp_of_attention_at_zero_values():
    """``loss = <softmax(x) @ V, G>`` at ``V = 0``: the gradient reaching the Softmax,
    ``G V^T``, is 0, its tangent ``G V_t^T`` is not. ``x_grad``'s tangent was 0; it equals
    central differences of the gradient (and reverse-over-reverse)."""
    g = np.array([[1.0, -0.5], [0.25, 2.0]])
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["G"], value=numpy_helper.from_array(g, "G")),
            helper.make_node("Softmax", ["x"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"]),
            helper.make_node("Mul", ["y", "G"], ["yg"]),
            helper.make_node("ReduceSum", ["yg"], ["loss"], keepdims=0),
        ],
        "attention",
        [
            helper.make_tensor_value_info("x", DOUBLE, [2, 3]),
            helper.make_tensor_value_info("v", DOUBLE, [3, 2]),
        ],
        [helper.make_tensor_value_info("loss", DOUBLE, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    point = {"x": X, "v": np.zeros((3, 2))}
    tangents = {"x": TANGENT, "v": np.arange(6.0).reshape(3, 2) / 5}
    hvp = onnx_hvp(model, inputs=["x", "v"], loss="loss")
    got = _run(hvp, {**point, **{f"{n}_tangent": t for n, t in tangents.items()}})
    gradient = onnx_derivative(
        model, weights=[], inputs=["x", "v"], options=DerivativeOptions.Loss, loss="loss"
    )
    up, down = (
        _run(gradient, {n: point[n] + s * EPS * tangents[n] for n in point}) for s in (1, -1)
    )
    second = onnx_derivative(gradient, weights=[], inputs=["x", "v"])
    seeds = {"loss_grad": np.zeros(()), **{f"{n}_grad_grad": t for n, t in tangents.items()}}
    reverse = _run(second, {**point, **seeds})
    for n in point:
        expected = (up[f"{n}_grad"] - down[f"{n}_grad"]) / (2 * EPS)
        assert np.abs(expected).max() > 0.05
        np.testing.assert_allclose(got[f"{n}_grad_tangent"], expected, rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(reverse[f"{n}_grad"], expected, rtol=1e-6, atol=1e-9)
