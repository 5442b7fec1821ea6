"""Elementwise ops of several tensors. Broadcasting is undone by the engine (``broadcast=True``).

* ``z = x^p``: ``x_bar = z_bar p x^(p-1)``, ``p_bar = z_bar z log x`` (real for ``x > 0``;
  0 where ``x = 0``, the limit for ``p > 0``)
* ``Clip(x, lo, hi)``: ``x_bar = z_bar [lo <= x <= hi]``, ``lo_bar = sum z_bar [x < lo]``,
  ``hi_bar = sum z_bar [x > hi]`` (ONNX marks the bounds non-differentiable; their
  gradients are only built when asked for)
* ``Max``/``Min``: the gradient goes to the inputs equal to the result, split equally
  between ties (the subgradient torch and JAX pick for two inputs)
* ``Sum``: ``x_i_bar = z_bar``; ``Mean``: ``x_i_bar = z_bar / n``
* ``Where(c, x, y)``: ``x_bar = z_bar [c]``, ``y_bar = z_bar [not c]``; ``c`` has none
* ``Mod(x, d)`` (``z = x - q d`` with integer ``q`` constant almost everywhere):
  ``x_bar = z_bar``, ``d_bar = -z_bar q = -z_bar (x - z) / d``
"""

from __future__ import annotations

from onnxgrad.derivative.autodiff.registry import register


def _cast_to(b, value: str, like: str) -> str:
    """``value`` converted to the element type of ``like`` (nothing emitted if equal)."""
    if b.dtype(value) == b.dtype(like):
        return value
    return b.op("Cast", value, to=b.dtype(like))


@register("Pow", since=11, broadcast=True)
def pow_grad(b, node, grads, needs):
    (g,) = grads
    x, p = node.inputs
    gx = gp = None
    if needs[0]:
        gx = _pow_base_grad(b, g, x, p)
    if needs[1]:
        zero = b.const(0, like=x)
        safe_x = b.op("Where", b.op("Equal", x, zero), b.const(1, like=x), x)
        gp = b.mul(g, b.mul(node.outputs[0], b.op("Log", safe_x)))
        if b.dtype(p) != b.dtype(x):
            gp = b.op("Cast", gp, to=b.dtype(p))
    return [gx, gp]


def _pow_base_grad(b, g: str, x: str, p: str) -> str:
    """``g p x^(p-1)``, which is 0 where ``p = 0`` (also at ``x = 0``, where ``x^(p-1)`` is
    infinite); a constant scalar ``p`` is folded: 0 for 0, ``g`` for 1, ``g (x + x)`` for 2
    (onnxruntime's Pow is slow for exponents other than 2 and 3), ``p - 1`` computed once."""
    value = b.constant_value(p)
    if value is not None and value.size == 1:
        c = float(value.ravel()[0])
        if c == 0:
            return b.zeros_like(x)
        if c == 1:
            return g
        if c == 2:
            return b.mul(g, b.add(x, x))
        power = b.op("Pow", x, b.const(c - 1, like=x))
        return b.mul(g, b.mul(b.const(c, like=x), power))
    exponent = _cast_to(b, p, x)
    # the base is 1 where p = 0: p x^(p-1) is then 0 * 1, and no infinite x^(p-1) enters
    # the derivative of this gradient either
    flat = b.op("Equal", exponent, b.const(0, like=x))
    base = b.op("Where", flat, b.const(1, like=x), x)
    power = b.op("Pow", base, b.op("Sub", exponent, b.const(1, like=x)))
    return b.mul(g, b.mul(exponent, power))


def _at_least(b, x: str, bound: str) -> str:
    """``x >= bound``: GreaterOrEqual exists from opset 12, ``Not(x < bound)`` before."""
    if b.opset >= 12:
        return b.op("GreaterOrEqual", x, bound)
    return b.op("Not", b.op("Less", x, bound))


@register("Clip", since=11, broadcast=True)
def clip_grad(b, node, grads, needs):
    """``y = min(max(x, lo), hi)`` (``hi`` everywhere when ``lo > hi``): ``x`` gets ``g``
    where ``lo <= x <= hi``, ``lo`` where ``x < lo <= hi``, ``hi`` where ``max(x, lo) > hi``."""
    (g,) = grads
    x, low, high = node.inputs[0], node.input(1), node.input(2)
    need_low, need_high = low is not None and needs[1], high is not None and needs[2]
    inside = None
    if low is not None:
        inside = _at_least(b, x, low)
    if high is not None:
        below_high = _at_least(b, high, x)
        inside = below_high if inside is None else b.op("And", inside, below_high)
    gx = g if inside is None else b.mask(inside, g)
    g_low = g_high = None
    if need_low:
        below = b.op("Less", x, low)
        if high is not None:
            below = b.op("And", below, _at_least(b, high, low))
        g_low = b.mask(below, g)
    if need_high:
        raised = x if low is None else b.op("Max", x, low)
        g_high = b.mask(b.op("Greater", raised, high), g)
    return [gx if needs[0] else None, g_low, g_high]


def _extremum_grad(b, node, grads, needs):
    (g,) = grads
    if len(node.inputs) == 1:
        return [g]
    y = node.outputs[0]
    hits = [b.op("Cast", b.op("Equal", x, y), to=b.dtype(y)) for x in node.inputs]
    share = b.op("Div", g, b.op("Sum", *hits))
    return [b.mul(share, hit) if need else None for hit, need in zip(hits, needs)]


register("Max", since=11, broadcast=True)(_extremum_grad)
register("Min", since=11, broadcast=True)(_extremum_grad)


@register("Sum", since=11, broadcast=True)
def sum_grad(b, node, grads, needs):
    return [grads[0]] * len(node.inputs)


@register("Mean", since=11, broadcast=True)
def mean_grad(b, node, grads, needs):
    (g,) = grads
    share = g if len(node.inputs) == 1 else b.op("Div", g, b.const(len(node.inputs), like=g))
    return [share] * len(node.inputs)


@register("Where", since=11, broadcast=True)
def where_grad(b, node, grads, needs):
    (g,) = grads
    condition = node.inputs[0]
    gx = b.mask(condition, g) if needs[1] else None
    gy = b.mask(b.op("Not", condition), g) if needs[2] else None
    return [None, gx, gy]


@register("Mod", since=11, broadcast=True)
def mod_grad(b, node, grads, needs):
    (g,) = grads
    x, d = node.inputs
    gd = None
    if needs[1]:
        quotient = b.op("Div", b.op("Sub", x, node.outputs[0]), d)
        gd = b.neg(b.mul(g, quotient))
    return [g if needs[0] else None, gd]
