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
