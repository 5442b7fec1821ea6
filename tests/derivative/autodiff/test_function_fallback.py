"""The function fallback: operators with no rule but an ONNX function body (schema,
context-dependent, model-local) are differentiated through it; checked against float64
finite differences on onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from onnxgrad.derivative.autodiff import engine
from onnxgrad.derivative.autodiff.functions import function_rule
from onnxgrad.derivative.autodiff.registry import find_rule
from tests.derivative.autodiff.gradcheck import OpCase, check_case, finite_differences

rng = np.random.default_rng(3)


def r(*shape):
    return rng.standard_normal(shape)


CASES = [
    OpCase("Swish", {"X": r(2, 3)}, {"alpha": 0.7}, opset=24, check_ort=False),
    OpCase(
        "RMSNormalization", {"X": r(2, 3, 4), "scale": r(4)}, {"axis": -1}, opset=23,
        check_ort=False,
    ),
    OpCase(
        "CenterCropPad", {"input_data": r(4, 3), "shape": np.array([2, 5])}, opset=18,
        check_ort=False,
    ),
    OpCase(
        "Attention", {"Q": r(1, 2, 3, 4), "K": r(1, 2, 5, 4), "V": r(1, 2, 5, 4)}, opset=23,
        check_ort=False, rtol=1e-4,
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_schema_function_against_finite_differences(case, monkeypatch):
    """The engine asks the fallback even where a hand-written rule exists (hidden here)."""

    def without_the_rule(domain, op_type, opset):
        return None if op_type == case.op_type else find_rule(domain, op_type, opset)

    monkeypatch.setattr(engine, "find_rule", without_the_rule)
    asked = []
    monkeypatch.setattr(engine, "function_rule", _recording(asked))
    check_case(case)
    assert case.op_type in asked


def _recording(asked: list):
    def recorded(node, *args):
        asked.append(node.op_type)
        return function_rule(node, *args)

    return recorded


def _local_function_model() -> tuple:
    """``y = Scaled(x, w)`` with the model-local ``Scaled(a, b) = Softplus(a) * b * alpha``,
    called with ``alpha=1.5`` (the attribute reaches the body by reference)."""
    alpha = helper.make_attribute_ref("alpha", TensorProto.FLOAT)
    constant = helper.make_node("Constant", [], ["k"], value_float=0.0)
    constant.attribute[0].CopyFrom(alpha)
    constant.attribute[0].name = "value_float"
    function = helper.make_function(
        "my.domain",
        "Scaled",
        ["a", "b"],
        ["c"],
        [
            helper.make_node("Softplus", ["a"], ["s"]),
            helper.make_node("Mul", ["s", "b"], ["t"]),
            constant,
            helper.make_node("CastLike", ["k", "t"], ["k_like"]),
            helper.make_node("Mul", ["t", "k_like"], ["c"]),
        ],
        opset_imports=[helper.make_opsetid("", 18)],
        attributes=["alpha"],
    )
    node = helper.make_node("Scaled", ["x", "w"], ["y"], domain="my.domain", alpha=1.5)
    graph = helper.make_graph(
        [node],
        "local",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3]),
            helper.make_tensor_value_info("w", TensorProto.DOUBLE, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("my.domain", 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[function], ir_version=9)
    return model, {"x": r(2, 3), "w": r(3)}


def test_model_local_function_against_finite_differences():
    model, feeds = _local_function_model()
    seed = r(2, 3)
    gradient = onnx_derivative(model, weights=[], inputs=["x", "w"])
    assert {n.domain for n in gradient.graph.node} <= {"", "my.domain"}
    got = ReferenceEvaluator(gradient).run(None, {**feeds, "y_grad": seed})
    for name, value in zip(["x", "w"], got):
        expected = finite_differences(model, feeds, name, [seed], 1e-6)
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-8)


def test_an_operator_without_rule_or_body_is_reported():
    node = helper.make_node("Scaled", ["x"], ["y"], domain="unknown.domain")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("unknown.domain", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    with pytest.raises(NotImplementedError, match=r"'Scaled' .*unknown\.domain"):
        onnx_derivative(model, weights=[])


LINEAR_ATTENTION = {
    "linear": {"query": (2, 3, 8), "key": (2, 3, 8), "value": (2, 3, 4)},
    "gated_delta": {
        "query": (1, 3, 8), "key": (1, 3, 8), "value": (1, 3, 8), "past_state": (1, 2, 4, 4),
        "decay": (1, 3, 2), "beta": (1, 3, 2),
    },
}  # fmt: skip


@pytest.mark.parametrize("rule", sorted(LINEAR_ATTENTION))
def test_scan_in_a_function_body_reading_outer_constants(rule):
    """LinearAttention's body is a Scan whose steps Unsqueeze by the body's Constant axes
    and MatMul: the step's ranks come from typing those outer constants as initializers.
    The operator is float32-only: float32 finite differences with a larger step."""
    shapes = LINEAR_ATTENTION[rule]
    feeds = {n: r(*s).astype(np.float32) for n, s in shapes.items()}
    if "decay" in feeds:
        feeds["decay"] = -np.abs(feeds["decay"])
        feeds["beta"] = 1 / (1 + np.exp(-feeds["beta"]))
    node = helper.make_node(
        "LinearAttention", list(feeds), ["out", "state"], q_num_heads=2, kv_num_heads=2,
        update_rule=rule,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape) for n, v in feeds.items()],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in ("out", "state")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)], ir_version=11)
    model = onnx.shape_inference.infer_shapes(model)
    gradient = onnx_derivative(model, weights=[], inputs=list(feeds))
    assert not any(n.op_type == "LinearAttention" for n in gradient.graph.node[1:])
    outputs = ReferenceEvaluator(model).run(None, feeds)
    seeds = [r(*o.shape).astype(np.float32) for o in outputs]
    grad_feeds = {**feeds, "out_grad": seeds[0], "state_grad": seeds[1]}
    got = ReferenceEvaluator(gradient).run(None, grad_feeds)
    for name, value in zip(feeds, got):
        expected = finite_differences(model, feeds, name, seeds, 1e-2)
        np.testing.assert_allclose(value, expected, rtol=2e-3, atol=2e-3, err_msg=name)
