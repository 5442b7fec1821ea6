"""Rule table entries: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (reductions none,
sum and mean; class weights; ignore_index inside and outside the classes; the log_prob output;
2-D and higher-rank scores). Labels are integer initializers, class weights constants."""

import numpy as np

from tests.derivative.autodiff.gradcheck import OpCase

rng = np.random.default_rng(6)


def loss(op_type, id, shape, labels, weights=False, opset=18, n_outputs=1, **attrs):
    inputs = {"scores": rng.standard_normal(shape), "labels": np.array(labels, dtype=np.int64)}
    if weights:
        inputs["weights"] = rng.uniform(0.5, 2.0, shape[1])
    return OpCase(
        op_type, inputs, attrs, opset=opset, n_outputs=n_outputs, wrt=("scores",),
        constants=("weights",), id=f"{op_type}-{id}",
    )  # fmt: skip


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
    nll("mean-opset12", (3, 4), [0, 3, 1], opset=12),
    nll("none-weights", (2, 3, 2), [[0, 2], [1, 1]], weights=True, reduction="none"),
    nll("sum-ignore-inside", (2, 3, 2), [[0, 1], [2, 1]], reduction="sum", ignore_index=1),
    nll("mean-weights-ignore", (4, 3, 1, 2), [[[2, 0]], [[1, 0]], [[0, 0]], [[1, 2]]],
        weights=True, ignore_index=0, opset=21),
]  # fmt: skip
