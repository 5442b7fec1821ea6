"""Rule table entries: DequantizeLinear, the gradient of its scale (per tensor, per axis, per
block, with and without a zero point; ``x`` is an integer input).

The scale cannot be float64: the float64 scale is cast to float32 around the node. ``y`` is
linear in the scale, so a large finite-difference step loses nothing but float32 rounding.
The cast makes the float32 rerun meaningless; the oracle alternates between onnxruntime and
the reference evaluator (which has DequantizeLinear from opset 19 only).
"""

import numpy as np
from onnx import TensorProto, helper

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(8)


def codes(*shape, dtype=np.int8):
    return rng.integers(-100, 100, shape).astype(dtype)


def scales(*shape):
    return rng.uniform(0.05, 0.5, shape)


def dequantize(id, inputs, opset, evaluator="onnxruntime", **attrs):
    def graph(names, outputs):
        x, scale, *zero_point = names
        return [
            helper.make_node("Cast", [scale], ["scale32"], to=TensorProto.FLOAT),
            helper.make_node("DequantizeLinear", [x, "scale32", *zero_point], ["y32"], **attrs),
            helper.make_node("Cast", ["y32"], outputs, to=TensorProto.DOUBLE),
        ]

    return OpCase(
        "DequantizeLinear", inputs, attrs, opset=opset, graph=graph, eps=1e-2, rtol=1e-4,
        atol=1e-5, evaluator=evaluator, check_ort=False, id=f"DequantizeLinear-{id}",
    )  # fmt: skip


# fmt: off
CASES = [
    dequantize("per-tensor-opset11", {"x": codes(3, 4), "scale": scales()}, 11),
    dequantize("per-tensor-zero-point", {"x": codes(2, 3, 2, dtype=np.uint8),
                                         "scale": scales(),
                                         "zero_point": np.array(7, np.uint8)}, 13),
    dequantize("per-axis", {"x": codes(2, 3, 4), "scale": scales(3),
                            "zero_point": codes(3)}, 13),
    dequantize("per-axis-last", {"x": codes(4, 2, 3), "scale": scales(3)}, 19,
               evaluator="reference", axis=-1),
    dequantize("blocked", {"x": codes(2, 5), "scale": scales(2, 3),
                           "zero_point": codes(2, 3)}, 21, axis=1, block_size=2),
    dequantize("blocked-reference", {"x": codes(3, 4), "scale": scales(2, 4)}, 21,
               evaluator="reference", axis=0, block_size=2),
]
# fmt: on
