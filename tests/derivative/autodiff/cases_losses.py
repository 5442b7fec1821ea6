"""Rule table entries: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (reductions none,
sum and mean; class weights; ignore_index inside and outside the classes; the log_prob output;
2-D and higher-rank scores). Labels are integer initializers, class weights constants."""

import numpy as np
from onnx import helper

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(6)


def loss(op_type, id, shape, labels, weights=False, opset=18, n_outputs=1, **attrs):
    """``weights="wrt"``: class weights differentiated too."""
    inputs = {"scores": rng.standard_normal(shape), "labels": np.array(labels, dtype=np.int64)}
    if weights:
        inputs["weights"] = rng.uniform(0.5, 2.0, shape[1])
    wrt = ("scores", "weights") if weights == "wrt" else ("scores",)
    constants = () if weights == "wrt" else ("weights",)
    return OpCase(
        op_type, inputs, attrs, opset=opset, n_outputs=n_outputs, wrt=wrt,
        constants=constants, id=f"{op_type}-{id}",
    )  # fmt: skip


def unknown_rank(case):
    """``case`` on ``Squeeze(scores)``: with dynamic shapes the rank of the scores is unknown
    (as in the function body of SoftmaxCrossEntropyLoss)."""

    def graph(inputs, outputs):
        attrs = dict(case.attrs)
        return [
            helper.make_node("Squeeze", inputs[:1], ["squeezed"]),
            helper.make_node(case.op_type, ["squeezed", *inputs[1:]], ["loss"], **attrs),
            helper.make_node("Constant", [], ["flat"], value_ints=[-1]),
            helper.make_node("Reshape", ["loss", "flat"], outputs),
        ]

    case.graph = graph
    case.id += "-unknown-rank"
    return case


def sce(id, *args, **kwargs):
    return loss("SoftmaxCrossEntropyLoss", id, *args, **kwargs)


def nll(id, *args, **kwargs):
    return loss("NegativeLogLikelihoodLoss", id, *args, **kwargs)


CASES = [
    sce("mean-opset13", (3, 4), [0, 3, 1], opset=13),
    sce("none-weights", (2, 3, 2), [[0, 2], [1, 1]], weights=True, reduction="none"),
    sce("sum-ignore-inside", (2, 3, 2, 2), [[[0, 1], [2, 1]], [[1, 0], [2, 2]]],
        reduction="sum", ignore_index=1),
    sce("mean-weights-ignore-outside", (4, 3), [2, -1, 0, 1], weights=True, ignore_index=-1),
    sce("mean-ignore-no-weights", (3, 4, 2), [[0, 1], [3, 3], [2, 0]], ignore_index=3,
        opset=21),
    sce("log-prob-output", (3, 4), [1, 0, 2], n_outputs=2),
    sce("none-log-prob-output", (2, 3, 2), [[0, 2], [2, 1]], n_outputs=2, reduction="none",
        opset=13),
    sce("mean-weights-wrt", (4, 3), [2, 1, 0, 1], weights="wrt"),
    sce("mean-weights-wrt-ignore", (3, 4, 2), [[0, 1], [3, 3], [2, 0]], weights="wrt",
        ignore_index=3, opset=13),
    sce("sum-weights-wrt-log-prob", (2, 3, 2), [[0, 2], [1, 1]], weights="wrt",
        reduction="sum", n_outputs=2),
    sce("none-weights-wrt", (2, 3, 2), [[0, 2], [1, 1]], weights="wrt", reduction="none"),
    nll("mean-weights-wrt-ignore", (4, 3, 2), [[2, 0], [1, 0], [0, 0], [1, 2]],
        weights="wrt", ignore_index=0),
    nll("none-weights-wrt", (3, 4), [0, 3, 1], weights="wrt", reduction="none", opset=12),
    nll("sum-weights-wrt", (3, 4), [0, 3, 1], weights="wrt", reduction="sum", opset=13),
    unknown_rank(sce("mean-weights-wrt-ignore", (3, 4, 2), [[0, 1], [3, 3], [2, 0]],
                     weights="wrt", ignore_index=3)),
    unknown_rank(sce("mean-3d", (3, 4, 2), [[0, 1], [3, 3], [2, 0]], opset=13)),
    unknown_rank(nll("sum-weights-wrt", (2, 3, 2, 2), [[[0, 1], [2, 1]], [[1, 0], [2, 2]]],
                     weights="wrt", reduction="sum")),
    nll("mean-opset12", (3, 4), [0, 3, 1], opset=12),
    nll("none-weights", (2, 3, 2), [[0, 2], [1, 1]], weights=True, reduction="none"),
    nll("sum-ignore-inside", (2, 3, 2), [[0, 1], [2, 1]], reduction="sum", ignore_index=1),
    nll("mean-weights-ignore", (4, 3, 1, 2), [[[2, 0]], [[1, 0]], [[0, 0]], [[1, 2]]],
        weights=True, ignore_index=0, opset=21),
]  # fmt: skip
