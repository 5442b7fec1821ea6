"""Forward mode on the whole rule table: for every case, ``onnx_jvp`` against the central
difference of the outputs along a random tangent, ``(f(x + eps t) - f(x - eps t)) / 2 eps``,
evaluated in float64 by the case's own oracle."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad import onnx_jvp
from onnxgrad.derivative.tangent_graph import tangent_jvp
from onnxgrad.normalize import normalized_model
from tests.derivative.autodiff.gradcheck import case_model, evaluator
from tests.derivative.autodiff.test_rules import CASES


def directional_difference(case, model, feeds, tangents) -> list[np.ndarray]:
    """``(f(x + eps t) - f(x - eps t)) / (2 eps)`` for every output of ``model``."""
    session = evaluator(model, case.evaluator)

    def shifted(sign):
        moved = {n: np.asarray(feeds[n] + sign * case.eps * t) for n, t in tangents.items()}
        return [np.asarray(o, dtype=np.float64) for o in session.run(None, {**feeds, **moved})]

    return [(p - m) / (2 * case.eps) for p, m in zip(shifted(1.0), shifted(-1.0))]


def _run_jvp(case, jvp, feeds) -> dict:
    """The JVP graph run by the case's oracle, or by onnxruntime where onnx's reference
    evaluator cannot run it (its GatherElements, through ``np.choose``, takes at most 64
    values along the axis: MaxPool's tangent gathers from whole images)."""
    names = [o.name for o in jvp.graph.output]
    try:
        return dict(zip(names, evaluator(jvp, case.evaluator).run(None, feeds)))
    except ValueError as exc:
        if case.evaluator != "reference" or "at most 64 array objects" not in str(exc):
            raise
    return dict(zip(names, evaluator(jvp, "onnxruntime").run(None, feeds)))


def _params(cases) -> list:
    """One parameter per case: the first of each operator and opset runs always, the other
    variants (attributes, second order, edge values) are marked slow."""
    seen, params = set(), []
    for case in cases:
        marks = [] if (key := (case.domain, case.op_type, case.opset)) not in seen else [SLOW]
        seen.add(key)
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


SLOW = pytest.mark.slow


@pytest.mark.parametrize("case", _params(CASES))
def test_jvp_against_finite_differences(case):
    model, feeds = case_model(case, np.float64)
    wrt = case.differentiated
    rng = np.random.default_rng(0)
    tangents = {n: np.asarray(rng.standard_normal(feeds[n].shape)) for n in wrt}
    jvp = onnx_jvp(model, inputs=wrt)
    assert {n.domain for n in jvp.graph.node} <= {""}, "non-standard op emitted"
    got = _run_jvp(case, jvp, {**feeds, **{f"{n}_tangent": t for n, t in tangents.items()}})
    expected = directional_difference(case, model, feeds, tangents)
    for output, value in zip(model.graph.output, expected):
        name = f"{output.name}_tangent"
        if name not in got:  # an integer output (indices) has no tangent
            assert not np.issubdtype(value.dtype, np.floating) or output.type.tensor_type.elem_type
            continue
        np.testing.assert_allclose(
            got[name], value, rtol=case.rtol, atol=case.atol, err_msg=f"{case.id}: {name}"
        )


EXTREMA = [c for c in CASES if c.op_type in ("ReduceMax", "ReduceMin")]


@pytest.mark.parametrize("case", EXTREMA, ids=[c.id for c in EXTREMA])
def test_extrema_take_the_tangent_pass(case):
    """ReduceMax/ReduceMin have tangent rules (ties share as in the reverse rule; their
    values are checked above): the pass does not fall back to the transposition."""
    model, _ = case_model(case, np.float64)
    jvp, _, results = tangent_jvp(normalized_model(model), [], case.differentiated)
    assert results and set(results) <= {o.name for o in jvp.graph.output}
