r"""Pooling: MaxPool, AveragePool, LpPool (pads, strides, dilations, ceil_mode,
count_include_pad, auto_pad), GlobalAveragePool, GlobalMaxPool and GlobalLpPool.

* MaxPool routes each output gradient to the input element its window selected: the flat
  ``Indices`` of a MaxPool (the node's own when it has them) address a zero tensor with
  ``x``'s size, filled by ``ScatterElements`` with ``reduction="add"`` (windows may share
  their maximum). Before opset 16, where ScatterElements cannot add, overlapping windows
  are split into classes of output positions (``o mod ceil(k d / s)`` along each axis) whose
  windows are disjoint, and the classes are accumulated one after the other. The onnx
  reference evaluator returns wrong ``Indices`` when every stride and dilation is 1: there
  the indices come from a pool whose windows are described with a harmless dilation, or,
  in 3-D and more without a unit-kernel axis, from one pool per axis
  (:func:`_separable_grad`), so the gradient is right on every runtime. Square windows
  that tile the input (kernel = strides, no pads) need no ``Indices``: ArgMax over each
  window's elements picks the same first maximum (:func:`_tiled_grad`).
* MaxUnpool: ``X_bar = y_bar.flat[I]``.
* AveragePool is linear: ``y[o] = sum_{p in window(o)} x~[p] / count(o)``, so ``x_bar`` is
  the transposed convolution of ``g / count`` by a kernel of ones, applied to every
  ``(n, c)`` plane, cropped to ``x``. ``count(o)`` counts the window positions inside the
  input (``count_include_pad=0``) or inside the padded input (``=1``); positions that
  ``ceil_mode`` adds beyond the padded input are never counted (as in the ONNX reference
  implementation and PyTorch; onnxruntime 1.19 counts them with ``count_include_pad=1``).
* GlobalAveragePool: ``x_bar = g / (H W ...)`` broadcast; GlobalMaxPool: ``g`` shared
  equally among the elements equal to the maximum; GlobalLpPool as LpPool over one window
  (no runtime computes it in float64: its table case checks it against a numpy oracle).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
from onnx import NodeProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import NameScope, np_dtype
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._lowering import Lowering
from onnxgrad.derivative.autodiff.rules._nn_helpers import (
    INT64_MAX,
    Vec,
    as_tensor,
    dims,
    extents,
    ints_attr,
    is_static,
    spatial_axes,
    static_dims,
    tensor_rank,
    vadd,
    vmul,
    vsub,
    window_pads,
)
from onnxgrad.derivative.autodiff.rules._shape_helpers import reshape_like, reshape_to
from onnxgrad.derivative.autodiff.rules.conv import Window, conv_input_grad

_WINDOW_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")


# -- MaxPool ----------------------------------------------------------------------------------
def _expose_indices(node: NodeProto, scope: NameScope) -> None:
    """The forward MaxPool also returns its ``Indices``, so the gradient does not pool again
    (not when every stride and dilation is 1: see :func:`_with_a_step`; nor for square
    windows that may tile the input: see :func:`_tiled_grad`)."""
    view = NodeView(node, opset=0)
    if len(node.output) > 1 or view.attr("storage_order", 0) != 0:
        return
    if not _unit_steps(view) and _square_tiles(view) is None:
        node.output.append(scope.unique(f"{node.output[0]}_indices"))


def _unit_steps(node: NodeView) -> bool:
    k = len(node.attr("kernel_shape"))
    steps = list(ints_attr(node, "strides", 1, k)) + list(ints_attr(node, "dilations", 1, k))
    return all(s == 1 for s in steps)


@register("MaxPool", since=11, forward=_expose_indices)
def max_pool_grad(b, node, grads, needs):
    g = grads[0]
    if g is None:
        return [None]
    x = node.inputs[0]
    kernel = list(node.attr("kernel_shape"))
    window = _window_attrs(b, node, x)
    flipped = window.get("auto_pad") == "SAME_LOWER" and _unit_steps(node)
    source = x
    if flipped:
        window["auto_pad"] = "SAME_UPPER"
        source, g = _flip(b, x, len(kernel)), _flip(b, g, len(kernel))
    own_indices = len(node.outputs) > 1 and node.outputs[1]
    block = None if own_indices else _tile_size(b, node, x)
    if block is not None:
        grad = _tiled_grad(b, g, x, block)
    elif len(kernel) >= 3 and 1 not in kernel and _unit_steps(node) and b.opset >= 16:
        grad = _separable_grad(b, node, g, source, window)
    else:
        indices = _argmax_indices(b, node, source, window)
        grad = reshape_like(b, _route_to_maxima(b, node, g, indices, source), x)
    return [_flip(b, grad, len(kernel)) if flipped else grad]


def _square_tiles(node: NodeView) -> int | None:
    """``k`` for a 2-D MaxPool whose ``k x k`` windows are disjoint and gapless (kernel =
    strides, no dilation, no pads), judged from the attributes alone."""
    kernel = list(node.attr("kernel_shape", ()))
    if len(kernel) != 2 or kernel[0] != kernel[1] or kernel[0] < 2:
        return None
    steps = list(ints_attr(node, "strides", 1, 2))
    unpadded = not any(node.attr("pads", ())) and node.attr("auto_pad", "NOTSET") in (
        "NOTSET", "", "VALID",
    )  # fmt: skip
    if steps != kernel or list(ints_attr(node, "dilations", 1, 2)) != [1, 1] or not unpadded:
        return None
    return kernel[0]


def _tile_size(b: GradBuilder, node: NodeView, x: str) -> int | None:
    """``k`` when :func:`_square_tiles` holds and the windows cover ``x`` exactly (static
    channels and spatial sizes, multiples of ``k``), so :func:`_tiled_grad` applies."""
    k = _square_tiles(node)
    sizes = static_dims(b, x, start=1)
    if k is None or sizes is None or len(sizes) != 3 or any(n % k for n in sizes[1:]):
        return None
    return k


def _tiled_grad(b: GradBuilder, g: str, x: str, k: int) -> str:
    """Disjoint ``k x k`` windows tiling ``x`` (``N, C, H, W``): SpaceToDepth makes each
    window's ``k^2`` elements a leading axis, ``(N, k^2, C H W / k^2)``; ArgMax along it
    picks the first maximum in row-major window order (the element MaxPool's ``Indices``
    name), and ``g`` goes there by a one-hot product before DepthToSpace puts the windows
    back. onnxruntime's MaxPool computes ``Indices`` far slower than the pool itself
    (64x8x24x24: 1.05 ms against 0.08 ms), so the forward pool keeps one output."""
    channels, height, width = static_dims(b, x, start=1)
    area = k * k
    pixels = channels * height * width // area  # not -1: Reshape cannot infer it at N = 0
    windows = b.op("Reshape", b.op("SpaceToDepth", x, blocksize=k), b.ints([0, area, pixels]))
    first = b.op("ArgMax", windows, axis=1, keepdims=1)
    offsets = b.const(np.arange(area).reshape(1, area, 1), dtype=np.int64)
    one_hot = b.op("Cast", b.op("Equal", first, offsets), to=b.dtype(x))
    routed = b.mul(one_hot, b.op("Reshape", g, b.ints([0, 1, pixels])))
    planes = b.op("Reshape", routed, b.ints([0, area * channels, height // k, width // k]))
    return b.op("DepthToSpace", planes, blocksize=k, mode="DCR")


def _flip(b: GradBuilder, t: str, k: int) -> str:
    """``t`` with its ``k`` spatial axes reversed. With unit strides a SAME_LOWER pool of
    ``x`` is the reversed SAME_UPPER pool of reversed ``x`` (the pad that SAME_LOWER puts
    first comes last): the rule uses this where the sizes are dynamic, since the onnx
    reference evaluator pads SAME_LOWER as SAME_UPPER once a dilation is set."""
    flipped = b.op(
        "Slice", t, b.ints([-1] * k), b.ints([np.iinfo(np.int64).min] * k),
        b.ints(list(range(2, 2 + k))), b.ints([-1] * k),
    )  # fmt: skip
    with contextlib.suppress(KeyError):
        b.declare(flipped, b.value_type(t))
    return flipped


def _separable_grad(b: GradBuilder, node: NodeView, g: str, x: str, window: dict) -> str:
    """3-D and more with unit strides and dilations, where the onnx reference evaluator's
    ``Indices`` are wrong and no axis has a kernel of 1 to carry a harmless dilation: the max
    over a box is the max along each axis in turn, so the pool runs again as one 1-axis pool
    per axis (each with a unit-kernel axis dilated, see :func:`_with_a_step`) and ``g``
    goes back through their Indices. Ties may be routed to another maximum than the
    single pool's, an equally valid subgradient."""
    kernel = list(node.attr("kernel_shape"))
    k = len(kernel)
    pads = window.get("pads", [0] * (2 * k))
    shared = {name: window[name] for name in ("auto_pad", "ceil_mode") if name in window}
    stages, t = [], x
    for axis in range(k):
        axis_kernel = [1] * k
        axis_kernel[axis] = kernel[axis]
        axis_pads = [0] * (2 * k)
        axis_pads[axis], axis_pads[k + axis] = pads[axis], pads[k + axis]
        dilations = [1] * k
        dilations[(axis + 1) % k] = 2
        attrs = {**shared, "kernel_shape": axis_kernel, "dilations": dilations}
        if "auto_pad" not in shared or shared["auto_pad"] in ("NOTSET", ""):
            attrs["pads"] = axis_pads
        pooled, indices = b.op("MaxPool", t, outputs=2, **attrs)
        stages.append((t, indices))
        t = pooled
    for source, indices in reversed(stages):
        zeros = b.op("ConstantOfShape", _size(b, source), value=_scalar(b, 0, x))
        flat = b.op(
            "ScatterElements", zeros, b.op("Reshape", indices, b.ints([-1])),
            b.op("Reshape", g, b.ints([-1])), axis=0, reduction="add",
        )  # fmt: skip
        if source == x:
            g = reshape_like(b, flat, x)
        else:
            g = reshape_to(b, flat, b.shape_of(source), source)
    return g


