"""Rule table entries: activation functions, inputs kept away from their kinks."""

import numpy as np
from onnx import TensorProto, helper

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(3)


def r(*shape):
    return rng.standard_normal(shape)


def away_from(points, *shape, margin=0.15, scale=2.5):
    """Values in ``[-scale, scale]`` at least ``margin`` away from every kink in ``points``."""
    values = rng.uniform(-scale, scale, shape)
    for point in points:
        close = np.abs(values - point) < margin
        values[close] = point + np.where(values[close] >= point, margin, -margin)
    return values


#: Float32 computations (onnx's reference Gelu expands to its float32 Erf): wider steps.
FLOAT32_REFERENCE = {"eps": 1e-3, "rtol": 2e-3, "atol": 2e-4}


def in_float32(op_type, **attrs):
    """``op(Cast(x, float))``, for ops defined for float32 only (Celu)."""

    def graph(inputs, outputs):
        return [
            helper.make_node("Cast", inputs, ["x32"], to=TensorProto.FLOAT),
            helper.make_node(op_type, ["x32"], outputs, **attrs),
        ]

    return graph


CASES = [
    OpCase("Sigmoid", {"x": r(2, 3)}, opset=13, id="Sigmoid-opset13"),
    OpCase("Sigmoid", {"x": r(5)}, opset=21, id="Sigmoid-opset21"),
    OpCase("HardSigmoid", {"x": away_from([-2.5, 2.5], 3, 4)}, opset=13, id="HardSigmoid"),
    OpCase(
        "HardSigmoid", {"x": away_from([-1.0, 3.0], 3, 4, scale=4)}, {"alpha": 0.5, "beta": 0.5},
        opset=18, id="HardSigmoid-alpha-beta",
    ),
    OpCase("Relu", {"x": away_from([0], 3, 4)}, opset=13, id="Relu-opset13"),
    OpCase("Relu", {"x": away_from([0], 2, 2, 3)}, opset=19, id="Relu-opset19"),
    OpCase("LeakyRelu", {"x": away_from([0], 3, 4)}, opset=13, id="LeakyRelu-default"),
    OpCase("LeakyRelu", {"x": away_from([0], 3, 4)}, {"alpha": 0.3}, opset=18, id="LeakyRelu-a"),
    OpCase("PRelu", {"x": away_from([0], 2, 3, 4), "slope": r(3, 1)}, opset=13, id="PRelu-channel"),
    OpCase("PRelu", {"x": away_from([0], 2, 3), "slope": r(1)}, opset=16, id="PRelu-scalar-slope"),
    OpCase("PRelu", {"x": away_from([0], 2, 3), "slope": r(2, 3)}, opset=18, id="PRelu-full-slope"),
    OpCase(
        "PRelu", {"x": away_from([0], 2, 3), "slope": r(3)}, wrt=("slope",), opset=21,
        id="PRelu-slope-only",
    ),
    OpCase("ThresholdedRelu", {"x": away_from([1.0], 3, 4)}, opset=13, id="ThresholdedRelu"),
    OpCase(
        "ThresholdedRelu", {"x": away_from([0.5], 3, 4)}, {"alpha": 0.5}, opset=18,
        id="ThresholdedRelu-alpha",
    ),
    OpCase("Shrink", {"x": away_from([-0.5, 0.5], 3, 4)}, opset=13, id="Shrink-default"),
    OpCase(
        "Shrink", {"x": away_from([-0.5, 0.5], 3, 4)}, {"bias": 0.2}, opset=9,
        id="Shrink-opset9",
    ),
    OpCase(
        "Shrink", {"x": away_from([-1.0, 1.0], 3, 4)}, {"lambd": 1.0, "bias": 0.3}, opset=18,
        id="Shrink-lambd-bias",
    ),
    OpCase("Elu", {"x": away_from([0], 3, 4)}, opset=13, id="Elu-default"),
    OpCase("Elu", {"x": away_from([0], 3, 4)}, {"alpha": 0.4}, opset=18, id="Elu-alpha"),
    OpCase("Selu", {"x": away_from([0], 3, 4)}, opset=13, id="Selu-default"),
    OpCase(
        "Selu", {"x": away_from([0], 3, 4)}, {"alpha": 1.2, "gamma": 0.8}, opset=18,
        id="Selu-alpha-gamma",
    ),
    OpCase(
        "Celu", {"x": away_from([0], 3, 4)}, graph=in_float32("Celu"), opset=13,
        **FLOAT32_REFERENCE, id="Celu-default",
    ),
    OpCase(
        "Celu", {"x": away_from([0], 3, 4)}, graph=in_float32("Celu", alpha=2.0), opset=18,
        **FLOAT32_REFERENCE, id="Celu-alpha",
    ),
    OpCase("Softplus", {"x": r(3, 4)}, opset=13, id="Softplus-opset13"),
    OpCase("Softplus", {"x": r(6)}, opset=21, id="Softplus-opset21"),
    OpCase("Softsign", {"x": away_from([0], 3, 4)}, opset=13, id="Softsign-opset13"),
    OpCase("Softsign", {"x": away_from([0], 2, 3)}, opset=21, id="Softsign-opset21"),
    OpCase("Gelu", {"x": r(3, 4)}, opset=20, **FLOAT32_REFERENCE, id="Gelu-exact"),
    OpCase("Gelu", {"x": r(3, 4) * 2}, {"approximate": "tanh"}, opset=20, id="Gelu-tanh"),
    OpCase(
        "Gelu", {"x": r(2, 3)}, {"approximate": "none"}, opset=21, **FLOAT32_REFERENCE,
        id="Gelu-none-opset21",
    ),
    OpCase("HardSwish", {"x": away_from([-3, 3], 3, 4, scale=5)}, opset=14, id="HardSwish-opset14"),
    OpCase("HardSwish", {"x": away_from([-3, 3], 3, 4, scale=5)}, opset=21, id="HardSwish-opset21"),
    OpCase("Mish", {"x": r(3, 4)}, opset=18, id="Mish-opset18"),
    OpCase("Mish", {"x": r(5) * 3}, opset=21, id="Mish-opset21"),
]  # fmt: skip

# Celu's cases run in float32, which the float64 output gradient of a second-order case breaks
SECOND_ORDER_IDS = {
    "Sigmoid-opset13", "HardSigmoid-alpha-beta", "Relu-opset13", "LeakyRelu-a",
    "PRelu-channel", "PRelu-slope-only", "ThresholdedRelu", "Shrink-lambd-bias", "Elu-alpha",
    "Selu-alpha-gamma", "Softplus-opset13", "Softsign-opset13", "Gelu-exact", "Gelu-tanh",
    "HardSwish-opset14", "Mish-opset18",
}  # fmt: skip
SECOND_ORDER = [second_order(case) for case in CASES if case.id in SECOND_ORDER_IDS]
assert len(SECOND_ORDER) == len(SECOND_ORDER_IDS), "a second-order id names no case"
CASES += SECOND_ORDER
