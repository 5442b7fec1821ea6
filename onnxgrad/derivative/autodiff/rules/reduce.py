"""Reductions ``y = reduce(x, axes)`` and CumSum.

Let ``g`` be ``y_bar`` with the reduced axes restored (size 1) when ``keepdims=0``, and ``y``
likewise; both broadcast against ``x``:

* ReduceSum: ``x_bar = expand(g)``; ReduceMean: ``x_bar = expand(g / n)``, ``n = |x| / |y|``
* ReduceSumSquare: ``2 x g``; ReduceL1: ``sign(x) g``; ReduceL2: ``x g / y`` (0 where
  ``y = 0``, the subgradient PyTorch picks); ReduceLogSumExp: ``g exp(x - y)``;
  ReduceLogSum: ``g exp(-y)``
* ReduceMax, ReduceMin: ``g m / sum(m)`` with ``m = (x == y)``: tied extrema share the
  gradient equally
* ReduceProd: ``g prod_{j != i} x_j``, from the product of the non-zero elements, so zeros
  are exact: with one zero only that element gets a gradient, with two or more none does
* CumSum: the cumulative sum of ``y_bar`` in the other direction, ``exclusive`` unchanged;
  CumProd: see :func:`cumprod_grad`

Axes come from the ``axes`` attribute (ReduceSum before opset 13, the others before 18) or
the ``axes`` input, possibly computed at run time: the restoring Unsqueeze and the helper
reductions reuse that input, so an empty one with ``noop_with_empty_axes=1`` works too
(as a reduction over no axes, like the ONNX reference evaluator).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from onnxgrad._onnx_utils import reduce_axes_are_input
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._shape_helpers import (
    cast_like,
    constant_ints,
    expand_like,
    index_grid,
    require_rank,
    reshape_like,
    to_int64,
)


@dataclass(frozen=True)
class _Axes:
    """What a reduction node reduces: ``values`` (a list, an int64 tensor name, or ``None``
    for every axis), or nothing at all (``noop``)."""

    values: list[int] | str | None
    noop: bool = False


def _reduced_axes(b, node) -> _Axes:
    if not reduce_axes_are_input(node.op_type, node.opset):
        return _Axes(node.attr("axes"))
    axes = node.input(1)
    if axes is None or b.shape(axes) == (0,):
        return _Axes(None, noop=bool(node.attr("noop_with_empty_axes", 0)))
    return _Axes(axes)


def _restore(b, node, axes: _Axes, t: str) -> str:
    """``t``, of the shape of the node's output, with the reduced axes back as size 1."""
    if node.attr("keepdims", 1) or axes.noop or axes.values is None:
        return t
    return b.unsqueeze(t, axes.values)


def _reduce_again(b, node, axes: _Axes, op_type: str, t: str) -> str:
    """``op_type`` over the node's axes, ``keepdims=1`` (``t`` has the shape of ``x``)."""
    if axes.noop:
        return t
    if isinstance(axes.values, str):
        noop = node.attr("noop_with_empty_axes", 0)
        return b.op(op_type, t, axes.values, keepdims=1, noop_with_empty_axes=noop)
    return b.reduce(op_type, t, axes.values, keepdims=True)


def _inputs(b, node, grads):
    axes = _reduced_axes(b, node)
    return node.inputs[0], axes, _restore(b, node, axes, grads[0])


@register("ReduceSum", since=11)
def reduce_sum_grad(b, node, grads, needs):
    x, axes, g = _inputs(b, node, grads)
    return [g if axes.noop else expand_like(b, g, x)]