def _argmax_indices(b: GradBuilder, node: NodeView, x: str, attrs: dict) -> str:
    """Flat row-major indices in ``x`` of each window's maximum (windows: ``attrs``)."""
    kernel = list(node.attr("kernel_shape"))
    unit_steps = _unit_steps(node)
    own = len(node.outputs) > 1 and node.outputs[1] and node.attr("storage_order", 0) == 0
    if own and not unit_steps:
        return node.outputs[1]
    if unit_steps:
        x, attrs = _with_a_step(b, x, attrs, kernel)
    return b.op("MaxPool", x, outputs=2, **attrs)[1]


def _window_attrs(b: GradBuilder, node: NodeView, x: str) -> dict:
    """The node's window attributes, ``auto_pad`` replaced by the explicit ``pads`` it
    stands for where the spatial sizes of ``x`` are static: the pools the rule adds change
    the kernel (a unit axis, per-axis stages), and the onnx reference evaluator pads
    SAME_LOWER wrongly once a dilation is set."""
    attrs = {name: node.attr(name) for name in _WINDOW_ATTRS if node.has_attr(name)}
    if attrs.get("auto_pad", "NOTSET") in ("NOTSET", ""):
        return attrs
    sizes = static_dims(b, x)
    if sizes is None:
        return attrs
    kernel = tuple(node.attr("kernel_shape"))
    k = len(kernel)
    strides = ints_attr(node, "strides", 1, k)
    ext = extents(b, kernel, ints_attr(node, "dilations", 1, k))
    begin, end = window_pads(b, node, k, sizes, ext, strides)
    attrs.pop("auto_pad")
    attrs["pads"] = [*begin, *end]
    return attrs


