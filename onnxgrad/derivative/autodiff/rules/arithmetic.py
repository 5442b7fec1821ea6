"""The four operations and friends. Broadcasting is undone by the engine (``broadcast=True``).

* ``z = a + b``: ``a_bar = z_bar``, ``b_bar = z_bar``
* ``z = a - b``: ``a_bar = z_bar``, ``b_bar = -z_bar``
* ``z = a * b``: ``a_bar = z_bar b``, ``b_bar = z_bar a`` (``z = a * a``: ``a_bar = z_bar 2a``)
* ``z = a / b``: ``a_bar = z_bar / b``, ``b_bar = -z_bar a / b^2 = -a_bar z``
* ``z = -a``: ``a_bar = -z_bar``; ``z = a`` (Identity, OptionalGetElement of a tensor):
  ``a_bar = z_bar``
"""

from __future__ import annotations

from onnxgrad.derivative.autodiff.registry import register


@register("Add", broadcast=True)
def add_grad(b, node, grads, needs):
    (g,) = grads
    return [g, g]


@register("Sub", broadcast=True)
def sub_grad(b, node, grads, needs):
    (g,) = grads
    return [g, b.neg(g) if needs[1] else None]


@register("Mul", broadcast=True)
def mul_grad(b, node, grads, needs):
    (g,) = grads
    x, y = node.inputs
    if x == y:
        return [b.mul(g, b.add(x, x)), None]
    return [b.mul(g, y) if needs[0] else None, b.mul(g, x) if needs[1] else None]


@register("Div", broadcast=True)
def div_grad(b, node, grads, needs):
    (g,) = grads
    gx = b.op("Div", g, node.inputs[1])
    gy = b.neg(b.mul(gx, node.outputs[0])) if needs[1] else None
    return [gx if needs[0] else None, gy]


@register("Neg")
def neg_grad(b, node, grads, needs):
    return [b.neg(grads[0])]


@register("Identity")
def identity_grad(b, node, grads, needs):
    return [grads[0]]


@register("OptionalGetElement", since=18)
def optional_get_element_grad(b, node, grads, needs):
    """A tensor input is returned as is (opset 18 accepts one): ``x_bar = y_bar``. An
    optional input would need an optional gradient, which no rule builds."""
    x = node.inputs[0]
    if not b.has_type(x):
        raise NotImplementedError(
            f"OptionalGetElement node {node.name or node.outputs[0]!r}: no gradient for the "
            f"non-tensor input {x!r} (optionals and sequences carry no gradient)"
        )
    return [grads[0]]
