"""Elementwise functions of one tensor, ``y = f(x)``: ``x_bar = y_bar * f'(x)``.

The derivative reuses the forward output ``y`` where that saves work:

* ``Exp``: ``y``; ``Log``: ``1 / x``; ``Sqrt``: ``1 / (2 y)``; ``Reciprocal``: ``-y^2``
* ``Abs``: ``sign(x)`` (0 at 0)
* ``Sin``: ``cos x``; ``Cos``: ``-sin x``; ``Tan``: ``1 + y^2``; ``Tanh``: ``1 - y^2``
* ``Sinh``: ``cosh x``; ``Cosh``: ``sinh x``; ``Asin``: ``1 / sqrt(1 - x^2)``;
  ``Acos``: ``-1 / sqrt(1 - x^2)``; ``Atan``: ``1 / (1 + x^2)``
* ``Asinh``: ``1 / sqrt(x^2 + 1)``; ``Acosh``: ``1 / sqrt(x^2 - 1)``; ``Atanh``: ``1 / (1 - x^2)``
* ``Erf``: ``2 / sqrt(pi) exp(-x^2)``
* ``Cast``, ``CastLike`` (float to float): the gradient cast back to the type of ``x``
* ``Dropout``: ``y = x`` in inference mode; ``y = x * mask / (1 - ratio)`` in training mode
"""

from __future__ import annotations

import math

from onnx import NodeProto

from onnxgrad._onnx_utils import NameScope
from onnxgrad.derivative.autodiff.registry import register


def _square(b, x: str) -> str:
    return b.mul(x, x)


def _one_minus_square(b, x: str) -> str:
    return b.op("Sub", b.const(1, like=x), _square(b, x))


def _one_plus_square(b, x: str) -> str:
    return b.add(_square(b, x), b.const(1, like=x))


@register("Exp", since=11)
def exp_grad(b, node, grads, needs):
    return [b.mul(grads[0], node.outputs[0])]


@register("Log", since=11)
def log_grad(b, node, grads, needs):
    return [b.op("Div", grads[0], node.inputs[0])]


@register("Sqrt", since=11)
def sqrt_grad(b, node, grads, needs):
    y = node.outputs[0]
    return [b.op("Div", grads[0], b.mul(y, b.const(2, like=y)))]


@register("Reciprocal", since=11)
def reciprocal_grad(b, node, grads, needs):
    return [b.neg(b.mul(grads[0], _square(b, node.outputs[0])))]


@register("Abs", since=11)
def abs_grad(b, node, grads, needs):
    return [b.mul(grads[0], b.op("Sign", node.inputs[0]))]


@register("Sin", since=11)
def sin_grad(b, node, grads, needs):
    return [b.mul(grads[0], b.op("Cos", node.inputs[0]))]


@register("Cos", since=11)
def cos_grad(b, node, grads, needs):
    return [b.neg(b.mul(grads[0], b.op("Sin", node.inputs[0])))]


@register("Tan", since=11)
def tan_grad(b, node, grads, needs):
    return [b.mul(grads[0], _one_plus_square(b, node.outputs[0]))]


@register("Tanh", since=11)
def tanh_grad(b, node, grads, needs):
    return [b.mul(grads[0], _one_minus_square(b, node.outputs[0]))]


@register("Sinh", since=11)
def sinh_grad(b, node, grads, needs):
    return [b.mul(grads[0], b.op("Cosh", node.inputs[0]))]


@register("Cosh", since=11)
def cosh_grad(b, node, grads, needs):
    return [b.mul(grads[0], b.op("Sinh", node.inputs[0]))]


@register("Asin", since=11)
def asin_grad(b, node, grads, needs):
    return [b.op("Div", grads[0], b.op("Sqrt", _one_minus_square(b, node.inputs[0])))]


@register("Acos", since=11)
def acos_grad(b, node, grads, needs):
    return [b.neg(b.op("Div", grads[0], b.op("Sqrt", _one_minus_square(b, node.inputs[0]))))]


@register("Atan", since=11)
def atan_grad(b, node, grads, needs):
    return [b.op("Div", grads[0], _one_plus_square(b, node.inputs[0]))]


@register("Asinh", since=11)
def asinh_grad(b, node, grads, needs):
    return [b.op("Div", grads[0], b.op("Sqrt", _one_plus_square(b, node.inputs[0])))]


@register("Acosh", since=11)
def acosh_grad(b, node, grads, needs):
    x = node.inputs[0]
    square_minus_one = b.op("Sub", _square(b, x), b.const(1, like=x))
    return [b.op("Div", grads[0], b.op("Sqrt", square_minus_one))]


@register("Atanh", since=11)
def atanh_grad(b, node, grads, needs):
    return [b.op("Div", grads[0], _one_minus_square(b, node.inputs[0]))]


@register("Erf", since=11)
def erf_grad(b, node, grads, needs):
    x = node.inputs[0]
    gaussian = b.op("Exp", b.neg(_square(b, x)))
    return [b.mul(grads[0], b.mul(gaussian, b.const(2 / math.sqrt(math.pi), like=x)))]


@register("Cast", since=11)
def cast_grad(b, node, grads, needs):
    source = b.dtype(node.inputs[0])
    if source == node.attr("to"):
        return [grads[0]]
    return [b.op("Cast", grads[0], to=source)]


@register("CastLike", since=15)
def cast_like_grad(b, node, grads, needs):
    x, target = node.inputs
    if b.dtype(x) == b.dtype(target):
        return [grads[0], None]
    return [b.op("Cast", grads[0], to=b.dtype(x)), None]


def _expose_mask(node: NodeProto, scope: NameScope) -> None:
    """A forward Dropout that may train also returns its ``mask``: the gradient must use the
    elements this very run kept."""
    has_mode = len(node.input) > 2 and node.input[2]
    if has_mode and (len(node.output) < 2 or not node.output[1]):
        del node.output[1:]
        node.output.append(scope.unique(f"{node.output[0]}_mask"))


@register("Dropout", since=11, forward=_expose_mask)
def dropout_grad(b, node, grads, needs):
    """Identity without a ``training_mode`` input or with a constant false one. Otherwise:
    ``x_bar = y_bar * mask * s`` with ``s = 1 / (1 - ratio)`` in training mode and ``1``
    otherwise (the mask is all true then); the forward node returns its ``mask`` if it did
    not already. For a given mask (piecewise constant in the ratio ``r``),
    ``r_bar = sum(y_bar y) / (1 - r)`` in training mode, 0 otherwise."""
    g = grads[0]
    training_mode = node.input(2)
    if training_mode is None:
        return [g]
    constant_mode = b.constant_value(training_mode)
    if constant_mode is not None and not bool(constant_mode):
        return [g]
    x = node.inputs[0]
    one = b.const(1, like=x)
    ratio = node.input(1)
    ratio = b.const(0.5, like=x) if ratio is None else b.op("Cast", ratio, to=b.dtype(x))
    scale = b.op("Where", training_mode, b.op("Div", one, b.op("Sub", one, ratio)), one)
    mask = b.op("Cast", node.outputs[1], to=b.dtype(x))
    ratio_grad = None
    if len(needs) > 1 and needs[1]:
        per_unit = b.op("Div", b.mul(g, node.outputs[0]), b.op("Sub", one, ratio))
        training = b.op("Cast", training_mode, to=b.dtype(x))
        total = b.mul(b.reduce_sum(per_unit, None, keepdims=False), training)
        ratio_grad = b.op("Cast", total, to=b.dtype(node.inputs[1]))
    return [b.mul(g, b.mul(mask, scale)), ratio_grad]