def _with_a_step(b: GradBuilder, x: str, attrs: dict, kernel: list[int]) -> tuple[str, dict]:
    """The same windows, described with a dilation of 2 along an axis of kernel size 1 (a
    trailing unit axis is added if none has size 1): the onnx reference evaluator returns
    wrong ``Indices`` when every stride and dilation is 1. The indices are unchanged."""
    k = len(kernel)
    dilations = [1] * k
    if 1 in kernel:
        dilations[kernel.index(1)] = 2
        return x, {**attrs, "dilations": dilations}
    if k >= 3:
        return x, attrs
    widened = {
        **attrs,
        "kernel_shape": [*kernel, 1],
        "strides": [1] * (k + 1),
        "dilations": [*dilations, 2],
    }
    if attrs.get("auto_pad", "NOTSET") in ("NOTSET", ""):  # pads and auto_pad exclude each other
        pads = list(attrs.get("pads", [0] * 2 * k))
        widened["pads"] = [*pads[:k], 0, *pads[k:], 0]
    return b.unsqueeze(x, [k + 2]), widened


def _route_to_maxima(b: GradBuilder, node: NodeView, g: str, indices: str, x: str) -> str:
    """``zeros(size(x))`` plus ``g`` added at ``indices``, flat."""
    zeros = b.op("ConstantOfShape", _size(b, x), value=_scalar(b, 0, x))
    flat_g = b.op("Reshape", g, b.ints([-1]))
    flat_indices = b.op("Reshape", indices, b.ints([-1]))
    if b.opset >= 16:
        return b.op("ScatterElements", zeros, flat_indices, flat_g, axis=0, reduction="add")
    periods = _overlap_periods(node)
    if all(p == 1 for p in periods):
        return b.op("ScatterElements", zeros, flat_indices, flat_g, axis=0)
    return _scatter_by_classes(b, node, g, indices, zeros, periods)


