r"""Tangent rules: ``op_type -> rule(ctx) -> [tangent of each output, or None]``.

``ctx`` is a :class:`~onnxgrad.derivative.autodiff.tangent.TangentContext`; ``x``, ``y`` are
the node's input and output, ``t`` the input's tangent, ``\dot y`` the result.

* linear in their first input (reshapes, slices, gathers, sums, average pools): the node
  again on ``t``;
* elementwise: ``\dot y = f'(x) t`` (``y (1 - y) t`` for Sigmoid, ``t / 2y`` for Sqrt...);
* products: ``\dot y = f(\dot a, b) + f(a, \dot b)`` for Mul, MatMul, Gemm, Conv, Einsum;
* Softmax: ``\dot y = y t - y \sum y t``; LogSoftmax: ``t - \sum e^y t``;

Domain-default operators only; an operator with no entry (or an input a rule does not
differentiate) sends the caller back to the transposition.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxgrad._onnx_utils import FLOAT_TYPES
from onnxgrad.derivative.autodiff.rules.normalization import moments
from onnxgrad.derivative.autodiff.rules.reduce import extremum_share
from onnxgrad.derivative.autodiff.tangent import NoTangentRule, Tangent, TangentContext

TangentRule = Callable[[TangentContext], list]

TANGENT_RULES: dict[str, TangentRule] = {}


def tangent_rule(*op_types: str):
    def decorate(rule: TangentRule) -> TangentRule:
        for op_type in op_types:
            TANGENT_RULES[op_type] = rule
        return rule

    return decorate


# -- linear -----------------------------------------------------------------------------------
@tangent_rule(
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Gather",
    "GatherElements", "GatherND", "ReduceSum", "ReduceMean", "GlobalAveragePool",
    "AveragePool", "Tile", "DepthToSpace", "SpaceToDepth", "Split", "CumSum", "Trilu",
    "Compress", "ReverseSequence", "Neg", "Resize",
)  # fmt: skip
def _linear_in_first(ctx: TangentContext) -> list:
    """``f(t, rest)`` for ``f`` linear in its first input (a Resize that fills points
    outside its region of interest with a constant is not)."""
    ctx.only(0)
    if ctx.node.attr("coordinate_transformation_mode") == "tf_crop_and_resize":
        raise NoTangentRule(f"Resize node {ctx.node.name!r} in tf_crop_and_resize mode")
    return [Tangent(n) for n in ctx.copy([ctx.exact(0), *ctx.node.inputs[1:]])]


@tangent_rule("Expand")
def _expand(ctx: TangentContext) -> list:
    ctx.only(0)
    (out,) = ctx.copy([ctx.loose(0), ctx.node.inputs[1]])
    return [Tangent(out, ctx.is_exact(0))]


@tangent_rule("Cast", "CastLike")
def _cast(ctx: TangentContext) -> list:
    """The tangent cast as the value; ``CastLike``'s second input gives only its type, so
    no tangent flows from it (``CastLike(-inf, mask)`` in Attention's body)."""
    ctx.only(0, 1) if ctx.node.op_type == "CastLike" else ctx.only(0)
    if not ctx.active(0):
        return [None]
    like = ctx.node.input(1)
    to = ctx.b.dtype(like) if like is not None and ctx.b.has_type(like) else ctx.node.attr("to")
    if to not in FLOAT_TYPES:
        if ctx.node.op_type == "CastLike" and to is None:
            raise NoTangentRule(f"CastLike node {ctx.node.name!r}: unknown target type")
        return [None]
    (out,) = ctx.copy([ctx.loose(0), *ctx.node.inputs[1:]])
    return [Tangent(out, ctx.is_exact(0))]


@tangent_rule("Identity")
def _identity(ctx: TangentContext) -> list:
    return [Tangent(ctx.loose(0), ctx.is_exact(0))]


@tangent_rule("Dropout")
def _dropout(ctx: TangentContext) -> list:
    """Inference-mode Dropout is the identity (a training mode input is refused)."""
    ctx.only(0)
    if ctx.node.input(2) is not None or ctx.node.attr("training_mode", 0):
        raise NoTangentRule(f"Dropout node {ctx.node.name!r} in training mode")
    return [Tangent(ctx.loose(0), ctx.is_exact(0))]


@tangent_rule("Pad")
def _pad(ctx: TangentContext) -> list:
    """Pad is linear in ``x``; a constant pad value pads the tangent with 0."""
    ctx.only(0)
    (out,) = ctx.copy([ctx.exact(0), ctx.node.inputs[1], None, *ctx.node.inputs[3:]])
    return [Tangent(out)]


@tangent_rule("Concat")
def _concat(ctx: TangentContext) -> list:
    inputs = [ctx.exact_or_zeros(i) for i in range(len(ctx.node.inputs))]
    return [Tangent(ctx.copy(inputs)[0])]


@tangent_rule("Add", "Sum")
def _add(ctx: TangentContext) -> list:
    indices = range(len(ctx.node.inputs))
    total = ctx.sum([_term(ctx, i, ctx.loose(i)) for i in indices])
    return [Tangent(total.name, total.exact or _all_exact(ctx, indices))]


@tangent_rule("Sub")
def _sub(ctx: TangentContext) -> list:
    first, second = _term(ctx, 0, ctx.loose(0)), _term(ctx, 1, ctx.loose(1))
    if first is None or second is None:
        only = first or second
        name = only.name if first else ctx.b.neg(only.name)
        return [Tangent(name, only.exact)]
    exact = first.exact or second.exact or _all_exact(ctx, (0, 1))
    return [Tangent(ctx.b.op("Sub", first.name, second.name), exact)]


@tangent_rule("Mean")
def _mean(ctx: TangentContext) -> list:
    total = _add(ctx)[0]
    scale = ctx.b.const(1.0 / len(ctx.node.inputs), like=ctx.like)
    return [Tangent(ctx.b.mul(total.name, scale), total.exact)]


@tangent_rule("Where")
def _where(ctx: TangentContext) -> list:
    ctx.only(1, 2)
    terms = [_term(ctx, i, ctx.loose(i)) for i in (1, 2)]
    zero = ctx.b.const(0, like=ctx.like)
    chosen = [zero if t is None else t.name for t in terms]
    exact = any(t is not None and t.exact for t in terms) or _all_exact(ctx, (1, 2))
    return [Tangent(ctx.b.op("Where", ctx.node.inputs[0], *chosen), exact)]


def _term(ctx: TangentContext, index: int, tangent: str | None) -> Tangent | None:
    """``tangent`` (of input ``index`` or a multiple of it) as a term of a broadcasting
    op's output tangent: exact when the input is exact and already as large as the output."""
    if tangent is None:
        return None
    return Tangent(tangent, ctx.is_exact(index) and _covers_output(ctx, index))


def _all_exact(ctx: TangentContext, indices) -> bool:
    """Whether every input of ``indices`` has an exact tangent: a broadcasting op of
    their tangents then has the output's shape (besides a condition input, which the
    output's broadcast includes too)."""
    return all(ctx.is_exact(i) for i in indices)


def _covers_output(ctx: TangentContext, index: int) -> bool:
    """Whether input ``index`` of a broadcasting node has the output's shape: every other
    input broadcasts into it (declared shapes)."""
    inputs = ctx.node.inputs
    shape = ctx.shape(inputs[index])
    if shape is None:
        return False
    for j, other in enumerate(inputs):
        if j == index or not other:
            continue
        other_shape = ctx.shape(other)
        if other_shape is None or len(other_shape) > len(shape):
            return False
        aligned = shape[len(shape) - len(other_shape) :]
        if not all(d == 1 or (d is not None and d == e) for d, e in zip(other_shape, aligned)):
            return False
    return True


# -- products ---------------------------------------------------------------------------------
@tangent_rule("Mul")
def _mul(ctx: TangentContext) -> list:
    a, b = ctx.node.inputs
    terms = []
    if ctx.active(0):
        terms.append(Tangent(ctx.b.mul(ctx.loose(0), b), ctx.is_exact(0)))
    if ctx.active(1):
        terms.append(Tangent(ctx.b.mul(a, ctx.loose(1)), ctx.is_exact(1)))
    return [ctx.sum(terms)]


@tangent_rule("Div")
def _div(ctx: TangentContext) -> list:
    """``(\\dot a - \\dot b y) / b``."""
    b = ctx.node.inputs[1]
    y = ctx.node.outputs[0]
    if not ctx.active(1):
        return [Tangent(ctx.b.op("Div", ctx.loose(0), b), ctx.is_exact(0))]
    moved = ctx.b.mul(ctx.loose(1), y)
    numerator = ctx.b.op("Sub", ctx.loose(0), moved) if ctx.active(0) else ctx.b.neg(moved)
    return [Tangent(ctx.b.op("Div", numerator, b))]


@tangent_rule("MatMul")
def _matmul(ctx: TangentContext) -> list:
    a, b = ctx.node.inputs
    terms = []
    if ctx.active(0):
        terms.append(Tangent(ctx.b.op("MatMul", ctx.exact(0), b)))
    if ctx.active(1):
        terms.append(Tangent(ctx.b.op("MatMul", a, ctx.exact(1))))
    return [ctx.sum(terms)]


@tangent_rule("Einsum")
def _einsum(ctx: TangentContext) -> list:
    """Multilinear: one Einsum per input with a tangent."""
    inputs = list(ctx.node.inputs)
    terms = []
    for i in range(len(inputs)):
        if ctx.active(i):
            swapped = [ctx.exact(i) if j == i else x for j, x in enumerate(inputs)]
            terms.append(Tangent(ctx.copy(swapped)[0]))
    return [ctx.sum(terms)]


@tangent_rule("Gemm")
def _gemm(ctx: TangentContext) -> list:
    """``alpha (op(\\dot A) op(B) + op(A) op(\\dot B)) + beta \\dot C``."""
    a, b = ctx.node.inputs[:2]
    terms = []
    if ctx.active(0):
        terms.append(Tangent(ctx.copy([ctx.exact(0), b])[0]))
    if ctx.active(1):
        terms.append(Tangent(ctx.copy([a, ctx.exact(1)])[0]))
    if ctx.active(2):
        beta = ctx.node.attr("beta", 1.0)
        c = ctx.loose(2)
        c = c if beta == 1.0 else ctx.b.mul(c, ctx.b.const(beta, like=ctx.like))
        terms.append(Tangent(c, False))
    return [ctx.sum(terms)]


@tangent_rule("Conv", "ConvTranspose")
def _conv(ctx: TangentContext) -> list:
    x, w = ctx.node.inputs[:2]
    terms = []
    if ctx.active(0):
        terms.append(Tangent(ctx.copy([ctx.exact(0), w])[0]))
    if ctx.active(1):
        terms.append(Tangent(ctx.copy([x, ctx.exact(1)])[0]))
    if ctx.active(2):
        rank = ctx.b.rank(w)
        if rank is None:
            raise NoTangentRule(f"Conv node {ctx.node.name!r}: bias tangent of unknown rank")
        column = ctx.b.op("Reshape", ctx.exact(2), ctx.b.ints([-1] + [1] * (rank - 2)))
        terms.append(Tangent(column, False))
    return [ctx.sum(terms)]


@tangent_rule("BatchNormalization")
def _batch_norm(ctx: TangentContext) -> list:
    """Inference mode, linear in ``x``: the node on ``t`` with zero bias and mean."""
    ctx.only(0)
    if ctx.node.attr("training_mode", 0) or len(ctx.node.outputs) > 1:
        raise NoTangentRule(f"BatchNormalization node {ctx.node.name!r} in training mode")
    _, scale, bias, _, var = ctx.node.inputs
    zero = ctx.b.op("Mul", bias, ctx.b.const(0, like=ctx.like))
    return [Tangent(ctx.copy([ctx.exact(0), scale, zero, zero, var])[0])]


# -- elementwise ------------------------------------------------------------------------------
def _scaled(ctx: TangentContext, factor: str) -> list:
    """``t * factor``, ``factor`` of the input's shape."""
    return [Tangent(ctx.b.mul(ctx.loose(0), factor), ctx.is_exact(0))]


def _elementwise(op_type: str):
    def decorate(derivative: Callable[[TangentContext, str, str], str]):
        def rule(ctx: TangentContext) -> list:
            ctx.only(0)
            return _scaled(ctx, derivative(ctx, ctx.node.inputs[0], ctx.node.outputs[0]))

        TANGENT_RULES[op_type] = rule
        return derivative

    return decorate


@_elementwise("Exp")
def _exp(ctx, x, y):
    return y


@_elementwise("Log")
def _log(ctx, x, y):
    return ctx.b.op("Reciprocal", x)


@_elementwise("Sqrt")
def _sqrt(ctx, x, y):
    return ctx.b.op("Div", ctx.b.const(0.5, like=x), y)


@_elementwise("Reciprocal")
def _reciprocal(ctx, x, y):
    return ctx.b.neg(ctx.b.mul(y, y))


@_elementwise("Sigmoid")
def _sigmoid(ctx, x, y):
    return ctx.b.mul(y, ctx.b.op("Sub", ctx.b.const(1, like=x), y))


@_elementwise("Tanh")
def _tanh(ctx, x, y):
    return ctx.b.op("Sub", ctx.b.const(1, like=x), ctx.b.mul(y, y))


@_elementwise("Relu")
def _relu(ctx, x, y):
    """``Cast(y > 0)``: read from ``y``, so that ``x`` has one reader and onnxruntime
    fuses its producer with the ReLU (a Conv's, say); its Sign kernel is slower."""
    return ctx.b.op("Cast", ctx.b.op("Greater", y, ctx.b.const(0, like=x)), to=ctx.b.dtype(x))


@_elementwise("LeakyRelu")
def _leaky_relu(ctx, x, y):
    one, alpha = ctx.b.const(1, like=x), ctx.b.const(ctx.node.attr("alpha", 0.01), like=x)
    return ctx.b.op("Where", ctx.b.op("Greater", x, ctx.b.const(0, like=x)), one, alpha)


@_elementwise("Erf")
def _erf(ctx, x, y):
    scale = ctx.b.const(2 / np.sqrt(np.pi), like=x)
    return ctx.b.mul(scale, ctx.b.op("Exp", ctx.b.neg(ctx.b.mul(x, x))))


#: ``f -> f'`` where the derivative is an operator of ``x``
_DERIVATIVE_OPS = {
    "Sin": "Cos",
    "Abs": "Sign",
    "Softplus": "Sigmoid",
    "Sinh": "Cosh",
    "Cosh": "Sinh",
}
for _op_type, _derivative in _DERIVATIVE_OPS.items():
    _elementwise(_op_type)(lambda ctx, x, y, op_type=_derivative: ctx.b.op(op_type, x))


@_elementwise("Cos")
def _cos(ctx, x, y):
    return ctx.b.neg(ctx.b.op("Sin", x))


@tangent_rule("Pow")
def _pow(ctx: TangentContext) -> list:
    """``p x^{p-1} \\dot x + y \\log(x) \\dot p``."""
    x, p = ctx.node.inputs
    y = ctx.node.outputs[0]
    terms = []
    if ctx.active(0):
        factor = _power_factor(ctx, x, p)
        if factor is not None:
            terms.append(Tangent(ctx.b.mul(ctx.loose(0), factor), ctx.is_exact(0)))
    if ctx.active(1):
        log = ctx.b.mul(y, ctx.b.op("Log", x))
        terms.append(Tangent(ctx.b.mul(ctx.loose(1), log), ctx.is_exact(1)))
    return [ctx.sum(terms)]


def _power_factor(ctx: TangentContext, x: str, p: str) -> str | None:
    r"""``p x^{p-1}`` in ``x``'s element type (``p`` may be an integer tensor), 0 where
    ``p = 0`` (``0 \cdot 0^{-1}`` would be NaN at ``x = 0``); None for a constant 0."""
    b = ctx.b
    exponent = b.constant_value(p)
    if exponent is not None and exponent.size == 1:
        e = float(exponent.reshape(-1)[0])
        if e == 0.0:
            return None
        shape = exponent.shape
        if e == 2.0:
            return b.mul(x, b.const(np.full(shape, 2.0), like=x))
        lowered = b.op("Pow", x, b.const(np.full(shape, e - 1), like=x))
        return b.mul(lowered, b.const(np.full(shape, e), like=x))
    if not b.has_type(p) or b.dtype(p) != b.dtype(x):
        p = b.op("Cast", p, to=b.dtype(x))
    zero = b.const(0, like=x)
    factor = b.mul(p, b.op("Pow", x, b.op("Sub", p, b.const(1, like=x))))
    return b.op("Where", b.op("Equal", p, zero), zero, factor)


# -- normalisations and pools -----------------------------------------------------------------
@tangent_rule("Softmax", "LogSoftmax")
def _softmax(ctx: TangentContext) -> list:
    ctx.only(0)
    if ctx.b.opset < 13:
        raise NoTangentRule(f"{ctx.node.op_type} node {ctx.node.name!r} below opset 13")
    t, y = ctx.exact(0), ctx.node.outputs[0]
    axis = [ctx.node.attr("axis", -1)]
    if ctx.node.op_type == "LogSoftmax":
        mean = ctx.b.reduce_sum(ctx.b.mul(ctx.b.op("Exp", y), t), axis)
        return [Tangent(ctx.b.op("Sub", t, mean))]
    weighted = ctx.b.mul(y, t)
    return [Tangent(ctx.b.op("Sub", weighted, ctx.b.mul(y, ctx.b.reduce_sum(weighted, axis))))]


@tangent_rule("Clip")
def _clip(ctx: TangentContext) -> list:
    """``t`` where ``min <= x <= max``, 0 elsewhere."""
    ctx.only(0)
    b, x = ctx.b, ctx.node.inputs[0]
    inside = None
    for index, comparison in ((1, "GreaterOrEqual"), (2, "LessOrEqual")):
        bound = ctx.node.input(index)
        if bound is not None:
            test = b.op(comparison, x, bound)
            inside = test if inside is None else b.op("And", inside, test)
    if inside is None:
        return [Tangent(ctx.loose(0), ctx.is_exact(0))]
    return _scaled(ctx, b.op("Cast", inside, to=b.dtype(x)))


@tangent_rule("Max", "Min")
def _max_min(ctx: TangentContext) -> list:
    r"""Of two inputs: ``(\dot a + \dot b) / 2 \pm sign(a - b) (\dot a - \dot b) / 2``
    (``+`` for Max), the tangent of the winner, their mean on ties (the central difference
    there)."""
    if len(ctx.node.inputs) != 2:
        count = len(ctx.node.inputs)
        raise NoTangentRule(f"{ctx.node.op_type} node {ctx.node.name!r} of {count} inputs")
    b, (x, z) = ctx.b, ctx.node.inputs
    half = b.const(0.5, like=ctx.like)
    ta, tb = ctx.loose(0), ctx.loose(1)
    total = ta if tb is None else (tb if ta is None else b.add(ta, tb))
    difference = tb if ta is None else (ta if tb is None else b.op("Sub", ta, tb))
    if ta is None:
        difference = b.neg(difference)
    side = b.mul(b.op("Sign", b.op("Sub", x, z)), difference)
    combined = b.op("Add" if ctx.node.op_type == "Max" else "Sub", total, side)
    return [Tangent(b.mul(combined, half))]


@tangent_rule("PRelu")
def _prelu(ctx: TangentContext) -> list:
    r"""``t`` where ``x > 0``, ``slope t + x \dot{slope}`` elsewhere."""
    b, (x, slope) = ctx.b, ctx.node.inputs
    positive = b.op("Greater", x, b.const(0, like=x))
    terms = []
    if ctx.active(0):
        factor = b.op("Where", positive, b.const(1, like=x), slope)
        terms.append(Tangent(b.mul(ctx.exact(0), factor)))
    if ctx.active(1):
        terms.append(Tangent(b.op("Where", positive, b.const(0, like=x), b.mul(x, ctx.loose(1)))))
    return [ctx.sum(terms)]


@tangent_rule("ReduceSumSquare")
def _reduce_sum_square(ctx: TangentContext) -> list:
    """``ReduceSum(2 x t)`` over the same axes."""
    ctx.only(0)
    x = ctx.node.inputs[0]
    twice = ctx.b.mul(ctx.b.mul(x, ctx.b.const(2, like=x)), ctx.exact(0))
    axes = ctx.node.attr("axes")
    if axes is not None:
        return [Tangent(ctx.b.reduce_sum(twice, axes, bool(ctx.node.attr("keepdims", 1))))]
    return [Tangent(ctx.copy([twice, *ctx.node.inputs[1:]], op_type="ReduceSum")[0])]


@tangent_rule("ReduceL2")
def _reduce_l2(ctx: TangentContext) -> list:
    """``ReduceSum(x t) / y`` over the same axes, 0 where ``y = 0`` (the reverse rule's
    subgradient)."""
    ctx.only(0)
    b, x, y = ctx.b, ctx.node.inputs[0], ctx.node.outputs[0]
    product = b.mul(x, ctx.exact(0))
    axes = ctx.node.attr("axes")
    if axes is not None:
        summed = b.reduce_sum(product, axes, bool(ctx.node.attr("keepdims", 1)))
    else:
        summed = ctx.copy([product, *ctx.node.inputs[1:]], op_type="ReduceSum")[0]
    zero = b.const(0, like=x)
    vanishes = b.op("Equal", y, zero)
    safe = b.op("Where", vanishes, b.const(1, like=x), y)
    return [Tangent(b.op("Where", vanishes, zero, b.op("Div", summed, safe)))]


@tangent_rule("ReduceMax", "ReduceMin")
def _reduce_extremum(ctx: TangentContext) -> list:
    r"""``\dot y = \sum m t / \sum m`` over the reduced axes, ``m = (x == y)``: the mean
    tangent of the tied extrema, the transpose of the reverse rule's equal share (and the
    central difference there, ``(\max(t) + \min(t)) / 2`` for two ties)."""
    ctx.only(0)
    share = extremum_share(ctx.b, ctx.node)
    if share is None:  # empty axes with noop_with_empty_axes=1: the identity
        return [Tangent(ctx.loose(0), ctx.is_exact(0))]
    weighted = ctx.b.mul(share, ctx.exact(0))
    axes = ctx.node.attr("axes")
    if axes is not None:
        keepdims = bool(ctx.node.attr("keepdims", 1))
        return [Tangent(ctx.b.reduce_sum(weighted, axes, keepdims))]
    return [Tangent(ctx.copy([weighted, *ctx.node.inputs[1:]], op_type="ReduceSum")[0])]


@tangent_rule("TopK")
def _top_k(ctx: TangentContext) -> list:
    """The tangent read at the chosen indices."""
    ctx.only(0)
    axis = ctx.node.attr("axis", -1)
    if axis < 0:
        axis += len(_axes_from(ctx, ctx.node.inputs[0], 0))
    values = ctx.b.op("GatherElements", ctx.exact(0), ctx.node.outputs[1], axis=axis)
    return [Tangent(values), None]


@tangent_rule("ScatterElements", "ScatterND")
def _scatter(ctx: TangentContext) -> list:
    """Linear in ``data`` and ``updates`` without a reduction or with ``reduction='add'``
    (``y = data + sum of the updates at each index``): the same scatter of the tangents."""
    ctx.only(0, 2)
    if ctx.node.attr("reduction", "none") not in ("none", "add"):
        raise NoTangentRule(f"{ctx.node.op_type} node {ctx.node.name!r} with a reduction")
    data, indices, updates = ctx.exact_or_zeros(0), ctx.node.inputs[1], ctx.exact_or_zeros(2)
    return [Tangent(ctx.copy([data, indices, updates])[0])]


@tangent_rule("LayerNormalization")
def _layer_norm(ctx: TangentContext) -> list:
    r"""With ``n = (x - \mu) r`` and ``r = 1 / \sigma`` over the normalised axes:
    ``\dot n = r (t - mean(t) - n \, mean(n t))``, ``\dot y = \dot n s + n \dot s + \dot b``."""
    if any(ctx.node.outputs[1:]):
        raise NoTangentRule(f"LayerNormalization node {ctx.node.name!r}: mean/inv_std used")
    b, x, scale = ctx.b, ctx.node.inputs[0], ctx.node.inputs[1]
    axis = ctx.node.attr("axis", -1)
    axes = list(range(axis, 0)) if axis < 0 else _axes_from(ctx, x, axis)
    # the moments computed, not read from a copy's optional outputs: onnxruntime fuses
    # Add + LayerNormalization into a SkipLayerNormalization that leaves those outputs unset
    mean, inv_std = moments(b, x, axes, ctx.node.attr("epsilon", 1e-5))
    normalised = b.mul(b.op("Sub", x, mean), inv_std)
    terms = []
    if ctx.active(0):
        t = ctx.exact(0)
        centred = b.op("Sub", t, b.reduce("ReduceMean", t, axes, keepdims=True))
        spread = b.mul(normalised, b.reduce("ReduceMean", b.mul(normalised, t), axes, True))
        moved = b.mul(b.op("Sub", centred, spread), inv_std)
        terms.append(Tangent(b.mul(moved, scale)))
    if ctx.active(1):
        terms.append(Tangent(b.mul(normalised, ctx.loose(1))))
    if ctx.active(2):
        terms.append(Tangent(ctx.loose(2), False))
    return [ctx.sum(terms), None, None]


def _axes_from(ctx: TangentContext, x: str, axis: int) -> list[int]:
    rank = ctx.b.rank(x)
    if rank is None:
        raise NoTangentRule(f"{ctx.node.op_type} node {ctx.node.name!r}: input of unknown rank")
    return list(range(axis, rank))


@_elementwise("Tan")
def _tan(ctx, x, y):
    return ctx.b.op("Add", ctx.b.const(1, like=x), ctx.b.mul(y, y))


@_elementwise("Atan")
def _atan(ctx, x, y):
    return ctx.b.op("Reciprocal", ctx.b.op("Add", ctx.b.const(1, like=x), ctx.b.mul(x, x)))


@_elementwise("Softsign")
def _softsign(ctx, x, y):
    root = ctx.b.op("Add", ctx.b.const(1, like=x), ctx.b.op("Abs", x))
    return ctx.b.op("Reciprocal", ctx.b.mul(root, root))


@_elementwise("Elu")
def _elu(ctx, x, y):
    """1 where ``x > 0``, ``y + alpha`` elsewhere."""
    b = ctx.b
    alpha = b.const(ctx.node.attr("alpha", 1.0), like=x)
    positive = b.op("Greater", x, b.const(0, like=x))
    return b.op("Where", positive, b.const(1, like=x), b.op("Add", y, alpha))


@_elementwise("Gelu")
def _gelu(ctx, x, y):
    r"""``\Phi(x) + x \varphi(x)`` (``approximate="none"``)."""
    b = ctx.b
    if ctx.node.attr("approximate", "none") != "none":
        raise NoTangentRule(f"Gelu node {ctx.node.name!r} with approximate='tanh'")
    cdf = b.mul(b.op("Add", b.op("Erf", b.mul(x, b.const(2**-0.5, like=x))), b.const(1, like=x)),
                b.const(0.5, like=x))  # fmt: skip
    density = b.op("Exp", b.mul(b.mul(x, x), b.const(-0.5, like=x)))
    return b.op("Add", cdf, b.mul(x, b.mul(density, b.const((2 * np.pi) ** -0.5, like=x))))


@tangent_rule("MaxPool")
def _max_pool(ctx: TangentContext) -> list:
    """``t`` read at each window's maximum: the flat indices the reverse rule routes its
    gradient to (:mod:`.rules.pool`), so both modes pick the same element on ties."""
    from onnxgrad.derivative.autodiff.rules.pool import (
        _argmax_indices,
        _flip,
        _unit_steps,
        _window_attrs,
    )

    ctx.only(0)
    b, node, x = ctx.b, ctx.node, ctx.node.inputs[0]
    kernel = list(node.attr("kernel_shape"))
    if node.attr("storage_order", 0) or (
        _unit_steps(node) and len(kernel) >= 3 and 1 not in kernel
    ):
        raise NoTangentRule(f"MaxPool node {node.name!r}: no flat indices of its maxima")
    if not _unit_steps(node):  # the pool's own Indices are right
        flat = b.op("Reshape", ctx.exact(0), b.ints([-1]))
        return [Tangent(b.op("Gather", flat, ctx.forward_output(1))), None]
    window = _window_attrs(b, node, x)
    flipped = window.get("auto_pad") == "SAME_LOWER"
    source, t = x, ctx.exact(0)
    if flipped:
        window["auto_pad"] = "SAME_UPPER"
        source, t = _flip(b, x, len(kernel)), _flip(b, t, len(kernel))
    indices = _argmax_indices(b, node, source, window)
    if 1 not in kernel:
        indices = b.squeeze(indices, [len(kernel) + 2])
    gathered = b.op("Gather", b.op("Reshape", t, b.ints([-1])), indices)
    return [Tangent(_flip(b, gathered, len(kernel)) if flipped else gathered), None]
