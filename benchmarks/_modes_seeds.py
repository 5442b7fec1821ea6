"""The ``seeds`` sweep of :mod:`benchmarks.coverage_modes`: on the first case of each operator
of the rule table (the in-suite HVP sample, tests/derivative/test_hvp_rules.py), ``onnx_jvp``
and ``onnx_hvp`` with ``seeds=K`` in one run equal ``K`` single runs, tangent by tangent (the
single runs are themselves checked against finite differences by the ``rules`` sweep)."""

from __future__ import annotations

import functools

import numpy as np

from onnxgrad import onnx_hvp, onnx_jvp
from tests.derivative.autodiff.gradcheck import case_model, evaluator, squared_norm_loss

K = 3


def _run(model, kind: str, feeds: dict) -> dict:
    names = [o.name for o in model.graph.output]
    return dict(zip(names, evaluator(model, kind).run(None, feeds)))


def check_batched(case, kind: str, mode: str) -> None:
    """``mode`` (``jvp`` or ``hvp``) with ``seeds=K`` equals ``K`` single runs."""
    model, feeds = case_model(case, np.float64)
    build = onnx_jvp if mode == "jvp" else onnx_hvp
    if mode == "hvp":
        model = squared_norm_loss(model)
    wrt = case.differentiated
    rng = np.random.default_rng(5)
    tangents = {f"{n}_tangent": rng.standard_normal((K, *np.shape(feeds[n]))) for n in wrt}
    batched = _run(build(model, inputs=wrt, seeds=K), kind, {**feeds, **tangents})
    single = build(model, inputs=wrt)
    for k in range(K):
        one = _run(single, kind, {**feeds, **{n: np.asarray(t[k]) for n, t in tangents.items()}})
        for name, value in one.items():
            if name.endswith("_tangent"):
                np.testing.assert_allclose(
                    batched[name][k], value, rtol=1e-9, atol=1e-12, err_msg=f"{name}[{k}]"
                )


def seed_outcomes(judge) -> list:
    from benchmarks.coverage_modes import _report
    from tests.derivative.autodiff.test_closure import ON_ONNXRUNTIME
    from tests.derivative.test_hvp_rules import SAMPLE

    outcomes = []
    for case in SAMPLE:
        kind = "onnxruntime" if case.id in ON_ONNXRUNTIME else case.evaluator
        for mode in ("jvp", "hvp"):
            check = functools.partial(check_batched, case, kind, mode)
            outcomes.append(_report(judge(case.id, f"{mode} seeds={K}", check)))
    return outcomes
