"""The ``ops`` sweep of benchmarks/coverage_modes.py (benchmarks/_modes_ops.py) on a few of
onnx's operator cases (the full run is a benchmark, not a test), and its comparison."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import _modes_ops
from benchmarks.coverage_ops import Precision

FLOAT64 = Precision(1e-6, 1e-4)


def test_jvp_and_hvp_on_a_few_operators():
    results = list(_modes_ops.ops_results({"Relu", "LpNormalization"}, {"jvp", "hvp"}))
    statuses: dict[tuple[str, str], set[str]] = {}
    for case, mode, status, _ in results:
        op = "Relu" if "relu" in case else "LpNormalization"
        statuses.setdefault((op, mode), set()).add(status)
    assert statuses[("Relu", "jvp")] == {"ok"}
    assert statuses[("Relu", "hvp")] == {"ok (zero)"}, "Relu's Hessian is zero, and computed"
    # test_l2normalization_axis_0 has an all-zero column: its JVP was NaN there
    assert statuses[("LpNormalization", "jvp")] == {"ok"}
    assert statuses[("LpNormalization", "hvp")] == {"ok"}


def _square(point):
    return [point["x"] ** 2]


@pytest.mark.parametrize(("factor", "verdict"), [(2.0, "ok"), (2.1, "wrong")])
def test_a_tangent_is_compared_entry_by_entry(factor, verdict):
    x = np.array([0.5, -1.0, 2.0])
    v = {"x": np.array([1.0, 0.5, -0.25])}
    got = [factor * x * v["x"]]
    status, _ = _modes_ops._compare(_square, got, {"x": x}, v, FLOAT64, ["y"])
    assert status == verdict


def test_a_kink_along_the_tangent_is_no_verdict():
    x, v = np.array([0.0, 1.0]), {"x": np.array([1.0, 1.0])}
    with pytest.raises(_modes_ops.NoDerivative):
        _modes_ops._compare(lambda p: [np.abs(p["x"])], [v["x"]], {"x": x}, v, FLOAT64, ["y"])


def test_the_hvp_through_a_function_defined_operator():
    """Attention with a mask, a causal window and padded keys: the HVP's gradient graph keeps
    the forward ``Attention`` node, which has no tangent rule; the tangent pass follows its
    function body (it fell back to the transposition, whose mask-to-``V_grad`` cross term was
    wrong in 256 of 384 entries)."""
    from benchmarks.coverage_ops import collect_cases

    name = "test_attention_local_window_ext_cache_float16_mask"
    case = next(c for c in collect_cases({"Attention"}) if c[0] == name)
    assert dict((m, s) for m, s, _ in _modes_ops.check_ops_case(*case, {"jvp", "hvp"})) == {
        "jvp": "ok",
        "hvp": "ok",
    }


def test_curvature_beside_a_small_derivative_is_judged():
    """``f = 50 x^2`` at ``x = 1e-7``: the one-sided quotients differ by ``2 * 50 eps``, far
    beyond ``f' = 1e-5`` but a quarter of it at ``eps / 4``: smooth, judged (a kink keeps its
    jump at any step: ``test_a_kink_along_the_tangent_is_no_verdict``)."""
    x, v = np.array([1e-7, 1.0]), {"x": np.array([1.0, 1.0])}
    got = [100 * x * v["x"]]
    status, _ = _modes_ops._compare(lambda p: [50 * p["x"] ** 2], got, {"x": x}, v, FLOAT64, ["y"])
    assert status == "ok"


@pytest.mark.parametrize(
    "name", ["test_rms_normalization_4d_axis1", "test_rms_normalization_3d_axis0_epsilon"]
)
def test_the_float64_rms_normalization_gradient(name):
    """The numpy float64 gradient that judges RMSNormalization's HVP (its function body's
    statistics are float32) equals float64 central differences of onnx's reference
    RMSNormalization (which computes in float64), and the HVP is judged ``ok``: it was not
    judged (the float32 rounding of onnxgrad's gradient looked like kinks)."""
    from benchmarks._float64_gradients import float64_gradient
    from benchmarks.coverage_ops import as_array, collect_cases, to_double
    from tests.derivative.fd import onnx_numerical_vjp

    case = next(c for c in collect_cases({"RMSNormalization"}) if c[0] == name)
    model = to_double(case[1])
    point = {i.name: as_array(v).astype(np.float64) for i, v in zip(model.graph.input, case[2])}
    seed = np.random.default_rng(0).standard_normal(point["X"].shape)
    got = float64_gradient(model)(point, [seed])
    expected = onnx_numerical_vjp(model, point, ["X", "W"], [seed])
    for n in ("X", "W"):
        np.testing.assert_allclose(got[n], expected[n], rtol=1e-6, atol=1e-8)
    assert _modes_ops.check_ops_case(*case, {"hvp"}) == [("hvp", "ok", "")]


def test_the_transposition_on_the_attention_case():
    """The same case with the tangent pass refused: the transposition's cotangents of ones
    reached the body's Softmax as a zero row (the mask's ones cancel ``V_grad``'s, a constant
    along the row), where the Softmax rule read ``y`` as 0, so the gradient's derivative with
    respect to its cotangent was 0 there (tests/derivative/test_zero_cotangent_rows.py)."""
    from benchmarks.coverage_modes import transposition_only
    from benchmarks.coverage_ops import collect_cases

    name = "test_attention_local_window_ext_cache_float16_mask"
    case = next(c for c in collect_cases({"Attention"}) if c[0] == name)
    with transposition_only():
        verdicts = _modes_ops.check_ops_case(*case, {"jvp", "hvp"})
    assert dict((m, s) for m, s, _ in verdicts) == {"jvp": "ok", "hvp": "ok"}


def test_the_transposition_on_an_empty_slice():
    """onnx's test_slice_start_out_of_bounds (opset 13, an empty output) with the tangent pass
    refused: the transposition reshaped back to the shape of the empty output's cotangent,
    computed at run time, whose 0 ``Reshape`` read as "copy this dimension" below opset 14
    (tests/derivative/test_empty_reshapes.py)."""
    from benchmarks.coverage_modes import transposition_only
    from benchmarks.coverage_ops import collect_cases

    name = "test_slice_start_out_of_bounds"
    case = next(c for c in collect_cases({"Slice"}) if c[0] == name)
    with transposition_only():
        verdicts = _modes_ops.check_ops_case(*case, {"jvp", "hvp"})
    assert dict((m, s) for m, s, _ in verdicts) == {"jvp": "ok", "hvp": "ok (zero)"}
