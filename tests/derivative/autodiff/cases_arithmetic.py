"""Rule table entries: Add, Sub, Mul, Div, Neg, Identity, OptionalGetElement of a tensor."""

import numpy as np
from onnx import helper

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(1)


def r(*shape):
    return rng.standard_normal(shape)


def positive(*shape):
    return rng.uniform(0.5, 2.0, shape)


CASES = [
    OpCase("Add", {"a": r(2, 3), "b": r(2, 3)}, id="Add-same"),
    OpCase("Add", {"a": r(2, 3), "b": r(3)}, id="Add-broadcast-row"),
    OpCase("Add", {"a": r(2, 1, 3), "b": r(4, 1)}, id="Add-broadcast-both"),
    OpCase("Sub", {"a": r(2, 3), "b": r(2, 1)}, id="Sub-broadcast"),
    OpCase("Sub", {"a": r(), "b": r(2, 3)}, id="Sub-scalar"),
    OpCase("Mul", {"a": r(2, 3), "b": r(2, 3)}, id="Mul-same"),
    OpCase("Mul", {"a": r(3, 1), "b": r(1, 4)}, id="Mul-outer"),
    OpCase(
        "Mul",
        {"a": r(2, 3)},
        graph=lambda inputs, outputs: [helper.make_node("Mul", [inputs[0], inputs[0]], outputs)],
        id="Mul-square",
    ),
    OpCase("Div", {"a": r(2, 3), "b": positive(3)}, id="Div-broadcast"),
    OpCase("Div", {"a": r(1), "b": positive(2, 2)}, id="Div-scalar-numerator"),
    OpCase("Neg", {"a": r(2, 3)}),
    OpCase("Identity", {"a": r(2, 3)}),
    OpCase("OptionalGetElement", {"a": r(2, 3)}, opset=18),
    OpCase("Mul", {"a": r(2, 3), "b": r(3)}, opset=13, id="Mul-opset13"),
]
