"""Softmax and LogSoftmax, from their outputs.

* ``y = softmax(x)``: ``x_bar = y * (g - sum(g * y))``
* ``y = log_softmax(x)``: ``x_bar = g - exp(y) * sum(g)``

with sums kept (so they broadcast back) along the normalised axes: ``axis`` from opset 13
(default -1); before 13 the input is seen as a matrix split at ``axis`` (default 1), so
every axis from ``axis`` to the last is normalised together.

A row of ``x`` that is all ``-inf`` (a fully masked attention row) gives a NaN row of ``y``,
which graphs such as Attention's function body replace by zeros with a ``Where``, so the
gradient reaching that row is exactly 0: the rule reads a NaN of ``y`` as 0 on the rows where
``g`` is all zeros (``max g = min g = 0``), so such a row gets the gradient 0 (as
``y (g - sum(g y))`` does for any finite ``y``) instead of NaN, and so does its second
derivative. A NaN of ``y`` on a row with some nonzero ``g`` (a NaN or ``+inf`` in ``x``)
propagates. A finite ``y`` is read as it is on every row, zero ``g`` or not: the gradient
stays the linear map ``g -> y (g - sum(g y))`` wherever ``y`` is finite, also in its own
derivatives with respect to ``g`` (forward-over-reverse at a zero row of ``g``, as
``g = p V^T`` at ``V = 0``, and the transposition, whose cotangents of ones can cancel to
a zero row inside the graph: :mod:`onnxgrad.derivative.forward`); read as 0 on every silent
row, ``y`` made that derivative 0 there. The rule reads ``y`` and ``g``
only, never ``x``, so the forward does not keep the scores alive for the backward (in
attention, the scores beside the probabilities); the guard costs a ``ReduceMax`` and a
``ReduceMin`` of ``g`` and, over ``y``, an ``Equal(y, y)`` (false at a NaN: no ``IsNaN``,
which onnxruntime's WebGPU provider has no kernel for) and two ``Where``s (``Equal`` takes
every type ``Softmax`` does at each opset).
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
    y = node.outputs[0]
    axes = _normalised_axes(b, node)
    zero = b.const(0, like=y)
    silent = b.op(
        "And",
        b.op("Equal", b.reduce("ReduceMax", g, axes, keepdims=True), zero),
        b.op("Equal", b.reduce("ReduceMin", g, axes, keepdims=True), zero),
    )
    y = b.op("Where", silent, b.op("Where", b.op("Equal", y, y), y, zero), y)
    gy = b.mul(g, y)
    total = b.reduce_sum(gy, axes, keepdims=True)
    return [b.op("Sub", gy, b.mul(y, total))]


@register("LogSoftmax", since=11)
def log_softmax_grad(b, node, grads, needs):
    (g,) = grads
    total = b.reduce_sum(g, _normalised_axes(b, node), keepdims=True)
    return [b.op("Sub", g, b.mul(b.op("Exp", node.outputs[0]), total))]
