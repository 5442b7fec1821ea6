r"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss: gradients of the scores
(log-probabilities), for reductions ``none``, ``sum`` and ``mean``, class weights and
``ignore_index``.

With :math:`t` the one-hot labels along axis 1, per-sample weights
:math:`w_i = \text{weights}[y_i]` (1 without weights, 0 where :math:`y_i` is ignored) and
the incoming gradient spread to samples as :math:`c_i = g_i` (``none``), :math:`g` (``sum``)
or :math:`g / \sum_i w_i` (``mean``):

* NegativeLogLikelihoodLoss: :math:`\bar x = -t\, c w`;
* SoftmaxCrossEntropyLoss: :math:`\bar s = (\operatorname{softmax}(s) - t)\, c w`, plus
  :math:`g_{lp} - p \sum_c g_{lp}` when its ``log_prob`` output carries a gradient.

Labels are integers; the class weights are not differentiated (asking for their gradient
raises ``NotImplementedError``).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._nn_helpers import (
    cast_like,
    per_channel,
    tensor_rank,
    unsupported,
)


@register("SoftmaxCrossEntropyLoss", since=13)
def softmax_cross_entropy_grad(b, node, grads, needs):
    _refuse_weight_gradient(node, needs)
    scores = node.inputs[0]
    g, g_log_prob = [*grads, None][:2]
    has_log_prob = len(node.outputs) > 1 and node.outputs[1]
    if has_log_prob:
        probabilities = b.op("Exp", node.outputs[1])
    else:
        probabilities = b.op("Softmax", scores, axis=1)
    parts = []
    if g is not None:
        one_hot, spread = _labels_and_spread(b, node, scores, g)
        parts.append(b.mul(b.op("Sub", probabilities, one_hot), spread))
    if g_log_prob is not None:
        total = b.reduce_sum(g_log_prob, [1], keepdims=True)
        parts.append(b.op("Sub", g_log_prob, b.mul(probabilities, total)))
    return [parts[0] if len(parts) == 1 else b.add(*parts)]


@register("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_grad(b, node, grads, needs):
    _refuse_weight_gradient(node, needs)
    one_hot, spread = _labels_and_spread(b, node, node.inputs[0], grads[0])
    return [b.mul(one_hot, b.neg(spread))]


def _refuse_weight_gradient(node: NodeView, needs: list[bool]) -> None:
    if len(needs) > 2 and needs[2]:
        raise unsupported(node, f"the class weights {node.inputs[2]!r} are not differentiated")


def _labels_and_spread(b: GradBuilder, node: NodeView, scores: str, g: str) -> tuple[str, str]:
    """One-hot labels (shape of ``scores``) and ``c w`` (broadcastable to it)."""
    labels, weights = node.inputs[1], node.input(2)
    rank = tensor_rank(b, node, scores)
    labels_1 = b.unsqueeze(labels, [1])
    one_hot = b.op(
        "Cast", b.op("Equal", labels_1, _classes(b, labels, scores, rank)), to=b.dtype(scores)
    )
    sample = None
    if weights is not None:
        class_weights = per_channel(b, cast_like(b, weights, scores), rank)
        sample = b.reduce_sum(b.mul(one_hot, class_weights), [1], keepdims=True)
    ignore_index = node.attr("ignore_index")
    if ignore_index is not None:
        ignored = b.op("Equal", labels_1, b.const(ignore_index, like=labels))
        kept = b.op("Cast", b.op("Not", ignored), to=b.dtype(scores))
        sample = kept if sample is None else b.mul(sample, kept)
    spread = _spread(b, node, g, sample, labels, scores)
    return one_hot, spread if sample is None else b.mul(spread, sample)


def _classes(b: GradBuilder, labels: str, scores: str, rank: int) -> str:
    """``[0, 1, ..., C - 1]`` shaped ``(1, C, 1, ...)`` with the labels' type."""
    shape = b.shape(scores)
    trailing = [1] * (rank - 2)
    if shape is not None and isinstance(shape[1], int):
        classes = np.arange(shape[1]).reshape(1, -1, *trailing)
        return b.const(classes.astype(np_dtype(b.dtype(labels))))
    count = b.op("Gather", b.shape_of(scores), b.ints(1), axis=0)
    classes = b.op("Range", b.ints(0), count, b.ints(1))
    classes = b.op("Reshape", classes, b.ints([1, -1, *trailing]))
    if b.dtype(labels) == TensorProto.INT64:
        return classes
    return b.op("Cast", classes, to=b.dtype(labels))


def _spread(b, node, g: str, sample: str | None, labels: str, scores: str) -> str:
    """The loss gradient per sample, before weighting: ``c``."""
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        return b.unsqueeze(g, [1])
    if reduction == "sum":
        return g
    if reduction != "mean":
        raise unsupported(node, f"reduction={reduction!r}")
    if sample is not None:
        return b.op("Div", g, b.reduce_sum(sample, None, keepdims=False))
    shape = b.static_shape(labels)
    if shape is not None:
        return b.mul(g, b.const(1.0 / max(int(np.prod(shape)), 1), like=scores))
    return b.op("Div", g, b.op("Cast", b.op("Size", labels), to=b.dtype(scores)))
