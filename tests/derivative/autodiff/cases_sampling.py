"""Rule table entries: GridSample (every mode, padding mode and align_corners, 2-D and
volumetric), the gradient of ``X`` (the grid is not differentiable). Opsets 16-19 (mode
names bilinear/bicubic) have no float64 evaluator: neither the reference evaluator nor
onnxruntime runs them; the rule passes the node's attributes through unchanged."""

import numpy as np

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(9)


def grid_sample(id, x_shape, grid_shape, opset=22, **attrs):
    inputs = {"X": rng.standard_normal(x_shape), "grid": rng.uniform(-1.2, 1.2, grid_shape)}
    return OpCase("GridSample", inputs, attrs, opset=opset, wrt=("X",), id=f"GridSample-{id}")


# fmt: off
CASES = [
    grid_sample("bilinear-batch", (2, 2, 3, 4), (2, 3, 2, 2), opset=20, mode="linear"),
    grid_sample("nearest-reflection-aligned", (1, 1, 3, 4), (1, 4, 2, 2), opset=20,
                mode="nearest", padding_mode="reflection", align_corners=1),
    grid_sample("linear-zeros", (2, 1, 3, 2), (2, 2, 4, 2), mode="linear"),
    grid_sample("cubic-reflection", (1, 1, 4, 4), (1, 3, 3, 2), mode="cubic",
                padding_mode="reflection"),
    grid_sample("volumetric-linear", (1, 2, 3, 2, 2), (1, 2, 4, 2, 3), opset=20,
                mode="linear", align_corners=1),
    grid_sample("volumetric-nearest-border", (1, 1, 2, 3, 2), (1, 2, 2, 2, 3),
                mode="nearest", padding_mode="border"),
]
# fmt: on
