"""benchmarks/coverage_ops.py on a few operators of onnx's test cases (the full run is a
benchmark, not a test): its verdicts and its Markdown table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def coverage():
    spec = importlib.util.spec_from_file_location(
        "coverage_ops", ROOT / "benchmarks" / "coverage_ops.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_onnx_cases_of_a_few_operators(coverage):
    outcomes = coverage.run({"Relu", "Erf", "Softmax", "ArgMax", "Swish"})
    by_op = {}
    for o in outcomes:
        by_op.setdefault(o.op_type, set()).add(o.status)
    assert by_op["Relu"] == {"ok"}
    assert by_op["Erf"] == {"ok"}, "the float64 Erf replaces the reference's float32 one"
    assert by_op["Softmax"] == {"ok"}, "pre-13 Softmax runs on onnxruntime"
    assert by_op["ArgMax"] == {"no float derivative"}
    text = coverage.markdown(outcomes)
    assert "| Relu | " in text and "**Total**" in text


def _single(op_type, **attrs):
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x"], ["y"], **attrs)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_verdicts(coverage):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    assert coverage.check_case("tanh", _single("Tanh"), [x]).status == "ok"
    ties = coverage.check_case("relu", _single("Relu"), [np.zeros((3, 4), np.float32)])
    assert ties.status == "ok", "a kink at the test point is jittered away"
    assert "no derivative at the test point" in ties.point
    assert "12 at a kink" in ties.point, "every coordinate of Relu(0) is a kink"


def _lp_normalization(p, axis):
    graph = helper.make_graph(
        [helper.make_node("LpNormalization", ["x"], ["y"], p=p, axis=axis)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_points_without_a_derivative_are_told_apart(coverage):
    """A zero inside an L1 norm is a kink, an all-zero row of x / ||x||_2 a jump: both are
    reported with their evidence and judged at a jittered point."""
    x = np.array([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    kink = coverage.check_case("l1", _lp_normalization(1, 1), [x + np.array([[0.0], [1.0]])])
    jump = coverage.check_case("l2", _lp_normalization(2, 1), [x])
    assert kink.status == "ok" and "one-sided derivatives" in kink.point
    assert "1 at a kink" in kink.point, kink.point
    assert jump.status == "ok" and "do not converge" in jump.point
    assert "3 at a jump" in jump.point, jump.point
    smooth = coverage.check_case("l2", _lp_normalization(2, 1), [x + 1.0])
    assert smooth.status == "ok" and smooth.point == ""


def test_the_gradient_at_a_kink_is_compared_with_the_one_sided_derivatives(coverage):
    """At the kink of f(x) = |x0| + x1^2 the gradient's first entry is confirmed in [-1, 1]
    only, its second must be 2 x1."""
    feeds = {"x": np.array([0.0, 0.5])}

    def objective(values):
        x = values["x"]
        return float(abs(x[0]) + x[1] ** 2)

    precision = coverage.Precision(1e-6, 1e-4)
    rng = np.random.default_rng(0)
    for first, second, confirmed in [
        (0.0, 1.0, True), (1.0, 1.0, True), (-0.3, 1.0, True), (2.0, 1.0, False),
        (0.0, 3.0, False),
    ]:  # fmt: skip
        got = {"x_grad": np.array([first, second])}
        point, ok = coverage._at_the_kink(objective, got, feeds, ["x"], rng, precision, "kink")
        assert ok is confirmed, point
        assert ("not confirmed" in point) is not confirmed


def test_ok_gradients_are_run_on_onnxruntime(coverage):
    """Cases at opsets the installed onnxruntime does not load are told apart."""
    outcomes = coverage.run({"Relu", "Softsign"}, onnxruntime=True)
    verdicts = [o.runtime.split(":")[0] for o in outcomes if o.status == "ok"]
    assert "agrees" in verdicts
    assert set(verdicts) <= {"agrees", "model not run"}, verdicts
    assert "### On onnxruntime" in coverage.markdown(outcomes)
