"""Rule table entries: Softmax and LogSoftmax along first, middle, last and negative axes;
before opset 13 over every axis from ``axis`` on (the input seen as a matrix)."""

import numpy as np
from onnx import helper

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(2)


def r(*shape):
    return rng.standard_normal(shape)


def masked_rows(inputs, outputs):
    """Attention's guard: ``Where(row all masked, 0, Softmax(x + mask))``."""
    x, mask = inputs
    return [
        helper.make_node("Add", [x, mask], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"]),
        helper.make_node("ReduceMax", [mask], ["row_max"], axes=[-1], keepdims=1),
        helper.make_node("IsInf", ["row_max"], ["masked"]),
        helper.make_node("Constant", [], ["zero32"], value_float=0.0),
        helper.make_node("CastLike", ["zero32", x], ["zero"]),
        helper.make_node("Where", ["masked", "zero", "p"], outputs),
    ]


MASK = np.where(np.array([[1, 1, 0], [0, 0, 0], [1, 0, 1], [0, 0, 0]], bool), 0.0, -np.inf)


CASES = [
    OpCase("Softmax", {"x": r(2, 5)}, opset=13, id="Softmax-default-axis-opset13"),
    OpCase("Softmax", {"x": r(3, 4, 2)}, {"axis": 1}, id="Softmax-axis1"),
    OpCase("Softmax", {"x": r(3, 2, 4)}, {"axis": 0}, opset=21, id="Softmax-axis0"),
    OpCase("Softmax", {"x": r(2, 3, 4)}, {"axis": -2}, id="Softmax-axis-negative"),
    OpCase("LogSoftmax", {"x": r(2, 5)}, opset=13, id="LogSoftmax-default-axis-opset13"),
    OpCase("LogSoftmax", {"x": r(3, 4, 2)}, {"axis": 1}, id="LogSoftmax-axis1"),
    OpCase("LogSoftmax", {"x": r(4, 3)}, {"axis": 0}, opset=21, id="LogSoftmax-axis0"),
    OpCase("LogSoftmax", {"x": r(2, 3, 4)}, {"axis": -2}, id="LogSoftmax-axis-negative"),
    OpCase(
        "Softmax",
        {"x": r(2, 4, 3), "mask": MASK},
        constants=("mask",),
        graph=masked_rows,
        opset=17,
        id="Softmax-fully-masked-rows",
    ),
    *[
        OpCase(op, {"x": r(*shape)}, attrs, opset=opset, id=f"{op}-{name}", evaluator="onnxruntime")
        for op in ("Softmax", "LogSoftmax")
        for shape, attrs, opset, name in [
            ((2, 3, 4), {}, 11, "coerced-default-opset11"),
            ((2, 3, 4), {"axis": 2}, 12, "coerced-axis2-opset12"),
            ((3, 2, 2), {"axis": -2}, 12, "coerced-negative-opset12"),
        ]
    ],
]
# onnx's reference evaluator normalises the last axis only before opset 13 (the spec
# normalises every axis from ``axis`` on): those cases use onnxruntime as the oracle.
