"""Activation functions, ``x_bar = y_bar * f'(x)``, written with the output ``y`` when cheaper.

Kinks take the derivative of the side ``x <= 0`` (Relu's derivative is 0 at 0). Where the
output has the sign of the input (``Relu``; ``Elu``, ``Celu`` with ``alpha > 0``, ``Selu`` with
``alpha, gamma > 0``) the side is read from ``y > 0``, so the backward needs the output only
and the forward's input can be freed as soon as the output is computed.

* ``Sigmoid``: ``y (1 - y)``; ``HardSigmoid``: ``alpha`` where ``0 < y < 1``, else 0
* ``Relu``: ``[x > 0]``; ``LeakyRelu``: ``1`` or ``alpha``; ``PRelu``: ``1`` or ``slope``, and
  ``slope_bar = y_bar * x [x <= 0]`` (the engine sums it back to the slope's shape)
* ``ThresholdedRelu``: ``[x > alpha]``; ``Shrink``: ``[|x| > lambd]``
* ``Elu``: ``1`` or ``y + alpha``; ``Selu``: ``gamma`` or ``y + gamma alpha``;
  ``Celu``: ``1`` or ``y / alpha + 1``
* ``Softplus``: ``sigmoid(x)``; ``Softsign``: ``1 / (1 + |x|)^2 = (1 - |y|)^2``
* ``Gelu``: ``Phi(x) + x phi(x)`` (exact), or the derivative of
  ``x/2 (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715 x^3)`` (``approximate='tanh'``)
* ``HardSwish``: ``0`` below -3, ``1`` above 3, ``x/3 + 1/2`` between
* ``Mish``: ``t + x (1 - t^2) sigmoid(x)`` with ``t = tanh(softplus(x))``
"""

from __future__ import annotations

import math

from onnxgrad.derivative.autodiff.registry import register

SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875
GELU_TANH_SLOPE = 0.044715


def _positive(b, x: str) -> str:
    return b.op("Greater", x, b.const(0, like=x))


def _scaled(b, g: str, derivative: str) -> str:
    return b.mul(g, derivative)


def _pass_where(b, mask: str, g: str) -> str:
    """``g`` where ``mask``, 0 elsewhere."""
    return b.mask(mask, g)


@register("Sigmoid", since=11)
def sigmoid_grad(b, node, grads, needs):
    y = node.outputs[0]
    return [_scaled(b, grads[0], b.mul(y, b.op("Sub", b.const(1, like=y), y)))]


@register("HardSigmoid", since=11)
def hard_sigmoid_grad(b, node, grads, needs):
    y = node.outputs[0]
    linear = b.op("And", _positive(b, y), b.op("Less", y, b.const(1, like=y)))
    slope = b.op("Where", linear, b.const(node.attr("alpha", 0.2), like=y), b.const(0, like=y))
    return [_scaled(b, grads[0], slope)]


def _positive_side(b, node, *constants: float) -> str:
    """``x > 0``, read from the output when every constant is positive (same sign)."""
    signed = all(c > 0 for c in constants)
    return _positive(b, node.outputs[0] if signed else node.inputs[0])


@register("Relu", since=11)
def relu_grad(b, node, grads, needs):
    return [_pass_where(b, _positive(b, node.outputs[0]), grads[0])]


@register("ThresholdedRelu", since=11)
def thresholded_relu_grad(b, node, grads, needs):
    x = node.inputs[0]
    above = b.op("Greater", x, b.const(node.attr("alpha", 1.0), like=x))
    return [_pass_where(b, above, grads[0])]


@register("Shrink", since=9)
def shrink_grad(b, node, grads, needs):
    x = node.inputs[0]
    outside = b.op("Greater", b.op("Abs", x), b.const(node.attr("lambd", 0.5), like=x))
    return [_pass_where(b, outside, grads[0])]


@register("LeakyRelu", since=11)
def leaky_relu_grad(b, node, grads, needs):
    x = node.inputs[0]
    slope = b.op(
        "Where", _positive(b, x), b.const(1, like=x), b.const(node.attr("alpha", 0.01), like=x)
    )
    return [_scaled(b, grads[0], slope)]


@register("PRelu", since=11, broadcast=True)
def prelu_grad(b, node, grads, needs):
    (g,) = grads
    x, slope = node.inputs
    positive = _positive(b, x)
    gx = gs = None
    if needs[0]:
        gx = _scaled(b, g, b.op("Where", positive, b.const(1, like=x), slope))
    if needs[1]:
        gs = _scaled(b, g, b.op("Where", positive, b.const(0, like=x), x))
    return [gx, gs]


