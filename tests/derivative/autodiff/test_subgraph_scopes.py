"""Sibling subgraphs (the two branches of an If, the bodies of two Scans or Loops) may each
define a value of the same name; the engine must read in each the value of its own scope.

Gradients are compared with float64 central differences of the original model run by
onnx's reference evaluator (the models are linear in X: the differences are exact).
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from tests.derivative.autodiff.gradcheck import finite_differences

DOUBLE = TensorProto.DOUBLE


def _ints(name, values):
    tensor = numpy_helper.from_array(np.array(values, np.int64))
    return helper.make_node("Constant", [], [name], value=tensor)


def _check(model, feeds, out_grads, seed_names):
    """The gradient of X on the reference evaluator against differences of the model."""
    expected = finite_differences(model, feeds, "X", out_grads, eps=1.0)
    grad = onnx_derivative(model, weights=[], inputs=["X"], backend="onnx")
    names = {i.name for i in grad.graph.input}
    grad_feeds = {**feeds, **dict(zip(seed_names, out_grads))}
    outputs = ReferenceEvaluator(grad).run(
        None, {k: v for k, v in grad_feeds.items() if k in names}
    )
    got = dict(zip([o.name for o in grad.graph.output], outputs))["X_grad"]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def _if_model(then_nodes, else_nodes, shape):
    def branch(tag, nodes):
        out = helper.make_tensor_value_info(f"y_{tag}", DOUBLE, [None])
        return helper.make_graph(nodes(tag), tag, [], [out])

    graph = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["cond"],
                ["Y"],
                then_branch=branch("then", then_nodes),
                else_branch=branch("else", else_nodes),
            )
        ],
        "m",
        [
            helper.make_tensor_value_info("X", DOUBLE, shape),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("Y", DOUBLE, [None])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_with_constants_of_the_same_name(cond):
    """Both branches slice X with bounds from Constants named ``st`` and ``en``."""

    def slicing(start, end):
        return lambda tag: [
            _ints("st", [start]),
            _ints("en", [end]),
            helper.make_node("Slice", ["X", "st", "en"], [f"y_{tag}"]),
        ]

    model = _if_model(slicing(0, 2), slicing(2, 4), [4])
    feeds = {"X": np.arange(4.0), "cond": np.array(cond)}
    _check(model, feeds, [np.array([10.0, 20.0])], ["Y_grad"])


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_with_intermediates_of_the_same_name_and_other_shapes(cond):
    """An intermediate ``h`` of shape [2] in one branch and [3] in the other: the gradient
    of ``ReduceSum(h)`` is shaped like each branch's own ``h``."""

    def summing(end):
        return lambda tag: [
            _ints(f"st_{tag}", [0]),
            _ints(f"en_{tag}", [end]),
            helper.make_node("Slice", ["X", f"st_{tag}", f"en_{tag}"], ["h"]),
            helper.make_node("ReduceSum", ["h"], [f"y_{tag}"], keepdims=1),
        ]

    model = _if_model(summing(2), summing(3), [4])
    feeds = {"X": np.arange(4.0), "cond": np.array(cond)}
    _check(model, feeds, [np.array([10.0])], ["Y_grad"])


def _scan(output, start, end):
    """A Scan over the rows of X whose body slices a row with its own Constants."""
    body = helper.make_graph(
        [
            _ints("st", [start]),
            _ints("en", [end]),
            helper.make_node("Slice", ["row", "st", "en"], ["part"]),
        ],
        "body",
        [helper.make_tensor_value_info("row", DOUBLE, [4])],
        [helper.make_tensor_value_info("part", DOUBLE, [end - start])],
    )
    return helper.make_node("Scan", ["X"], [output], body=body, num_scan_inputs=1)


def test_scan_bodies_with_constants_of_the_same_name():
    graph = helper.make_graph(
        [_scan("Y1", 0, 2), _scan("Y2", 1, 4)],
        "m",
        [helper.make_tensor_value_info("X", DOUBLE, [3, 4])],
        [
            helper.make_tensor_value_info("Y1", DOUBLE, [3, 2]),
            helper.make_tensor_value_info("Y2", DOUBLE, [3, 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(0)
    out_grads = [rng.standard_normal((3, 2)), rng.standard_normal((3, 3))]
    _check(model, {"X": rng.standard_normal((3, 4))}, out_grads, ["Y1_grad", "Y2_grad"])


def _loop(output, end):
    """A Loop of two iterations whose body sums its own Slice of X into the carried state."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            _ints("st", [0]),
            _ints("en", [end]),
            helper.make_node("Slice", ["X", "st", "en"], ["part"]),
            helper.make_node("ReduceSum", ["part"], ["total"], keepdims=1),
            helper.make_node("Add", ["acc", "total"], ["acc_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc", DOUBLE, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", DOUBLE, [1]),
        ],
    )
    return helper.make_node("Loop", ["trips", "keep_going", "zero"], [output], body=body)


def test_loop_bodies_with_constants_of_the_same_name():
    graph = helper.make_graph(
        [_loop("Y1", 1), _loop("Y2", 3)],
        "m",
        [helper.make_tensor_value_info("X", DOUBLE, [4])],
        [
            helper.make_tensor_value_info("Y1", DOUBLE, [1]),
            helper.make_tensor_value_info("Y2", DOUBLE, [1]),
        ],
        [
            numpy_helper.from_array(np.array(2, np.int64), "trips"),
            numpy_helper.from_array(np.zeros(1), "zero"),
            numpy_helper.from_array(np.array(True), "keep_going"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    out_grads = [np.array([3.0]), np.array([5.0])]
    _check(model, {"X": np.arange(4.0)}, out_grads, ["Y1_grad", "Y2_grad"])
