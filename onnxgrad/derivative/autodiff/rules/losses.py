r"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss: gradients of the scores
(log-probabilities), for reductions ``none``, ``sum`` and ``mean``, class weights and
``ignore_index``.

With :math:`t` the one-hot labels along axis 1, per-sample weights
:math:`w_i = \text{weights}[y_i]` (1 without weights, 0 where :math:`y_i` is ignored) and
the incoming gradient spread to samples as :math:`c_i = g_i` (``none``), :math:`g` (``sum``)
or :math:`g / \sum_i w_i` (``mean``):

* NegativeLogLikelihoodLoss: :math:`\bar x = -t\, c w`;
* SoftmaxCrossEntropyLoss: :math:`\bar s = \operatorname{softmax}(s)\, c w - t\, c w`
  (from opset 16 the second term is subtracted at the labels' positions, without a one-hot
  tensor), plus :math:`g_{lp} - p \sum_c g_{lp}` when its ``log_prob`` output carries a
  gradient.

Labels are integers. The class weights :math:`W` get, with :math:`l_i = -lp_{i, y_i}` the
unweighted loss of sample :math:`i` (:math:`lp` the log-probabilities) and :math:`k_i` 0
where :math:`y_i` is ignored, 1 elsewhere,
:math:`\bar W_c = \sum_{i: y_i = c} k_i\, g_i l_i` (``none``), :math:`g \sum k_i l_i`
(``sum``), :math:`g \sum k_i (l_i - L) / \sum_i w_i` (``mean``, :math:`L` the loss).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
from onnx import TensorProto

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._nn_helpers import cast_like, unsupported
from onnxgrad.derivative.autodiff.rules._shape_helpers import scalar_tensor


@register("SoftmaxCrossEntropyLoss", since=13)
def softmax_cross_entropy_grad(b, node, grads, needs):
    scores = node.inputs[0]
    g, g_log_prob = [*grads, None][:2]
    has_log_prob = len(node.outputs) > 1 and node.outputs[1]
    log_prob = node.outputs[1] if has_log_prob else None
    if has_log_prob:
        probabilities = b.op("Exp", log_prob)
    else:
        probabilities = b.op("Softmax", scores, axis=1)
    parts, g_weights = [], None
    if g is not None:
        labels = _Labels(b, node, scores)
        parts.append(labels.minus_one_hot_times(probabilities, labels.spread(g)))
        if len(needs) > 2 and needs[2]:
            log_prob = log_prob or b.op("LogSoftmax", scores, axis=1)
            g_weights = labels.weights_grad(g, log_prob)
    if g_log_prob is not None:
        total = b.reduce_sum(g_log_prob, [1], keepdims=True)
        parts.append(b.op("Sub", g_log_prob, b.mul(probabilities, total)))
    if not parts:
        return [None, None, None]
    return [parts[0] if len(parts) == 1 else b.add(*parts), None, g_weights]


