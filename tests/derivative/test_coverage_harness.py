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


@pytest.mark.parametrize("rounding", ["straight_through", "exact"])
def test_the_dynamic_quantization_scale_has_its_derivative(coverage, rounding):
    """onnx's ``DynamicQuantizeLinear`` cases, whose one float output is ``y_scale``: its
    derivative agrees with float64 finite differences in both modes (it was 0 under the
    estimator)."""
    outcomes = coverage.run({"DynamicQuantizeLinear"}, rounding=rounding)
    assert len(outcomes) == 3
    assert {o.status for o in outcomes} == {"ok"}, [(o.case, o.detail) for o in outcomes]


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
    only (outside: not confirmed); its second must be 2 x1, a two-sided partial derivative
    (else the gradient is wrong)."""
    feeds = {"x": np.array([0.0, 0.5])}

    def objective(values):
        x = values["x"]
        return float(abs(x[0]) + x[1] ** 2)

    precision = coverage.Precision(1e-6, 1e-4)
    rng = np.random.default_rng(0)
    for first, second, verdict in [
        (0.0, 1.0, "ok"), (1.0, 1.0, "ok"), (-0.3, 1.0, "ok"), (2.0, 1.0, "not confirmed"),
        (0.0, 3.0, "wrong"),
    ]:  # fmt: skip
        got = {"x_grad": np.array([first, second])}
        point, got_verdict, why = coverage._at_the_kink(
            objective, got, feeds, ["x"], rng, precision, "kink"
        )
        assert got_verdict == verdict, point
        assert ("not confirmed" in point) is (verdict != "ok"), point
        assert ("where it is wrong" in point) is (verdict == "wrong"), point
        assert bool(why) is (verdict != "ok")


def test_a_generalized_gradient_outside_the_one_sided_derivatives_is_not_called_wrong(
    coverage,
):
    """f(x) = |x0| - |x1| at 0: (1, 1) is in the Clarke generalized gradient [-1, 1]^2, yet
    along (1, 1) f is flat: a direction can only leave it not confirmed; (1, 1) for
    |x0| + |x1| (convex) is confirmed."""
    feeds = {"x": np.array([0.0, 0.0])}
    precision = coverage.Precision(1e-6, 1e-4)
    got = {"x_grad": np.array([1.0, 1.0])}

    def difference(values):
        return float(abs(values["x"][0]) - abs(values["x"][1]))

    def total(values):
        return float(abs(values["x"][0]) + abs(values["x"][1]))

    rng = np.random.default_rng(0)
    point, verdict, _ = coverage._at_the_kink(difference, got, feeds, ["x"], rng, precision, "k")
    assert verdict == "not confirmed", point
    assert "outside the one-sided derivatives" in point
    point, verdict, _ = coverage._at_the_kink(total, got, feeds, ["x"], rng, precision, "k")
    assert verdict == "ok", point


def _patched_rule(monkeypatch, op_type, function):
    import dataclasses

    from onnxgrad.derivative.autodiff import registry

    registry.load_rules()
    key = ("", op_type)
    rules = [dataclasses.replace(r, function=function) for r in registry._RULES[key]]
    monkeypatch.setitem(registry._RULES, key, rules)


def test_a_wrong_gradient_at_a_point_without_a_derivative_is_not_ok(coverage, monkeypatch):
    """Deliberately wrong rules at a test point with a kink somewhere (review finding): a
    Relu gradient that adds 1 everywhere when some x is 0 is wrong where the partial
    derivatives exist (the jittered point, without a 0, is ok); a ReduceMax that gives the
    whole output gradient to each of two tied maxima is not a generalized gradient along
    the tie: at least not confirmed."""
    from onnxgrad.derivative.autodiff.rules import activations
    from onnxgrad.derivative.autodiff.rules import reduce as rules

    def bad_relu(b, node, grads, needs):
        x = node.inputs[0]
        good = activations.relu_grad(b, node, grads, needs)[0]
        zero = b.op("Equal", x, b.const(0, like=x))
        any_zero = b.op("ReduceMax", b.op("Cast", zero, to=TensorProto.INT32), keepdims=0)
        return [b.op("Add", good, b.op("CastLike", any_zero, x))]

    def bad_reduce_max(b, node, grads, needs):
        x, axes, g = rules._inputs(b, node, grads)
        y = rules._restore(b, node, axes, node.outputs[0])
        hits = rules.cast_like(b, b.op("Equal", x, y), x)
        return [b.op("Mul", hits, rules.expand_like(b, g, x))]

    _patched_rule(monkeypatch, "Relu", bad_relu)
    _patched_rule(monkeypatch, "ReduceMax", bad_reduce_max)
    relu = _single("Relu")
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    x[1, 2] = 0.0
    outcome = coverage.check_case("relu", relu, [x])
    assert outcome.status == "wrong", outcome
    assert "where it is wrong" in outcome.point
    assert coverage.check_case("relu", relu, [x + 10.0]).status == "ok"
    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["x"], ["y"], axes=[1], keepdims=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])],
    )
    reduce_max = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    ties = np.array([[0.9, 0.9, -0.4], [0.2, 1.3, -0.7]], np.float32)
    outcome = coverage.check_case("reduce_max", reduce_max, [ties])
    assert outcome.status in ("not confirmed", "wrong"), outcome
    assert "outside the one-sided derivatives" in outcome.point, outcome.point
    untied = np.array([[0.9, 0.5, -0.4], [0.2, 1.3, -0.7]], np.float32)
    assert coverage.check_case("reduce_max", reduce_max, [untied]).status == "ok"


def test_ok_gradients_are_run_on_onnxruntime(coverage):
    """Cases at opsets the installed onnxruntime does not load are told apart."""
    outcomes = coverage.run({"Relu", "Softsign"}, onnxruntime=True)
    verdicts = [o.runtime.split(":")[0] for o in outcomes if o.status == "ok"]
    assert "agrees" in verdicts
    assert set(verdicts) <= {"agrees", "model not run"}, verdicts
    assert "### On onnxruntime" in coverage.markdown(outcomes)


def test_an_input_computed_in_float16_is_judged_at_float16_steps(coverage):
    """CausalConvWithState refuses float64, so the float64 model casts its inputs back to
    float16 before the node: a step of 1e-6 vanished in that rounding (finite differences 0,
    the case called wrong); the step and tolerance are now float16's, and the detail says so."""
    outcomes = coverage.run({"CausalConvWithState"})
    by_case = {o.case: o for o in outcomes}
    silu = by_case["test_causal_conv_with_state_silu_fp16"]
    assert silu.status == "ok", silu.detail
    assert silu.detail.startswith("in float16 (the schema refuses float64)")
    assert {o.status for o in outcomes} == {"ok"}, [(o.case, o.detail) for o in outcomes]


def test_a_gradient_graph_gets_only_the_output_gradients_it_takes(coverage):
    """MaxPool's indices output is integer: its gradient graph takes no ``z_grad``, which the
    harness fed (an onnxruntime that loads opset 22 refused the name: the two argmax cases
    failed)."""
    cases = [case for case in coverage.collect_cases({"MaxPool"}) if "with_argmax" in case[0]]
    with np.errstate(all="ignore"):
        argmax = [coverage.check_case(*case) for case in cases]
    assert len(argmax) == 2
    assert {o.status for o in argmax} == {"ok"}, [(o.case, o.detail) for o in argmax]
