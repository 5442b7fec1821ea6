"""Softmax and LogSoftmax along one axis (opset 13 semantics), from their outputs.

* ``y = softmax(x)``: ``x_bar = y * (g - sum(g * y))``
* ``y = log_softmax(x)``: ``x_bar = g - exp(y) * sum(g)``

with sums along ``axis`` (kept, so they broadcast back).
"""

from __future__ import annotations

from onnxgrad.derivative.autodiff.registry import register


@register("Softmax", since=13)
def softmax_grad(b, node, grads, needs):
    (g,) = grads
    y = node.outputs[0]
    gy = b.mul(g, y)
    total = b.reduce_sum(gy, [node.attr("axis", -1)], keepdims=True)
    return [b.op("Sub", gy, b.mul(y, total))]


@register("LogSoftmax", since=13)
def log_softmax_grad(b, node, grads, needs):
    (g,) = grads
    total = b.reduce_sum(g, [node.attr("axis", -1)], keepdims=True)
    return [b.op("Sub", g, b.mul(b.op("Exp", node.outputs[0]), total))]
