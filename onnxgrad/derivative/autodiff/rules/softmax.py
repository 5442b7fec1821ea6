"""Softmax and LogSoftmax, from their outputs.

* ``y = softmax(x)``: ``x_bar = y * (g - sum(g * y))``
* ``y = log_softmax(x)``: ``x_bar = g - exp(y) * sum(g)``

with sums kept (so they broadcast back) along the normalised axes: ``axis`` from opset 13
(default -1); before 13 the input is seen as a matrix split at ``axis`` (default 1), so
every axis from ``axis`` to the last is normalised together.

A row of ``x`` that is all ``-inf`` (a fully masked attention row) gives a NaN row of ``y``,
which graphs such as Attention's function body replace by zeros with a ``Where``; the
Softmax gradient reads ``y`` as 0 on the rows where ``max(x) = -inf``, so such a row gets the
gradient 0 (the gradient of the zeros that replace it) instead of NaN. Any other NaN of ``y``
(a NaN or ``+inf`` in ``x``) propagates to the gradient. It costs a ``ReduceMax`` of ``x``
and a ``Where`` over ``y``.
"""

from __future__ import annotations

from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._shape_helpers import require_rank


def _normalised_axes(b, node) -> list[int]:
    if node.opset >= 13:
        return [node.attr("axis", -1)]
    rank = require_rank(b, node.inputs[0], node)
    axis = node.attr("axis", 1)
    return list(range(axis + rank if axis < 0 else axis, rank))


@register("Softmax", since=11)
def softmax_grad(b, node, grads, needs):
    (g,) = grads
    x, y = node.inputs[0], node.outputs[0]
    axes = _normalised_axes(b, node)
    masked = b.op("IsInf", b.reduce("ReduceMax", x, axes, keepdims=True), detect_positive=0)
    y = b.op("Where", masked, b.const(0, like=y), y)
    gy = b.mul(g, y)
    total = b.reduce_sum(gy, axes, keepdims=True)
    return [b.op("Sub", gy, b.mul(y, total))]


@register("LogSoftmax", since=11)
def log_softmax_grad(b, node, grads, needs):
    (g,) = grads
    total = b.reduce_sum(g, _normalised_axes(b, node), keepdims=True)
    return [b.op("Sub", g, b.mul(b.op("Exp", node.outputs[0]), total))]
