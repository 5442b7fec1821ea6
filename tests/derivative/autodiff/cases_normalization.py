"""Rule table entries: BatchNormalization (inference mode, all five inputs), InstanceNormalization,
LayerNormalization (axes, epsilon, with and without bias, the Mean and InvStdDev outputs),
LpNormalization, LRN.

The onnx reference evaluator runs BatchNormalization-9 (opsets 9-13) in training mode even with
one output, so the low-end BatchNormalization case is at opset 14.
"""

import numpy as np
from onnx import helper

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(5)


def r(*shape):
    return rng.standard_normal(shape)


def positive(*shape):
    return rng.uniform(0.5, 2.0, shape)


def batch_norm(id, shape, opset=18, **attrs):
    c = shape[1]
    inputs = {"X": r(*shape), "scale": r(c), "B": r(c), "mean": r(c), "var": positive(c)}
    return OpCase("BatchNormalization", inputs, attrs, opset=opset, id=f"BatchNormalization-{id}")


def batch_norm_training(id, shape, opset=18, y_only=False, **attrs):
    """``training_mode=1``: batch statistics, the running statistics as outputs (not graph
    outputs with ``y_only``)."""
    c = shape[1]
    inputs = {"X": r(*shape), "scale": r(c), "B": r(c), "mean": r(c), "var": positive(c)}
    attrs = {"training_mode": 1, **attrs}

    def graph(inputs, outputs):
        running = ["running_mean", "running_var"]
        return [helper.make_node("BatchNormalization", inputs, [*outputs, *running], **attrs)]

    return OpCase(
        "BatchNormalization", inputs, attrs, opset=opset, n_outputs=1 if y_only else 3,
        graph=graph if y_only else None, id=f"BatchNormalization-training-{id}",
    )  # fmt: skip


def layer_norm_with_statistics(id, shape, axis, opset=17):
    """All three outputs are graph outputs: gradients flow from Mean and InvStdDev too."""
    inputs = {"X": r(*shape), "scale": r(*shape[axis:]), "B": r(*shape[axis:])}
    return OpCase(
        "LayerNormalization", inputs, {"axis": axis}, opset=opset, n_outputs=3,
        id=f"LayerNormalization-{id}",
    )  # fmt: skip


def layer_norm_reusing_statistics(id, shape, axis, opset=18):
    """Mean and InvStdDev exist but only Y leaves the graph: the rule reuses them."""

    def graph(inputs, outputs):
        return [
            helper.make_node("LayerNormalization", inputs, [*outputs, "mean", "inv_std"], axis=axis)
        ]

    inputs = {"X": r(*shape), "scale": r(*shape[axis:])}
    return OpCase(
        "LayerNormalization", inputs, opset=opset, graph=graph, id=f"LayerNormalization-{id}"
    )


CASES = [
    batch_norm_training("4d", (3, 2, 2, 3), momentum=0.8),
    batch_norm_training("2d-y-only-opset14", (4, 3), opset=14, y_only=True),
    batch_norm_training("3d-opset15", (2, 3, 4), opset=15, epsilon=1e-3),
    batch_norm("2d-opset14", (2, 3, 2, 2), opset=14),
    batch_norm("matrix-epsilon", (4, 3), epsilon=0.1, opset=15),
    batch_norm("1d-training-mode-0", (2, 2, 3), training_mode=0),
    batch_norm("3d", (1, 2, 2, 2, 2), opset=21),
    OpCase("InstanceNormalization", {"X": r(2, 3, 4), "scale": r(3), "B": r(3)}, opset=11,
           id="InstanceNormalization-1d-opset11"),
    OpCase("InstanceNormalization", {"X": r(2, 2, 3, 2), "scale": r(2), "B": r(2)},
           {"epsilon": 0.01}, id="InstanceNormalization-2d-epsilon"),
    OpCase("LayerNormalization", {"X": r(3, 4), "scale": r(4), "B": r(4)}, opset=17,
           id="LayerNormalization-last-axis-opset17"),
    OpCase("LayerNormalization", {"X": r(2, 3, 4), "scale": r(3, 4)},
           {"axis": 1, "epsilon": 0.1}, id="LayerNormalization-axis1-no-bias"),
    OpCase("LayerNormalization", {"X": r(2, 3, 4), "scale": r(4), "B": r(1)},
           {"axis": -1}, opset=21, id="LayerNormalization-broadcast-scale-bias"),
    layer_norm_with_statistics("statistics-outputs", (2, 3, 2), axis=1),
    layer_norm_reusing_statistics("reused-statistics", (3, 2, 3), axis=-2),
    OpCase("LpNormalization", {"x": r(3, 4)}, opset=11, id="LpNormalization-default"),
    # the reference evaluator sums x, not |x|, for p=1
    OpCase("LpNormalization", {"x": r(2, 3, 2)}, {"axis": 1, "p": 1}, opset=11,
           evaluator="onnxruntime", id="LpNormalization-p1-axis1"),
    OpCase("LpNormalization", {"x": r(2, 3, 2)}, {"axis": 0}, opset=22,
           id="LpNormalization-axis0-opset22"),
    # the reference evaluator's LRN loops over range(batch) for the channels (right when the
    # batch is as large as the channels; onnxruntime has no float64 LRN)
    OpCase("LRN", {"x": r(3, 3, 3, 2)}, {"size": 3}, opset=13, id="LRN-size3"),
    OpCase("LRN", {"x": r(4, 4, 3, 1)}, {"size": 2, "alpha": 0.3, "beta": 0.6, "bias": 2.0},
           opset=11, check_ort=False, id="LRN-even-size"),  # onnxruntime: odd sizes only
    OpCase("LRN", {"x": r(6, 6, 1, 2)}, {"size": 5, "alpha": 0.5, "beta": 1.2}, opset=21,
           id="LRN-size5"),
]  # fmt: skip
