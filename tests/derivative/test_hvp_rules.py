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

import pytest

from tests.derivative.autodiff.gradcheck import check_hvp
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
    "DFT-complex-cut-run-time-axis",
    "Loop-unknown-rank-state-unfixed",
    "Scan-unknown-rank-state",
    "NegativeLogLikelihoodLoss-sum-weights-wrt-unknown-rank",  # names a value 'loss'
}


def _sample(cases) -> list:
    seen, chosen = set(), []
    for case in cases:
        key = (case.domain, case.op_type)
        if (key not in seen or case.id in OWN_PATHS) and case.id not in NOT_CHECKED:
            chosen.append(case)
        seen.add(key)
    return chosen


SAMPLE = _sample(FIRST_ORDER)


@pytest.mark.parametrize("case", SAMPLE, ids=[c.id for c in SAMPLE])
def test_hvp_against_finite_differences_of_the_gradient(case):
    kind = "onnxruntime" if case.id in ON_ONNXRUNTIME else case.evaluator
    eps = 1.0 if case.op_type in UNIT_STEP else case.eps  # see test_closure's UNIT_STEP
    check_hvp(case, kind, eps)
