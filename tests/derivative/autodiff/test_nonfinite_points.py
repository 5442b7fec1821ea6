"""Gradients at points where finite differences over the whole input cannot be the oracle.

* a NaN in a Softmax input: the NaN reaches every output (and so every finite difference), but
  only its own row of the gradient may be NaN; the other rows are checked against finite
  differences of the model without that row;
* a zero row of LpNormalization: ``y = 0`` there (both runtimes), the gradient is defined as 0
  (finite differences see ``g / eps``, the jump of ``x / ||x||``); the other rows are checked
  against finite differences;
* the JVP of LpNormalization at a zero row (by transposition of that gradient): 0 there, not
  the NaN of a zero tangent divided by the zero norm; the other rows equal central
  differences of the outputs along the tangent;
* the second derivative of GlobalLpPool at an all-zero plane and of LpPool at all-zero windows
  (``y = 0``): finite everywhere (the first derivative takes 0 there), equal to finite
  differences of the first derivative along every input on which it does not jump (the
  others are excluded from the closure test for that jump).

Each gradient runs in float64 on the case's oracle (onnx's ReferenceEvaluator, onnxruntime for
LpNormalization with ``p = 1``, which the reference evaluator computes as ``p = 2``) and in
float32 on onnxruntime.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad import onnx_derivative, onnx_jvp
from tests.derivative.autodiff.gradcheck import (
    OpCase,
    case_model,
    evaluator,
    finite_differences,
    second_order,
)
from tests.derivative.autodiff.test_rules import CASES

rng = np.random.default_rng(11)


def native_gradient(case: OpCase, g: np.ndarray) -> dict[str, np.ndarray]:
    """``x_grad`` of ``case`` for the output gradient ``g``, by runtime."""
    grads = {}
    for dtype, runtime in ((np.float64, case.evaluator), (np.float32, "onnxruntime")):
        model, feeds = case_model(case, dtype)
        grad_model = onnx_derivative(model, weights=[], inputs=["x"], backend="onnx")
        feeds = {**feeds, "y0_grad": g.astype(dtype)}
        (grads[f"{runtime} {dtype.__name__}"],) = evaluator(grad_model, runtime).run(
            ["x_grad"], feeds
        )
    return grads


def expected_rows(case: OpCase, rows: list[int], g: np.ndarray) -> np.ndarray:
    """Finite differences of the model restricted to ``rows`` (rows are independent)."""
    restricted = OpCase(case.op_type, {"x": case.inputs["x"][rows]}, case.attrs, case.opset)
    model, feeds = case_model(restricted)
    return finite_differences(model, feeds, "x", [g[rows]], 1e-6, case.evaluator)


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_softmax_nan_input_propagates(opset):
    x = rng.standard_normal((3, 4))
    x[1, 2] = np.nan
    x[2, :2] = -np.inf  # partly masked: finite
    case = OpCase("Softmax", {"x": x}, {"axis": 1}, opset=opset)
    g = rng.standard_normal(x.shape)
    expected = expected_rows(case, [0, 2], g)
    for runtime, got in native_gradient(case, g).items():
        assert np.isnan(got[1]).all(), runtime
        np.testing.assert_allclose(got[[0, 2]], expected, rtol=1e-4, atol=1e-5, err_msg=runtime)


def test_softmax_fully_masked_row_zero_when_its_gradient_is():
    """An all ``-inf`` row gives a NaN row of ``y``; a downstream ``Where`` replacing it by
    zeros sends it a zero gradient, which the rule passes as 0 (a nonzero one meets the NaN
    of ``y`` and stays NaN, as for any NaN of ``y``)."""
    x = rng.standard_normal((2, 3))
    x[0] = -np.inf
    case = OpCase("Softmax", {"x": x}, {"axis": -1}, opset=13)
    g = rng.standard_normal(x.shape)
    expected = expected_rows(case, [1], g)
    silent = g.copy()
    silent[0] = 0.0
    for runtime, got in native_gradient(case, silent).items():
        np.testing.assert_array_equal(got[0], 0.0, err_msg=runtime)
        np.testing.assert_allclose(got[[1]], expected, rtol=1e-4, atol=1e-5, err_msg=runtime)
    for runtime, got in native_gradient(case, g).items():
        assert np.isnan(got[0]).all(), runtime


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_zero_row(p):
    x = rng.standard_normal((3, 4))
    x[1] = 0.0
    oracle = "onnxruntime" if p == 1 else "reference"
    case = OpCase("LpNormalization", {"x": x}, {"axis": -1, "p": p}, opset=11, evaluator=oracle)
    g = rng.standard_normal(x.shape)
    expected = expected_rows(case, [0, 2], g)
    for runtime, got in native_gradient(case, g).items():
        np.testing.assert_array_equal(got[1], 0.0, err_msg=runtime)
        np.testing.assert_allclose(got[[0, 2]], expected, rtol=1e-4, atol=1e-5, err_msg=runtime)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_jvp_at_a_zero_row(p):
    x = rng.standard_normal((3, 4))
    x[1] = 0.0
    oracle = "onnxruntime" if p == 1 else "reference"
    case = OpCase("LpNormalization", {"x": x}, {"axis": -1, "p": p}, opset=11, evaluator=oracle)
    model, feeds = case_model(case)
    v = rng.standard_normal(x.shape)
    (got,) = evaluator(onnx_jvp(model, inputs=["x"]), oracle).run(None, {**feeds, "x_tangent": v})
    session, eps = evaluator(model, oracle), 1e-6
    (up,), (down,) = (session.run(None, {"x": x + s * eps * v}) for s in (1, -1))
    np.testing.assert_array_equal(got[1], 0.0)
    expected = (up - down)[[0, 2]] / (2 * eps)
    np.testing.assert_allclose(got[[0, 2]], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("case_id", "x"),
    [
        ("GlobalLpPool-zero-plane", "X"),
        ("LpPool-zero-windows-p2", "X"),
        ("LpPool-zero-windows-p3", "X"),
        ("ReduceL2-zero-norm", "x"),
    ],
)
def test_norm_second_derivative_at_zero_norms_is_finite(case_id, x):
    """The first derivative jumps along the entries of x in an all-zero plane, window or
    reduced row: the zeros of x in these cases. Elsewhere it equals finite differences."""
    (case,) = [c for c in CASES if c.id == case_id]
    jumps = case.inputs[x] == 0
    first = second_order(case)  # its graph: the first derivative, x and z_grad -> x_grad
    model, feeds = case_model(first)
    seeds = {"y0_grad": rng.standard_normal(feeds[x].shape)}
    hessian = onnx_derivative(model, weights=[], inputs=[x, "z_grad"], backend="onnx")
    outputs = evaluator(hessian, case.evaluator).run(None, {**feeds, **seeds})
    got = dict(zip([o.name for o in hessian.graph.output], outputs))
    for name in (x, "z_grad"):
        assert np.isfinite(got[f"{name}_grad"]).all(), name
        expected = finite_differences(model, feeds, name, [seeds["y0_grad"]], 1e-6, case.evaluator)
        smooth = ~jumps if name == x else np.ones(expected.shape, bool)
        np.testing.assert_allclose(
            got[f"{name}_grad"][smooth], expected[smooth], rtol=1e-5, atol=1e-6, err_msg=name
        )