@register("Elu", since=11)
def elu_grad(b, node, grads, needs):
    x, y = node.inputs[0], node.outputs[0]
    alpha = node.attr("alpha", 1.0)
    negative_side = b.add(y, b.const(alpha, like=x))
    slope = b.op("Where", _positive_side(b, node, alpha), b.const(1, like=x), negative_side)
    return [_scaled(b, grads[0], slope)]


@register("Selu", since=11)
def selu_grad(b, node, grads, needs):
    x, y = node.inputs[0], node.outputs[0]
    gamma, alpha = node.attr("gamma", SELU_GAMMA), node.attr("alpha", SELU_ALPHA)
    shift = b.const(gamma * alpha, like=x)
    positive = _positive_side(b, node, alpha, gamma)
    slope = b.op("Where", positive, b.const(gamma, like=x), b.add(y, shift))
    return [_scaled(b, grads[0], slope)]


@register("Celu", since=12)
def celu_grad(b, node, grads, needs):
    x, y = node.inputs[0], node.outputs[0]
    one, alpha = b.const(1, like=x), node.attr("alpha", 1.0)
    negative_side = b.add(b.op("Div", y, b.const(alpha, like=x)), one)
    positive = _positive_side(b, node, alpha)
    return [_scaled(b, grads[0], b.op("Where", positive, one, negative_side))]


@register("Softplus", since=11)
def softplus_grad(b, node, grads, needs):
    return [_scaled(b, grads[0], b.op("Sigmoid", node.inputs[0]))]


@register("Softsign", since=11)
def softsign_grad(b, node, grads, needs):
    y = node.outputs[0]
    root = b.op("Sub", b.const(1, like=y), b.op("Abs", y))
    return [_scaled(b, grads[0], b.mul(root, root))]


@register("Gelu", since=20)
def gelu_grad(b, node, grads, needs):
    approximate = node.attr("approximate", "none")
    if approximate == "none":
        derivative = _gelu_exact_derivative(b, node.inputs[0])
    elif approximate == "tanh":
        derivative = _gelu_tanh_derivative(b, node.inputs[0])
    else:
        raise NotImplementedError(
            f"Gelu node {node.name!r}: unsupported attribute approximate={approximate!r}"
        )
    return [_scaled(b, grads[0], derivative)]


def _gelu_exact_derivative(b, x: str) -> str:
    """``Phi(x) + x phi(x)``: normal CDF ``(1 + erf(x / sqrt 2)) / 2``, density
    ``exp(-x^2 / 2) / sqrt(2 pi)``."""
    erf = b.op("Erf", b.mul(x, b.const(1 / math.sqrt(2), like=x)))
    cdf = b.mul(b.add(erf, b.const(1, like=x)), b.const(0.5, like=x))
    density = b.op("Exp", b.mul(b.mul(x, x), b.const(-0.5, like=x)))
    x_density = b.mul(b.mul(x, b.const(1 / math.sqrt(2 * math.pi), like=x)), density)
    return b.add(cdf, x_density)


def _gelu_tanh_derivative(b, x: str) -> str:
    """``(1 + t) / 2 + x/2 (1 - t^2) u'`` with ``t = tanh(u)``, ``u' = k (1 + 3 a x^2)``."""
    k = math.sqrt(2 / math.pi)
    x2 = b.mul(x, x)
    u = b.mul(b.add(x, b.mul(b.mul(x2, x), b.const(GELU_TANH_SLOPE, like=x))), b.const(k, like=x))
    t = b.op("Tanh", u)
    half = b.const(0.5, like=x)
    du = b.add(b.mul(x2, b.const(3 * GELU_TANH_SLOPE * k, like=x)), b.const(k, like=x))
    sech2 = b.op("Sub", b.const(1, like=x), b.mul(t, t))
    outer = b.mul(b.add(t, b.const(1, like=x)), half)
    return b.add(outer, b.mul(b.mul(x, half), b.mul(sech2, du)))


@register("HardSwish", since=14)
def hard_swish_grad(b, node, grads, needs):
    x = node.inputs[0]
    ramp = b.add(b.mul(x, b.const(1 / 3, like=x)), b.const(0.5, like=x))
    upper = b.op("Where", b.op("Greater", x, b.const(3, like=x)), b.const(1, like=x), ramp)
    slope = b.op("Where", b.op("Less", x, b.const(-3, like=x)), b.const(0, like=x), upper)
    return [_scaled(b, grads[0], slope)]


@register("Mish", since=18)
def mish_grad(b, node, grads, needs):
    x = node.inputs[0]
    t = b.op("Tanh", b.op("Softplus", x))
    sech2 = b.op("Sub", b.const(1, like=x), b.mul(t, t))
    slope = b.add(t, b.mul(x, b.mul(sech2, b.op("Sigmoid", x))))
    return [_scaled(b, grads[0], slope)]
