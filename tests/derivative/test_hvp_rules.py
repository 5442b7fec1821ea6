"""``onnx_hvp`` (forward-over-reverse) on the rule table: for a sample of the cases, the
Hessian-vector product of ``loss = sum_k |y_k|^2`` (the float outputs) equals the central
difference of the reverse gradient along the tangent, ``(g(x + eps v) - g(x - eps v)) / 2
eps``, in float64 by the case's own oracle (the reverse gradient is checked against finite
differences of the outputs by ``autodiff/test_rules.py``).

The sample keeps CI short: the first case of each operator (one per domain and type, about
a fifth of the table's first-order cases, chosen by table order, so deterministic), and the
cases that exercise a code path of their own (a DFT axis fed at run time, irfft, carried
values of no inferred rank). ``autodiff/test_closure.py`` checks the second derivative of
every case by reverse-over-reverse."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxgrad import DerivativeOptions, onnx_derivative, onnx_hvp
from tests.derivative.autodiff.gradcheck import case_model, evaluator
from tests.derivative.autodiff.test_closure import (
    FIRST_ORDER,
    NOT_CHECKED,
    ON_ONNXRUNTIME,
    UNIT_STEP,
)

#: cases of a code path of their own, checked besides each operator's first case
OWN_PATHS = {
    "DFT-rfft-run-time-axis",
    "DFT-irfft",
    "Loop-unknown-rank-state-unfixed",
    "Scan-unknown-rank-state",
}


#: sampled cases whose HVP is not checked here, with the reason
HVP_NOT_CHECKED = {
    "DFT-complex-cut-run-time-axis": (
        "a dft_length cutting the input along an axis fed at run time: shape inference loses "
        "the rank past the DFT, and the transposed JVP's third derivation of the DFT needs it "
        "(the reverse-over-reverse second derivative is checked by test_closure)"
    ),
}


def _sample(cases) -> list:
    seen, chosen = set(), []
    for case in cases:
        key = (case.domain, case.op_type)
        skipped = case.id in NOT_CHECKED or case.id in HVP_NOT_CHECKED
        if (key not in seen or case.id in OWN_PATHS) and not skipped:
            chosen.append(case)
        seen.add(key)
    return chosen


SAMPLE = _sample(FIRST_ORDER)


def _squared_norm_loss(model):
    """``loss = sum_k |y_k|^2`` over the float outputs of ``model``, in float64."""
    floats = [
        o.name
        for o in model.graph.output
        if o.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.DOUBLE)
    ]
    nodes = []
    for name in floats:
        nodes.append(helper.make_node("ReduceSumSquare", [name], [f"{name}_sq"], keepdims=0))
        nodes.append(helper.make_node("Cast", [f"{name}_sq"], [f"{name}_sq64"], to=11))
    nodes.append(helper.make_node("Sum", [f"{n}_sq64" for n in floats], ["loss"]))
    graph = helper.make_graph(
        [*model.graph.node, *nodes],
        "loss",
        list(model.graph.input),
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        list(model.graph.initializer),
    )
    return helper.make_model(graph, opset_imports=list(model.opset_import))


@pytest.mark.parametrize("case", SAMPLE, ids=[c.id for c in SAMPLE])
def test_hvp_against_finite_differences_of_the_gradient(case):
    kind = "onnxruntime" if case.id in ON_ONNXRUNTIME else case.evaluator
    eps = 1.0 if case.op_type in UNIT_STEP else case.eps  # see test_closure's UNIT_STEP
    model, feeds = case_model(case, np.float64)
    model = _squared_norm_loss(model)
    wrt = case.differentiated
    hvp_model = onnx_hvp(model, inputs=wrt)
    assert {n.domain for n in hvp_model.graph.node} <= {""}, "non-standard op emitted"
    rng = np.random.default_rng(3)
    direction = {n: np.asarray(rng.standard_normal(np.shape(feeds[n]))) for n in wrt}
    tangents = {f"{n}_tangent": v for n, v in direction.items()}
    names = [o.name for o in hvp_model.graph.output]
    hvp = dict(zip(names, evaluator(hvp_model, kind).run(None, {**feeds, **tangents})))

    gradient = onnx_derivative(model, weights=[], inputs=wrt, options=DerivativeOptions.Loss)
    session = evaluator(gradient, kind)
    grad_names = [o.name for o in gradient.graph.output]

    def grads(sign):
        moved = {n: np.asarray(feeds[n] + sign * eps * v) for n, v in direction.items()}
        return dict(zip(grad_names, session.run(None, {**feeds, **moved})))

    plus, minus = grads(1.0), grads(-1.0)
    for n in wrt:
        expected = (plus[f"{n}_grad"] - minus[f"{n}_grad"]) / (2 * eps)
        scale = max(1.0, float(np.max(np.abs(expected))))
        np.testing.assert_allclose(
            hvp[f"{n}_grad_tangent"], expected, rtol=1e-4, atol=1e-5 * scale,
            err_msg=f"{case.id}: {n}",
        )  # fmt: skip