@register("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_grad(b, node, grads, needs):
    (g,) = grads
    labels = _Labels(b, node, node.inputs[0])
    g_scores = b.mul(labels.one_hot, b.neg(labels.spread(g))) if needs[0] else None
    g_weights = None
    if len(needs) > 2 and needs[2]:
        g_weights = labels.weights_grad(g, node.inputs[0])
    return [g_scores, None, g_weights]


class _Labels:
    """One-hot labels (shape of ``scores``) and per-sample weights ``w_i`` (shape of the
    labels with axis 1 kept, ``None`` when every weight is 1)."""

    def __init__(self, b: GradBuilder, node: NodeView, scores: str):
        self.b, self.node, self.scores = b, node, scores
        self.labels, weights = node.inputs[1], node.input(2)
        self.rank = b.rank(scores)
        self.labels_1 = b.unsqueeze(self.labels, [1])
        self.kept = self.ignored = None
        ignore_index = node.attr("ignore_index")
        if ignore_index is not None:
            self.ignored = b.op("Equal", self.labels_1, b.const(ignore_index, like=self.labels))
            self.kept = b.op("Cast", b.op("Not", self.ignored), to=b.dtype(scores))
        self.sample = None
        if weights is not None:
            class_weights = _along_channels(b, cast_like(b, weights, scores), scores, self.rank)
            self.sample = b.reduce_sum(b.mul(self.one_hot, class_weights), [1], keepdims=True)
        if self.kept is not None:
            self.sample = self.kept if self.sample is None else b.mul(self.sample, self.kept)

    @cached_property
    def one_hot(self) -> str:
        """The labels one-hot along axis 1, typed like the scores (a tensor of their size)."""
        b = self.b
        classes = _classes(b, self.labels, self.scores, self.rank)
        return b.op("Cast", b.op("Equal", self.labels_1, classes), to=b.dtype(self.scores))

    def minus_one_hot_times(self, p: str, c: str) -> str:
        """``(p - t) c`` (``p`` shaped like the scores, ``c`` broadcastable to the labels
        with axis 1 kept). Opset >= 16: ``p c`` with ``c`` subtracted where the labels
        point (``ScatterElements``, ``reduction='add'``), so that no one-hot tensor of the
        scores' size is made: a language model's logits gradient holds two tensors of their
        size at once instead of three. Ignored labels (which may lie outside the classes)
        point to class 0, where ``c`` is 0."""
        b = self.b
        if self.node.opset < 16:
            return b.mul(b.op("Sub", p, self.one_hot), c)
        index = self.labels_1
        if self.ignored is not None:
            index = b.op("Where", self.ignored, b.const(0, like=self.labels), index)
        updates = b.op("Expand", b.neg(c), b.op("Shape", index))
        return b.op("ScatterElements", b.mul(p, c), index, updates, axis=1, reduction="add")

    def spread(self, g: str) -> str:
        """``c w``, broadcastable to the scores."""
        spread = _spread(self.b, self.node, g, self.sample, self.labels, self.scores)
        return spread if self.sample is None else self.b.mul(spread, self.sample)

    def weights_grad(self, g: str, log_prob: str) -> str:
        """``W_bar``: the per-sample factors of the module docstring summed by class."""
        b, node = self.b, self.node
        picked = b.reduce_sum(b.mul(self.one_hot, log_prob), [1], keepdims=True)
        reduction = node.attr("reduction", "mean")
        if reduction == "none":
            factor = b.mul(b.unsqueeze(g, [1]), picked)
        elif reduction == "sum":
            factor = b.mul(g, picked)
        else:
            centred = b.op("Add", picked, node.outputs[0])
            factor = b.op("Div", b.mul(g, centred), b.reduce_sum(self.sample, None, False))
        factor = b.neg(factor)
        if self.kept is not None:
            factor = b.mul(factor, self.kept)
        if self.rank is not None:
            axes = [0, *range(2, self.rank)]
        elif b.opset >= 13:
            rank = b.op("Size", b.shape_of(self.scores))
            axes = b.op("Concat", b.ints([0]), b.op("Range", b.ints(2), rank, b.ints(1)), axis=0)
        else:
            raise unsupported(node, f"the rank of {self.scores!r} is unknown (opset < 13)")
        total = b.reduce_sum(b.mul(self.one_hot, factor), axes, keepdims=False)
        return cast_like(b, total, node.inputs[2], self.scores)


def _classes(b: GradBuilder, labels: str, scores: str, rank: int | None) -> str:
    """``[0, 1, ..., C - 1]`` shaped ``(1, C, 1, ...)`` with the labels' type."""
    shape = b.shape(scores)
    if shape is not None and isinstance(shape[1], int):
        classes = np.arange(shape[1]).reshape(1, -1, *[1] * (rank - 2))
        return b.const(classes.astype(np_dtype(b.dtype(labels))))
    count = b.op("Gather", b.shape_of(scores), b.ints(1), axis=0)
    classes = _along_channels(b, b.op("Range", b.ints(0), count, b.ints(1)), scores, rank)
    if b.dtype(labels) == TensorProto.INT64:
        return classes
    return b.op("Cast", classes, to=b.dtype(labels))


def _along_channels(b: GradBuilder, v: str, scores: str, rank: int | None) -> str:
    """A ``(C,)`` vector shaped ``(1, C, 1, ..., 1)`` like ``scores`` (of unknown rank too)."""
    if rank is not None:
        return b.op("Reshape", v, b.ints([1, -1, *[1] * (rank - 2)]))
    trailing = b.op("Sub", b.op("Shape", b.shape_of(scores)), b.ints([2]))
    ones = b.op("ConstantOfShape", trailing, value=scalar_tensor(1, TensorProto.INT64))
    return b.op("Reshape", v, b.op("Concat", b.ints([1, -1]), ones, axis=0))


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