def _overlap_periods(node: NodeView) -> list[int]:
    """Per axis, a period ``m`` such that windows ``m`` steps apart never overlap (1 where no
    two windows do: ``lcm(s, d) >= k d``)."""
    kernel = list(node.attr("kernel_shape"))
    k = len(kernel)
    strides = ints_attr(node, "strides", 1, k)
    dilations = ints_attr(node, "dilations", 1, k)
    return [
        1 if math.lcm(s, d) >= n * d else -(-(n * d) // s)
        for n, s, d in zip(kernel, strides, dilations)
    ]


def _scatter_by_classes(
    b: GradBuilder, node: NodeView, g: str, indices: str, zeros: str, periods: list[int]
) -> str:
    """Opsets 13-15, where ``ScatterElements`` cannot add: output positions are split by
    ``o mod period`` along each axis; within a class no two windows share an element, so
    each class adds its gradients with a Gather, an Add and a ScatterElements."""
    k = len(periods)
    out_sizes = static_dims(b, node.outputs[0])
    axes, steps, ends = b.ints(spatial_axes(k)), b.ints(periods), b.ints([INT64_MAX] * k)
    total = None
    for residue in itertools.product(*(range(p) for p in periods)):
        if out_sizes is not None and any(r >= n for r, n in zip(residue, out_sizes)):
            continue
        starts = b.ints(list(residue))
        values = b.op("Reshape", b.op("Slice", g, starts, ends, axes, steps), b.ints([-1]))
        where = b.op("Reshape", b.op("Slice", indices, starts, ends, axes, steps), b.ints([-1]))
        if total is None:
            total = b.op("ScatterElements", zeros, where, values, axis=0)
            continue
        added = b.add(b.op("Gather", total, where, axis=0), values)
        total = b.op("ScatterElements", total, where, added, axis=0)
    return total


def _size(b: GradBuilder, x: str) -> str:
    shape = b.static_shape(x)
    if shape is not None:
        return b.ints([int(np.prod(shape))])
    return b.op("Reshape", b.op("Size", x), b.ints([1]))


def _shape(b: GradBuilder, x: str) -> str:
    shape = b.static_shape(x)
    return b.ints(list(shape)) if shape is not None else b.shape_of(x)


def _scalar(b: GradBuilder, value: float, like: str) -> TensorProto:
    return numpy_helper.from_array(np.array([value], dtype=np_dtype(b.dtype(like))))


# -- AveragePool ------------------------------------------------------------------------------
@register("AveragePool", since=11)
def average_pool_grad(b, node, grads, needs):
    (g,) = grads
    return [_spread_over_windows(b, node, g, divide_by_counts=True)]


def _spread_over_windows(b: GradBuilder, node: NodeView, g: str, divide_by_counts: bool) -> str:
    """The adjoint of the window sums of a pool: each output gradient added to every input
    position of its window (divided by the window's count for AveragePool)."""
    x, y = node.inputs[0], node.outputs[0]
    kernel = tuple(node.attr("kernel_shape"))
    k = len(kernel)
    strides = ints_attr(node, "strides", 1, k)
    dilations = ints_attr(node, "dilations", 1, k)
    x_sizes, y_sizes = dims(b, x), dims(b, y)
    begin, end = window_pads(b, node, k, x_sizes, extents(b, kernel, dilations), strides)
    win = Window(k, strides, dilations, 1, kernel, begin, end)
    if divide_by_counts:
        g = _divide_by_counts(b, node, g, win, x_sizes, y_sizes)
    planes = b.op("Reshape", g, _plane_shape(b, y_sizes))
    ones = b.const(np.ones((1, 1, *kernel)), like=x)
    spread = conv_input_grad(b, planes, ones, win, x_sizes, y_sizes)
    return reshape_like(b, spread, x)


# -- LpPool ---------------------------------------------------------------------------
@register("LpPool", since=11)
def lp_pool_grad(b, node, grads, needs):
    """``y = (sum_window |x|^p)^(1/p)``: ``x_bar = W^T(g y^(1-p)) |x|^(p-1) sign(x)``, ``W^T``
    the adjoint of the window sums; an all-zero window (``y = 0``) takes the subgradient 0."""
    (g,) = grads
    x, y = node.inputs[0], node.outputs[0]
    p = float(node.attr("p", 2))
    scale = _inverse_norm_power(b, y, p)
    spread = _spread_over_windows(b, node, b.mul(g, scale), False)
    return [b.mul(spread, _signed_power(b, x, p - 1))]


def _inverse_norm_power(b: GradBuilder, y: str, p: float) -> str:
    """``y^(1-p)``, and 0 where ``y = 0`` (``p > 1``): ``y`` is replaced by 1 there before the
    power, so the unselected branch stays finite and so does the derivative of this graph
    (a ``Where`` after ``0^(1-p) = inf`` alone would differentiate to ``inf * 0``)."""
    if p <= 1:
        return _power(b, y, 1 - p)
    zero = b.op("Equal", y, b.const(0, like=y))
    safe = b.op("Where", zero, b.const(1, like=y), y)
    b.declare(safe, b.value_type(y))
    return b.op("Where", zero, b.const(0, like=y), _power(b, safe, 1 - p))


def _power(b: GradBuilder, t: str, exponent: float) -> str:
    if exponent == 0:
        return b.const(1, like=t)
    if exponent == -1:
        return b.op("Reciprocal", t)
    return b.op("Pow", t, b.const(exponent, like=t))


def _signed_power(b: GradBuilder, x: str, exponent: float) -> str:
    """``|x|^e sign(x)``: ``x`` itself for ``e = 1``."""
    if exponent == 1:
        return x
    if exponent == 0:
        return b.op("Sign", x)
    return b.mul(b.op("Pow", b.op("Abs", x), b.const(exponent, like=x)), b.op("Sign", x))


def _plane_shape(b: GradBuilder, sizes: Vec) -> str:
    if is_static(sizes):
        return b.ints([-1, 1, *sizes])
    return b.op("Concat", b.ints([-1, 1]), sizes, axis=0)


def _divide_by_counts(
    b: GradBuilder, node: NodeView, g: str, win: Window, x_sizes: Vec, y_sizes: Vec
) -> str:
    include_pad = bool(node.attr("count_include_pad", 0))
    if is_static(x_sizes, y_sizes, win.begin, win.end):
        counts = _static_counts(win, x_sizes, y_sizes, include_pad)
        if np.all(counts == counts.flat[0]):
            return b.mul(g, b.const(1.0 / counts.flat[0], like=g))
        return b.mul(g, b.const(1.0 / counts, like=g))
    return b.op("Div", g, _dynamic_counts(b, win, x_sizes, y_sizes, include_pad, g))


def _axis_bounds(win: Window, x_sizes, include_pad: bool, i: int):
    """Where window positions count along axis ``i``: ``[lo, hi)``."""
    if include_pad:
        return -win.begin[i], x_sizes[i] + win.end[i]
    return 0, x_sizes[i]


def _static_counts(win: Window, x_sizes, y_sizes, include_pad: bool) -> np.ndarray:
    counts = np.ones((), dtype=np.int64)
    for i in range(win.k):
        starts = np.arange(y_sizes[i]) * win.strides[i] - win.begin[i]
        positions = starts[:, None] + np.arange(win.kernel[i]) * win.dilations[i]
        lo, hi = _axis_bounds(win, x_sizes, include_pad, i)
        inside = ((positions >= lo) & (positions < hi)).sum(axis=1)
        counts = np.multiply.outer(counts, inside)
    return counts.astype(np.float64)


def _dynamic_counts(b, win: Window, x_sizes: Vec, y_sizes: Vec, include_pad: bool, g) -> str:
    """``count(o)`` as a tensor of shape ``y_sizes``, from run-time sizes."""
    k = win.k
    total = None
    for i in range(k):
        n_out = _component(b, y_sizes, i)
        starts = b.op(
            "Sub", b.mul(b.op("Range", b.ints(0), n_out, b.ints(1)), b.ints(win.strides[i])),
            _component(b, win.begin, i),
        )  # fmt: skip
        offsets = b.ints(list(np.arange(win.kernel[i]) * win.dilations[i]))
        positions = b.add(b.unsqueeze(starts, [1]), offsets)
        if include_pad:
            lo = b.neg(_component(b, win.begin, i))
            hi = b.add(_component(b, x_sizes, i), _component(b, win.end, i))
        else:
            lo, hi = b.ints(0), _component(b, x_sizes, i)
        below = b.op("Less", positions, lo)
        inside = b.op("And", b.op("Not", below), b.op("Less", positions, hi))
        counts = b.reduce_sum(b.op("Cast", inside, to=b.dtype(g)), [1], keepdims=False)
        shaped = b.op("Reshape", counts, b.ints([1] * i + [-1] + [1] * (k - 1 - i)))
        total = shaped if total is None else b.mul(total, shaped)
    return total


def _component(b: GradBuilder, v: Vec, i: int) -> str:
    """Entry ``i`` of a per-axis vector, as a 0-D int64 tensor."""
    if isinstance(v, tuple):
        return b.ints(v[i])
    return b.op("Gather", v, b.ints(i), axis=0)


# -- global pools -----------------------------------------------------------------------------
@register("GlobalAveragePool", since=11)
def global_average_pool_grad(b, node, grads, needs):
    (g,) = grads
    x = node.inputs[0]
    sizes = dims(b, x)
    if is_static(sizes):
        scaled = b.mul(g, b.const(1.0 / max(int(np.prod(sizes)), 1), like=x))
    else:
        count = b.op("Div", b.op("Size", x), b.op("Size", g))
        scaled = b.op("Div", g, b.op("Cast", count, to=b.dtype(x)))
    return [b.op("Expand", scaled, _shape(b, x))]


@register("GlobalMaxPool", since=11)
def global_max_pool_grad(b, node, grads, needs):
    (g,) = grads
    x = node.inputs[0]
    rank = tensor_rank(b, node, x)
    mask = b.op("Cast", b.op("Equal", x, node.outputs[0]), to=b.dtype(x))
    ties = b.reduce_sum(mask, spatial_axes(rank - 2), keepdims=True)
    return [b.mul(mask, b.op("Div", g, ties))]


@register("GlobalLpPool", since=11)
def global_lp_pool_grad(b, node, grads, needs):
    """``y = (sum_spatial |x|^p)^(1/p)``: ``x_bar = g y^(1-p) |x|^(p-1) sign(x)``, ``g`` and
    ``y`` broadcast over the spatial axes; an all-zero plane (``y = 0``) takes the
    subgradient 0 (``p > 1``)."""
    (g,) = grads
    x, y = node.inputs[0], node.outputs[0]
    p = float(node.attr("p", 2))
    scale = _inverse_norm_power(b, y, p)
    return [b.mul(b.mul(g, scale), _signed_power(b, x, p - 1))]


# -- MaxUnpool --------------------------------------------------------------------------------
@register("MaxUnpool", since=11)
def max_unpool_grad(b, node, grads, needs):
    """``y.flat[I] = X`` into zeros: ``X_bar = y_bar.flat[I]`` (indices from MaxPool are
    distinct; were one repeated, every copy would read the gradient of the value kept).
    With ``output_shape``, ``I`` addresses the inferred shape, ``(in - 1) s - pads + k``,
    padded at the end to ``output_shape`` (as onnx's test data and reference evaluator
    read it): ``y_bar`` is cropped to the inferred shape first."""
    (g,) = grads
    x, indices = node.inputs[0], node.inputs[1]
    if node.input(2) is not None:
        kernel = tuple(node.attr("kernel_shape"))
        k = len(kernel)
        strides = ints_attr(node, "strides", 1, k)
        pads = ints_attr(node, "pads", 0, 2 * k)
        total_pads = tuple(p + q for p, q in zip(pads[:k], pads[k:]))
        inferred = vadd(b, vsub(b, vmul(b, vsub(b, dims(b, x), 1), strides), total_pads), kernel)
        g = b.op("Reshape", g, b.op("Cast", node.input(2), to=TensorProto.INT64))
        g = b.op("Slice", g, b.ints([0] * k), as_tensor(b, inferred), b.ints(spatial_axes(k)))
    flat = b.op("Reshape", g, b.ints([-1]))
    picked = b.op("Gather", flat, b.op("Reshape", indices, b.ints([-1])), axis=0)
    return [reshape_like(b, picked, x), None, None]


# -- RoiAlign ---------------------------------------------------------------------------------
@register("RoiAlign", since=11)
def roi_align_grad(b, node, grads, needs):
    r"""RoiAlign lowered to standard operators (:mod:`._lowering`), following the onnx
    reference (and onnxruntime) exactly: bin ``(i, j)`` of roi ``r`` averages (``mode=avg``)
    or maxes (``max``: the largest weighted corner ``w_c x_c`` of each point) the bilinear
    samples of ``x[batch_indices[r]]`` at the ``s x s`` points (``s = sampling_ratio``)

    .. math:: y_q = a_r + b_r\,(i + (q + 1/2) / s),\qquad
              a_r = \mathrm{roi}_{r,1}\,\mathrm{scale} - o,\;
              b_r = (\mathrm{roi}_{r,3} - \mathrm{roi}_{r,1})\,\mathrm{scale} / H_{out}

    (``o = 1/2`` for half_pixel, 0 for output_half_pixel, where ``b_r`` is at least
    ``1 / H_out``), likewise along the width; a point beyond ``[-1, H]`` samples 0, one in
    ``[-1, 0]`` samples row 0, one past ``H - 1`` row ``H - 1``. The derivative (``x``, and
    the rois through the sampling positions) is the engine's. ``sampling_ratio = 0`` (as many
    points as the roi is large, a number known at run time only) is refused."""
    x, rois, batch_indices = node.inputs
    where = f"RoiAlign node {node.name or node.outputs[0]!r}"
    ratio = node.attr("sampling_ratio", 0)
    if ratio <= 0:
        raise NotImplementedError(
            f"{where}: no gradient with sampling_ratio={ratio} (the number of sampling points "
            f"depends on the roi sizes at run time)"
        )
    shape = b.static_shape(x)
    if shape is None or len(shape) != 4:
        raise NotImplementedError(f"{where}: the gradient needs the static 4-D shape of {x!r}")
    _, c, height, width = shape
    out_h, out_w = node.attr("output_height", 1), node.attr("output_width", 1)
    default_mode = "half_pixel" if node.opset >= 16 else "output_half_pixel"
    half_pixel = node.attr("coordinate_transformation_mode", default_mode) == "half_pixel"
    mode = node.attr("mode", "avg")

    low = Lowering(b, node)
    corners = low.op(
        "Sub",
        low.op("Mul", rois, low.const(float(node.attr("spatial_scale", 1.0)))),
        low.const(0.5 if half_pixel else 0.0),
    )
    start_x, start_y, end_x, end_y = (
        low.op("Gather", corners, low.ints([k]), axis=1) for k in range(4)
    )  # each (R, 1)
    axes = []
    for start, end, size, bins in ((start_y, end_y, height, out_h), (start_x, end_x, width, out_w)):
        extent = low.op("Sub", end, start)
        if not half_pixel:
            extent = low.op("Max", extent, low.const(1.0))
        fractions = [i + (q + 0.5) / ratio for i in range(bins) for q in range(ratio)]
        step = low.op("Div", extent, low.const(float(bins)))
        points = low.op("Add", start, low.op("Mul", step, low.const(fractions)))  # (R, S)
        axes.append(_roi_axis(low, points, size))
    (low_y, high_y, ly, hy, in_y), (low_x, high_x, lx, hx, in_x) = axes
    samples = ratio * ratio * out_h * out_w
    pixels = low.op("Reshape", x, low.ints([-1]))
    area = height * width
    planes = low.op(
        "Add",
        low.op("Mul", low.op("Reshape", batch_indices, low.ints([-1, 1, 1])), low.ints(c * area)),
        low.ints(np.arange(c).reshape(1, c, 1) * area),
    )  # (R, C, 1): where the image of each roi and channel starts in the flat input
    inside = low.to_float(low.op("And", _column(low, in_y), _row(low, in_x)))
    terms = []
    for rows, cols, wy, wx in ((low_y, low_x, hy, hx), (low_y, high_x, hy, lx),
                               (high_y, low_x, ly, hx), (high_y, high_x, ly, lx)):  # fmt: skip
        flat = low.op(
            "Add", _column(low, low.op("Mul", rows, low.const(float(width)))), _row(low, cols)
        )
        index = low.to_index(low.op("Reshape", flat, low.ints([-1, 1, samples])))
        values = low.op("Gather", pixels, low.op("Add", planes, index), axis=0)
        weight = low.op("Mul", low.op("Mul", _column(low, wy), _row(low, wx)), inside)
        terms.append(low.op("Mul", values, low.op("Reshape", weight, low.ints([-1, 1, samples]))))
    combine = "Sum" if mode == "avg" else "Max"
    pooled = low.op(
        "Reshape", low.op(combine, *terms), low.ints([-1, c, out_h, ratio, out_w, ratio])
    )
    reduce = "ReduceMean" if mode == "avg" else "ReduceMax"
    low.reduce(reduce, pooled, [3, 5], output=node.outputs[0])
    return low.gradients(grads, needs)


def _roi_axis(low: Lowering, points: str, size: int):
    """Per sampling coordinate along one axis: the lower and upper pixel rows, the weights
    ``l = t - floor(t)`` and ``1 - l`` of the clamped coordinate ``t``, and whether the
    point samples anything (``-1 <= t <= size``)."""
    outside = low.op(
        "Or",
        low.op("Less", points, low.const(-1.0)),
        low.op("Greater", points, low.const(float(size))),
    )
    clamped = low.op("Max", points, low.const(0.0))
    floor = low.op("Floor", clamped)
    last = low.const(float(size - 1))
    edge = low.op("Not", low.op("Less", floor, last))
    lower = low.op("Where", edge, last, floor)
    upper = low.op("Where", edge, last, low.op("Add", floor, low.const(1.0)))
    used = low.op("Where", edge, last, clamped)
    fraction = low.op("Sub", used, lower)
    return lower, upper, fraction, low.op("Sub", low.const(1.0), fraction), low.op("Not", outside)


def _column(low: Lowering, t: str) -> str:
    return (
        low.op("Unsqueeze", t, low.ints([2]))
        if low.opset >= 13
        else low.op("Unsqueeze", t, axes=[2])
    )


def _row(low: Lowering, t: str) -> str:
    return (
        low.op("Unsqueeze", t, low.ints([1]))
        if low.opset >= 13
        else low.op("Unsqueeze", t, axes=[1])
    )
