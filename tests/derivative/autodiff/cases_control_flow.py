"""Rule table entries: If (each branch taken; an outer weight read by one branch only)."""

import numpy as np
from onnx import TensorProto, helper

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(5)


def _branch(name, nodes, output):
    return helper.make_graph(
        nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.UNDEFINED, None)]
    )


def if_on_sign(inputs, outputs):
    """``y = sin(x * w) if sum(x) > 0 else x * x``."""
    x, w = inputs
    then_branch = _branch(
        "then",
        [helper.make_node("Mul", [x, w], ["t"]), helper.make_node("Sin", ["t"], ["a"])],
        "a",
    )
    else_branch = _branch("else", [helper.make_node("Mul", [x, x], ["b"])], "b")
    return [
        helper.make_node("Constant", [], ["zero_float"], value_float=0.0),
        helper.make_node("CastLike", ["zero_float", x], ["zero"]),
        helper.make_node("ReduceSum", [x], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node(
            "If", ["positive"], outputs, then_branch=then_branch, else_branch=else_branch
        ),
    ]


positive = rng.uniform(0.2, 1.0, (2, 3))
CASES = [
    OpCase("If", {"x": positive, "w": rng.standard_normal(3)}, graph=if_on_sign, id="If-then"),
    OpCase("If", {"x": -positive, "w": rng.standard_normal(3)}, graph=if_on_sign, id="If-else"),
]
CASES += [second_order(case) for case in CASES]
