"""Rule table entries: elementwise functions of one tensor, Cast, CastLike, Dropout."""

import numpy as np
from onnx import TensorProto, helper

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(2)


def r(*shape):
    return rng.standard_normal(shape)


def uniform(low, high, *shape):
    return rng.uniform(low, high, shape)


def away_from_zero(*shape, margin=0.2):
    """Values with ``|x| >= margin``: no kink of Abs or Sign at 0."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(margin, 2.0, shape)


#: onnx's reference Erf (also inside its Gelu function) computes in float32: wider steps.
FLOAT32_REFERENCE = {"eps": 1e-3, "rtol": 2e-3, "atol": 2e-4}


def cast_like_float32(inputs, outputs):
    """``CastLike(x, <float32 constant>)``: a real type change in the float64 run."""
    like = helper.make_tensor("like", TensorProto.FLOAT, [], [0.0])
    return [
        helper.make_node("Constant", [], ["like"], value=like),
        helper.make_node("CastLike", [inputs[0], "like"], outputs),
    ]


def dropout_with_mask(**attrs):
    """A Dropout whose mask output exists but is not a graph output."""

    def graph(inputs, outputs):
        return [helper.make_node("Dropout", inputs, [outputs[0], "mask"], **attrs)]

    return graph


CASES = [
    OpCase("Exp", {"x": r(2, 3)}, opset=13, id="Exp-opset13"),
    OpCase("Exp", {"x": r(4)}, opset=21, id="Exp-opset21"),
    OpCase("Log", {"x": uniform(0.3, 3.0, 2, 3)}, opset=13, id="Log-opset13"),
    OpCase("Log", {"x": uniform(0.3, 3.0, 5)}, id="Log-opset18"),
    OpCase("Sqrt", {"x": uniform(0.3, 3.0, 2, 3)}, opset=13, id="Sqrt-opset13"),
    OpCase("Sqrt", {"x": uniform(0.3, 3.0, 3, 1, 2)}, opset=21, id="Sqrt-opset21"),
    *(
        OpCase(op, {"x": sample(*shape)}, opset=opset, id=f"{op}-opset{opset}")
        for op, sample in [
            ("Reciprocal", lambda *s: away_from_zero(*s, margin=0.5)),
            ("Sin", r), ("Cos", r), ("Tan", lambda *s: uniform(-1.2, 1.2, *s)),
            ("Sinh", r), ("Cosh", r), ("Asin", lambda *s: uniform(-0.8, 0.8, *s)),
            ("Acos", lambda *s: uniform(-0.8, 0.8, *s)), ("Atan", r), ("Asinh", r),
            ("Acosh", lambda *s: uniform(1.3, 3.0, *s)),
            ("Atanh", lambda *s: uniform(-0.8, 0.8, *s)),
        ]
        for opset, shape in [(13, (2, 3)), (21, (4,))]
    ),
    OpCase("Abs", {"x": away_from_zero(2, 3)}, opset=13, id="Abs-opset13"),
    OpCase("Abs", {"x": away_from_zero(6)}, opset=20, id="Abs-opset20"),
    OpCase("Tanh", {"x": r(2, 3)}, opset=13, id="Tanh-opset13"),
    OpCase("Tanh", {"x": r(3, 2, 2)}, opset=21, id="Tanh-opset21"),
    OpCase("Erf", {"x": r(2, 3)}, opset=13, **FLOAT32_REFERENCE, id="Erf-opset13"),
    OpCase("Erf", {"x": r(7)}, opset=20, **FLOAT32_REFERENCE, id="Erf-opset20"),
    # onnxruntime is fed float32 output gradients, which a double output rejects
    OpCase(
        "Cast", {"x": r(2, 3)}, {"to": TensorProto.DOUBLE}, opset=13, check_ort=False,
        id="Cast-to-double",
    ),
    OpCase(
        "Cast", {"x": r(2, 3)}, {"to": TensorProto.FLOAT}, opset=19,
        eps=1e-3, rtol=1e-3, atol=1e-4, id="Cast-to-float-opset19",
    ),
    OpCase(
        "CastLike", {"x": r(2, 3), "like": np.zeros(1)}, constants=("like",), opset=15,
        id="CastLike-opset15",
    ),
    OpCase(
        "CastLike", {"x": r(4)}, graph=cast_like_float32, opset=21, **FLOAT32_REFERENCE,
        id="CastLike-to-float32-opset21",
    ),
    OpCase("Dropout", {"x": r(3, 4)}, opset=13, id="Dropout-inference-opset13"),
    OpCase("Dropout", {"x": r(3, 4), "ratio": np.array(0.2)}, constants=("ratio",), opset=21,
           id="Dropout-ratio-only-opset21"),
    OpCase(
        "Dropout", {"x": r(3, 4), "ratio": np.array(0.3), "mode": np.array(False)},
        constants=("ratio",), graph=dropout_with_mask(), opset=18, id="Dropout-mode-false",
    ),
    # random masks: the reference evaluator's seeded mask differs from onnxruntime's
    OpCase(
        "Dropout", {"x": r(3, 4), "ratio": np.array(0.4), "mode": np.array(True)},
        constants=("ratio",), graph=dropout_with_mask(seed=3), opset=13, check_ort=False,
        id="Dropout-training-opset13",
    ),
    OpCase(
        "Dropout", {"x": r(2, 5), "ratio": np.array(0.5), "mode": np.array(True)},
        constants=("ratio",), graph=dropout_with_mask(seed=5), opset=21, check_ort=False,
        id="Dropout-training-opset21",
    ),
    OpCase(
        "Dropout", {"x": r(3, 4), "ratio": np.array(0.3), "mode": np.array(True)},
        graph=dropout_with_mask(seed=2), opset=18, check_ort=False,
        id="Dropout-training-ratio-differentiated",
    ),
    OpCase(
        "Dropout", {"x": r(3, 4), "ratio": np.array(0.3), "mode": np.array(False)},
        graph=dropout_with_mask(), opset=18, id="Dropout-inference-ratio-differentiated",
    ),
]  # fmt: skip


SECOND_ORDER_IDS = {
    "Exp-opset13", "Log-opset18", "Sqrt-opset13", "Reciprocal-opset13", "Abs-opset13",
    "Sin-opset13", "Cos-opset13", "Tan-opset13", "Tanh-opset21", "Sinh-opset13", "Cosh-opset13",
    "Asin-opset13", "Acos-opset13", "Atan-opset13", "Asinh-opset13", "Acosh-opset13",
    "Atanh-opset13",
    "Erf-opset13", "Cast-to-double", "CastLike-opset15", "Dropout-mode-false",
    "Dropout-training-opset13",
}  # fmt: skip
SECOND_ORDER = [second_order(case) for case in CASES if case.id in SECOND_ORDER_IDS]
assert len(SECOND_ORDER) == len(SECOND_ORDER_IDS), "a second-order id names no case"
CASES += SECOND_ORDER