@register("ReduceMean", since=11)
def reduce_mean_grad(b, node, grads, needs):
    x, axes, g = _inputs(b, node, grads)
    if axes.noop:
        return [g]
    y_shape = b.static_shape(node.outputs[0])
    count = _static_count(b, x, axes, y_shape)
    if count is not None:
        scaled = b.op("Mul", g, b.const(1.0 / max(count, 1), like=x))
    else:
        count = cast_like(b, b.op("Size", x), x)
        if y_shape is None:
            count = b.op("Div", count, cast_like(b, b.op("Size", node.outputs[0]), x))
        elif prod(y_shape) != 1:
            count = b.op("Div", count, b.const(float(prod(y_shape)), like=x))
        scaled = b.op("Div", g, count)
    return [expand_like(b, scaled, x)]


def _static_count(b, x: str, axes: _Axes, y_shape) -> int | None:
    """How many elements each output averages, when the shapes tell: the product of the
    reduced axes' sizes (the other axes may be dynamic)."""
    x_shape = b.shape(x)
    if x_shape is None:
        return None
    values = constant_ints(b, axes.values) if isinstance(axes.values, str) else axes.values
    if not values:
        static = b.static_shape(x)
        if static is None or y_shape is None:
            return None
        return prod(static) // max(prod(y_shape), 1)
    sizes = [x_shape[a] for a in {a + len(x_shape) if a < 0 else a for a in values}]
    return prod(sizes) if all(isinstance(d, int) for d in sizes) else None


@register("ReduceSumSquare", since=11)
def reduce_sum_square_grad(b, node, grads, needs):
    x, _, g = _inputs(b, node, grads)
    return [b.op("Mul", x, b.op("Mul", g, b.const(2.0, like=x)))]


@register("ReduceL1", since=11)
def reduce_l1_grad(b, node, grads, needs):
    x, _, g = _inputs(b, node, grads)
    return [b.op("Mul", b.op("Sign", x), g)]


@register("ReduceL2", since=11)
def reduce_l2_grad(b, node, grads, needs):
    x, axes, g = _inputs(b, node, grads)
    norm = _restore(b, node, axes, node.outputs[0])
    zero = b.const(0.0, like=x)
    vanishes = b.op("Equal", norm, zero)
    # divide by 1 where the norm is 0, not by 0 then mask: the derivative of this graph
    # stays finite there (a Where after g / 0 = inf differentiates to inf * 0)
    safe = b.op("Where", vanishes, b.const(1.0, like=x), norm)
    scale = b.op("Where", vanishes, zero, b.op("Div", g, safe))
    return [b.op("Mul", x, scale)]


@register("ReduceLogSumExp", since=11)
def reduce_log_sum_exp_grad(b, node, grads, needs):
    x, axes, g = _inputs(b, node, grads)
    y = _restore(b, node, axes, node.outputs[0])
    return [b.op("Mul", g, b.op("Exp", b.op("Sub", x, y)))]


@register("ReduceLogSum", since=11)
def reduce_log_sum_grad(b, node, grads, needs):
    x, axes, g = _inputs(b, node, grads)
    y = _restore(b, node, axes, node.outputs[0])
    return [expand_like(b, b.op("Div", g, b.op("Exp", y)), x)]


@register("ReduceMax", "ReduceMin", since=11)
def reduce_extremum_grad(b, node, grads, needs):
    _, axes, g = _inputs(b, node, grads)
    if axes.noop:
        return [g]
    hits, ties = _extremum_hits(b, node, axes)
    return [b.op("Mul", hits, b.op("Div", g, ties))]


def extremum_share(b, node) -> str | None:
    """``m / sum(m)`` of a ReduceMax/ReduceMin node, shaped like ``x`` (``m = (x == y)``, the
    sum over the reduced axes): the weight of each element in the extremum, tied extrema
    sharing equally as in the reverse rule; None for a node that reduces nothing."""
    axes = _reduced_axes(b, node)
    if axes.noop:
        return None
    hits, ties = _extremum_hits(b, node, axes)
    return b.op("Div", hits, ties)


def _extremum_hits(b, node, axes: _Axes) -> tuple[str, str]:
    """``m = (x == y)`` as ``x``'s type and its sum over the reduced axes (``keepdims=1``)."""
    x = node.inputs[0]
    y = _restore(b, node, axes, node.outputs[0])
    hits = cast_like(b, b.op("Equal", x, y), x)
    return hits, _reduce_again(b, node, axes, "ReduceSum", hits)


@register("ReduceProd", since=11)
def reduce_prod_grad(b, node, grads, needs):
    x, axes, g = _inputs(b, node, grads)
    if axes.noop:
        return [g]
    zero, one = b.const(0.0, like=x), b.const(1.0, like=x)
    is_zero = b.op("Equal", x, zero)
    nonzero = b.op("Where", is_zero, one, x)
    product = _reduce_again(b, node, axes, "ReduceProd", nonzero)
    zeros = _reduce_again(b, node, axes, "ReduceSum", cast_like(b, is_zero, x))
    no_zero = cast_like(b, b.op("Equal", zeros, zero), x)
    one_zero = cast_like(b, b.op("Equal", zeros, one), x)
    others = b.op(
        "Where",
        is_zero,
        b.op("Mul", product, one_zero),
        b.op("Mul", b.op("Div", product, nonzero), no_zero),
    )
    return [b.op("Mul", others, g)]


@register("CumSum", since=11)
def cumsum_grad(b, node, grads, needs):
    reverse = 1 - node.attr("reverse", 0)
    exclusive = node.attr("exclusive", 0)
    return [b.op("CumSum", grads[0], node.inputs[1], exclusive=exclusive, reverse=reverse)]


@register("CumProd", since=26)
def cumprod_grad(b, node, grads, needs):
    """``x_bar_e = sum_i g_i dy_i/dx_e`` over the line of ``e`` along the axis, with
    ``dy_i/dx_e`` the cumulative product with ``x_e`` replaced by 1 where ``y_i``'s product
    holds ``x_e``, 0 elsewhere. For every position ``t`` along the axis (``n`` of them) one
    stacked copy of ``x`` has its elements at position ``t`` set to 1, and one CumProd runs
    over the stack: exact where ``x`` has zeros (``y / x`` would not be), at ``n`` times the
    memory. The axis may be computed at run time."""
    (g,) = grads
    x, axis = node.inputs
    rank = require_rank(b, x, node)
    axis = b.op("Mod", b.op("Reshape", to_int64(b, axis), b.ints([])), b.ints(rank))
    shape = b.shape_of(x)
    length = b.op("Gather", shape, axis, axis=0)
    after = b.op("Slice", shape, b.unsqueeze(b.add(axis, b.ints(1)), [0]), b.ints([rank]))
    stride = b.op("ReduceProd", after, keepdims=0)
    coords = b.op("Mod", b.op("Div", index_grid(b, x), stride), length)
    steps = b.op("Reshape", b.op("Range", b.ints(0), length, b.ints(1)), b.ints([-1] + [1] * rank))
    coords = b.unsqueeze(coords, [0])
    stacked = b.op("Where", b.op("Equal", coords, steps), b.const(1, like=x), b.unsqueeze(x, [0]))
    exclusive, reverse = node.attr("exclusive", 0), node.attr("reverse", 0)
    stack_axis = b.add(axis, b.ints(1))
    partial = b.op("CumProd", stacked, stack_axis, exclusive=exclusive, reverse=reverse)
    compare = {(0, 0): "GreaterOrEqual", (1, 0): "Greater", (0, 1): "LessOrEqual"}
    holds = b.op(compare.get((exclusive, reverse), "Less"), coords, steps)
    weighted = b.mul(b.mul(partial, cast_like(b, holds, x)), b.unsqueeze(g, [0]))
    summed = b.op("ReduceSum", weighted, b.unsqueeze(stack_axis, [0]), keepdims=1)
    own = cast_like(b, b.op("Equal", coords, steps), x)
    return [reshape_like(b, b.reduce_sum(b.mul(summed, own), [0], keepdims=False), x), None]
