"""Ops that select or scatter elements by index.

* Slice: ``x_bar`` is ``y_bar`` scattered into zeros where the slice read. With unit
  steps (``steps`` omitted, or known to be ones) it is a Pad of ``y_bar`` (bounds clamped
  as Slice clamps them, constant pads when everything is known); otherwise the positions
  are found by slicing an index grid the same way, so any steps and clamped bounds follow
  the runtime's own Slice.
* Gather, GatherElements, GatherND: ``data_bar`` is the scatter-*add* of ``y_bar`` (indices
  may repeat): ScatterND / ScatterElements with ``reduction='add'`` from opset 16; below,
  a sorted segment sum (:mod:`._segment_sum`: TopK, CumSum, ScatterElements on distinct
  indices), in memory linear in the positions and elements.
* ScatterElements / ScatterND, ``y = scatter(data, idx, u)``: ``reduction='none'``:
  ``data_bar = scatter(y_bar, idx, 0)``, ``u_bar = gather(y_bar, idx)``; ``'add'``:
  ``data_bar = y_bar``; ``'mul'``: ``data_bar = scatter_mul(y_bar, idx, u)``,
  ``u_bar = gather(y_bar y, idx) / u`` (undefined where ``u = 0``). Repeated indices with
  ``reduction='none'`` are undefined in ONNX and so are their gradients.
  ``'max'``/``'min'``: ``y_bar`` shared among the candidates equal to ``y``.
* Trilu: the same triangle of ``y_bar``.
* TopK, Compress, ReverseSequence, TensorScatter: see their rules.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper

from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._segment_sum import scatter_rows_add
from onnxgrad.derivative.autodiff.rules._shape_helpers import (
    Part,
    arange,
    as_tensor,
    cast_like,
    constant_ints,
    filled,
    index_grid,
    is_static,
    normalize_axis,
    numel,
    require_rank,
    reshape,
    reshape_like,
    reshape_to,
    scalar,
    scatter_flat,
    shape_parts,
    shape_tensor,
    to_int64,
    unsupported,
    zeros_like,
)

# -- Slice ----------------------------------------------------------------------------------


@register("Slice", since=11)
def slice_grad(b, node, grads, needs):
    (g,) = grads
    x = node.inputs[0]
    if _has_unit_steps(b, node):
        static_pads = _static_slice_pads(b, node)
        if static_pads is not None:
            return [b.op("Pad", g, b.ints(static_pads))]
        return [_slice_grad_by_pad(b, node, g)]
    sources = b.op("Slice", index_grid(b, x), *node.inputs[1:])
    return [scatter_flat(b, x, sources, g)]


def _has_unit_steps(b, node) -> bool:
    steps = node.input(4)
    if steps is None:
        return True
    values = constant_ints(b, steps)
    return values is not None and all(v == 1 for v in values)


def _static_slice_pads(b, node) -> list[int] | None:
    """The pads of the unit-step gradient when the rank, every bound and the size of every
    sliced axis are known (the other axes may be dynamic: their pads are 0)."""
    rank = b.rank(node.inputs[0])
    shape = b.shape(node.inputs[0])
    starts, ends = constant_ints(b, node.inputs[1]), constant_ints(b, node.inputs[2])
    axes = constant_ints(b, node.input(3)) if node.input(3) else list(range(len(starts or [])))
    if rank is None or starts is None or ends is None or axes is None:
        return None
    pads = [0] * (2 * rank)
    for axis, start, end in zip(axes, starts, ends):
        axis = normalize_axis(axis, rank)
        size = shape[axis]
        if not isinstance(size, int):
            return None
        start = min(max(start + size if start < 0 else start, 0), size)
        end = max(min(max(end + size if end < 0 else end, 0), size), start)
        pads[axis], pads[axis + rank] = start, size - end
    return pads


def _slice_grad_by_pad(b, node, g: str) -> str:
    """Unit steps: pad ``g`` by ``start`` before and ``size - end`` after each sliced axis,
    with ``start``/``end`` made non-negative and clamped to ``[0, size]`` like Slice does."""
    x = node.inputs[0]
    starts, ends = to_int64(b, node.inputs[1]), to_int64(b, node.inputs[2])
    axes = node.input(3)
    if axes is None:
        axes = arange(b, b.op("Size", starts))
    else:
        axes = to_int64(b, axes)
    sizes = b.op("Gather", b.shape_of(x), axes)
    start = _clamped_bound(b, starts, sizes)
    end = _maximum(b, _clamped_bound(b, ends, sizes), start)
    before, after = start, b.op("Sub", sizes, end)
    if b.opset >= 18:
        return b.op("Pad", g, b.op("Concat", before, after, axis=0), None, axes)
    rank = b.rank(x)
    if rank is None:  # a value of the gradient graph differentiated again, say
        zeros = b.op("ConstantOfShape", b.op("Shape", b.shape_of(x)), value=_INT64_ZERO)
    else:
        zeros = b.ints([0] * rank)
    full = [b.op("ScatterElements", zeros, axes, side, axis=0) for side in (before, after)]
    return b.op("Pad", g, b.op("Concat", *full, axis=0))


_INT64_ZERO = numpy_helper.from_array(np.zeros(1, np.int64))


def _clamped_bound(b, bound: str, sizes: str) -> str:
    """A Slice bound for unit steps: ``bound + size`` if negative, then clamped to
    ``[0, size]``."""
    zero = b.ints([0])
    wrapped = b.op("Where", b.op("Less", bound, zero), b.op("Add", bound, sizes), bound)
    return _maximum(b, _minimum(b, wrapped, sizes), zero)


def _minimum(b, x: str, y: str) -> str:
    """Elementwise minimum of int64 tensors (Min takes integers from opset 12)."""
    if b.opset >= 12:
        return b.op("Min", x, y)
    return b.op("Where", b.op("Less", y, x), y, x)


def _maximum(b, x: str, y: str) -> str:
    if b.opset >= 12:
        return b.op("Max", x, y)
    return b.op("Where", b.op("Less", x, y), y, x)


# -- Gather family --------------------------------------------------------------------------


@register("Gather", since=11)
def gather_grad(b, node, grads, needs):
    (g,) = grads
    data, indices = node.inputs
    rank = require_rank(b, data, node)
    axis = normalize_axis(node.attr("axis", 0), rank)
    if axis == 0 and node.opset >= 16:
        positions = b.unsqueeze(to_int64(b, indices), [-1])
        return [_scatter_add(b, "ScatterND", zeros_like(b, data), positions, g, data)]
    outer = numel(b, shape_parts(b, data, 0, axis))
    inner = numel(b, shape_parts(b, data, axis + 1))
    rows = shape_parts(b, data, axis, axis + 1)[0]
    updates = _rows_of(b, g, outer, indices, inner)
    flat = b.op("Reshape", to_int64(b, indices), b.ints([-1]))
    out = [outer, rows, inner]
    summed = _scatter_add_rows(b, node, flat, updates, out, rows, data, shared=True)
    return [reshape_like(b, summed, data)]


@register("GatherND", since=12)
def gather_nd_grad(b, node, grads, needs):
    (g,) = grads
    data, indices = node.inputs
    batch = node.attr("batch_dims", 0)
    if batch == 0 and node.opset >= 16:
        return [_scatter_add(b, "ScatterND", zeros_like(b, data), indices, g, data)]
    depth = _index_depth(b, node)
    require_rank(b, data, node)
    indexed = shape_parts(b, data, batch, batch + depth)
    rows = numel(b, indexed)
    outer = numel(b, shape_parts(b, data, 0, batch))
    inner = numel(b, shape_parts(b, data, batch + depth))
    grid = reshape(b, arange(b, scalar(b, rows)), indexed)
    flat = reshape(b, b.op("GatherND", grid, indices), [outer, -1])
    updates = reshape(b, g, [outer, -1, inner])
    out = [outer, rows, inner]
    summed = _scatter_add_rows(b, node, flat, updates, out, rows, data, shared=False)
    return [reshape_like(b, summed, data)]


def _rows_of(b, g: str, outer: Part, indices: str, inner: Part) -> str:
    """``g`` as ``[outer, count, inner]``, ``count`` the number of ``indices``: ``-1`` where
    ``outer`` and ``inner`` are known and not 0, else counted, and reshaped with its zeros
    kept (a ``-1`` beside a 0 cannot be inferred: an empty batch or inner axis)."""
    if is_static([outer, inner]) and outer and inner:
        return reshape(b, g, [outer, -1, inner])
    count = numel(b, shape_parts(b, indices))
    return reshape_to(b, g, as_tensor(b, [outer, count, inner]))


def _scatter_add(b, op: str, target: str, indices: str, updates: str, like: str, **attrs) -> str:
    """``op`` (ScatterND or ScatterElements) with ``reduction='add'``, in float32 where
    ``like`` is float16 or bfloat16 (onnxruntime's CPU provider has no such kernel there)."""
    elem = b.dtype(like)
    if elem not in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        return b.op(op, target, indices, updates, reduction="add", **attrs)
    wide = [b.op("Cast", name, to=TensorProto.FLOAT) for name in (target, updates)]
    summed = b.op(op, wide[0], indices, wide[1], reduction="add", **attrs)
    return b.op("Cast", summed, to=elem)


def _index_depth(b, node) -> int:
    shape = b.shape(node.inputs[1])
    if not shape or not isinstance(shape[-1], int):
        raise NotImplementedError(
            f"the gradient of GatherND node {node.name or '<unnamed>'!r} needs the static "
            f"last dimension of its indices {node.inputs[1]!r}"
        )
    return shape[-1]


def _scatter_add_rows(
    b, node, rows_index: str, updates: str, out: list[Part], n_rows: Part, like: str, shared: bool
) -> str:
    """``out[p, rows_index[p?, q], r] += updates[p, q, r]`` into zeros of shape ``out``;
    ``rows_index`` is ``[Q]`` (shared by every ``p``) or ``[P, Q]``.

    Opset >= 16: ScatterElements with ``reduction='add'``. Below: a sorted segment sum
    (:func:`._segment_sum.scatter_rows_add`)."""
    if node.opset >= 16:
        shape = b.op("Shape", updates)
        positions = b.op("Expand", b.unsqueeze(rows_index, [-1]), shape)
        zeros = filled(b, out, 0, like)
        return _scatter_add(b, "ScatterElements", zeros, positions, updates, like, axis=1)
    count = as_tensor(b, [n_rows])
    rows = _non_negative(b, b.op("Reshape", rows_index, b.ints([-1])), count)
    if shared:
        q = b.op("Shape", rows)
    else:
        q = b.op("Slice", b.op("Shape", rows_index), b.ints([1]), b.ints([2]))
    inner, size = as_tensor(b, [out[2]]), as_tensor(b, [numel(b, out)])
    per = "shared" if shared else "row"
    return scatter_rows_add(b, rows, updates, q, inner, count, size, per, like)


def _non_negative(b, index: str, count: str) -> str:
    """int64 ``index`` with negative entries counted from the end (``+ count``)."""
    return b.op("Where", b.op("Less", index, b.ints(0)), b.op("Add", index, count), index)


@register("GatherElements", since=11)
def gather_elements_grad(b, node, grads, needs):
    (g,) = grads
    data, indices = node.inputs
    rank = _common_rank(b, node) if node.opset >= 16 else require_rank(b, data, node)
    axis = normalize_axis(node.attr("axis", 0), rank)
    if node.opset >= 16:
        zeros = zeros_like(b, data)
        return [_scatter_add(b, "ScatterElements", zeros, indices, g, data, axis=axis)]
    count = as_tensor(b, shape_parts(b, data, axis, axis + 1))
    rows = _non_negative(b, b.op("Reshape", to_int64(b, indices), b.ints([-1])), count)
    index_shape = b.op("Shape", indices)
    outer, q, inner = (
        _size_of_axes(b, index_shape, start, end)
        for start, end in ((0, axis), (axis, axis + 1), (axis + 1, rank))
    )
    size = b.op("Mul", b.op("Mul", outer, count), inner)
    summed = scatter_rows_add(b, rows, g, q, inner, count, size, "element", data)
    if _same_dims_but(b, indices, data, axis):
        return [reshape_like(b, summed, data)]
    sizes = b.op(
        "Concat",
        b.op("Slice", index_shape, b.ints([0]), b.ints([axis])),
        count,
        b.op("Slice", index_shape, b.ints([axis + 1]), b.ints([rank])),
        axis=0,
    )
    summed = reshape_to(b, summed, sizes)
    pads = b.op(
        "Concat",
        b.ints([0] * rank),
        b.op("Sub", shape_tensor(b, data), b.op("Shape", summed)),
        axis=0,
    )
    padded = b.op("Pad", summed, pads)
    b.declare(padded, b.value_type(data))  # onnx's inference loses the rank on the way
    return [padded]


def _common_rank(b, node) -> int:
    """The rank of a GatherElements' data, which its indices and output share: the first
    of the three shape inference ranks (it loses the data's where an ``Expand`` to a
    computed shape made it). The scatter-add of opset 16 needs no more; the segment sum
    below it sizes the data's axes."""
    for name in (node.inputs[0], node.inputs[1], node.outputs[0]):
        if b.rank(name) is not None:
            return b.rank(name)
    return require_rank(b, node.inputs[0], node)


def _size_of_axes(b, shape: str, start: int, end: int) -> str:
    """``prod(shape[start:end])`` as a 1-D int64 tensor of one element (1 if empty)."""
    if start == end:
        return b.ints([1])
    sizes = b.op("Slice", shape, b.ints([start]), b.ints([end]))
    return sizes if end == start + 1 else b.op("ReduceProd", sizes, keepdims=1)


def _same_dims_but(b, a: str, other: str, axis: int) -> bool:
    """Whether ``a`` and ``other`` provably have the same sizes except along ``axis``."""
    a_shape, other_shape = b.shape(a), b.shape(other)
    if a_shape is None or other_shape is None:
        return False
    return all(
        i == axis or (x is not None and x == y)
        for i, (x, y) in enumerate(zip(a_shape, other_shape))
    )


def _crop_to_indices(b, node, t: str, axis: int) -> str:
    """``t`` (shaped like ``data``) cut to the sizes of ``indices`` on every axis but
    ``axis``: GatherElements wants them equal on some runtimes (the reference evaluator),
    ScatterElements allows smaller indices."""
    data, indices = node.inputs[:2]
    if _same_dims_but(b, indices, data, axis):
        return t
    rank = require_rank(b, data, node)
    others = [i for i in range(rank) if i != axis]
    ends = b.op("Gather", shape_tensor(b, indices), b.ints(others))
    return b.op("Slice", t, b.ints([0] * len(others)), ends, b.ints(others))


# -- Scatter family -------------------------------------------------------------------------


@register("ScatterElements", since=11)
def scatter_elements_grad(b, node, grads, needs):
    axis = normalize_axis(node.attr("axis", 0), require_rank(b, node.inputs[0], node))

    def scatter(target, updates, **attrs):
        return b.op("ScatterElements", target, node.inputs[1], updates, axis=axis, **attrs)

    def gather(source):
        cropped = _crop_to_indices(b, node, source, axis)
        return b.op("GatherElements", cropped, node.inputs[1], axis=axis)

    return _scatter_grad(b, node, grads, needs, scatter, gather)


@register("ScatterND", since=11)
def scatter_nd_grad(b, node, grads, needs):
    def scatter(target, updates, **attrs):
        return b.op("ScatterND", target, node.inputs[1], updates, **attrs)

    def gather(source):
        return b.op("GatherND", source, node.inputs[1])

    return _scatter_grad(b, node, grads, needs, scatter, gather)


def _scatter_grad(b, node, grads, needs, scatter, gather):
    (g,) = grads
    updates = node.inputs[2]
    reduction = node.attr("reduction", "none")
    if reduction == "none":
        data_grad = scatter(g, zeros_like(b, updates)) if needs[0] else None
        return [data_grad, None, gather(g) if needs[2] else None]
    if reduction == "add":
        return [g, None, gather(g) if needs[2] else None]
    if reduction in ("max", "min"):
        return _scatter_extremum_grad(b, node, g, needs, scatter, gather)
    if reduction == "mul":
        data_grad = scatter(g, updates, reduction="mul") if needs[0] else None
        updates_grad = None
        if needs[2]:
            weighted = gather(b.op("Mul", g, node.outputs[0]))
            updates_grad = b.op("Div", weighted, updates)
        return [data_grad, None, updates_grad]
    raise unsupported(node, f"reduction={reduction!r}")


def _scatter_extremum_grad(b, node, g, needs, scatter, gather):
    """``reduction='max'``/``'min'``: ``y_bar`` goes to the candidates equal to ``y`` (the
    element of ``data`` and the updates written there), shared equally among ties."""
    data, updates = node.inputs[0], node.inputs[2]
    y = node.outputs[0]
    from_data = cast_like(b, b.op("Equal", data, y), y)
    from_updates = cast_like(b, b.op("Equal", updates, gather(y)), y)
    ties = b.add(from_data, scatter(zeros_like(b, y), from_updates, reduction="add"))
    share = b.op("Div", g, ties)
    data_grad = b.mul(share, from_data) if needs[0] else None
    updates_grad = b.mul(gather(share), from_updates) if needs[2] else None
    return [data_grad, None, updates_grad]


# -- masks ----------------------------------------------------------------------------------


@register("Trilu", since=14)
def trilu_grad(b, node, grads, needs):
    return [b.op("Trilu", grads[0], node.input(1), upper=node.attr("upper", 1))]


# -- selections -----------------------------------------------------------------------------


@register("TopK", since=11)
def top_k_grad(b, node, grads, needs):
    """``x_bar``: ``Values_bar`` scattered at ``Indices`` (distinct within a slice)."""
    g = grads[0]
    if g is None:
        return [None, None]
    x = node.inputs[0]
    return [
        b.op("ScatterElements", zeros_like(b, x), node.outputs[1], g, axis=node.attr("axis", -1))
    ]


@register("Compress", since=11)
def compress_grad(b, node, grads, needs):
    """Slice ``p`` of ``x`` along ``axis`` (of the flattened ``x`` without one) is output
    slice ``k_p = sum_{q < p} c_q`` when ``c_p`` holds (``c`` the condition, padded with
    false to the length of the axis): ``x_bar = gather([0, y_bar], (k + 1) c)``, a zero slice
    put before ``y_bar`` so that an empty selection gathers zeros."""
    (g,) = grads
    x, condition = node.inputs
    axis = node.attr("axis")
    if axis is None:
        flat = b.op("Reshape", x, b.ints([-1]))
        return [reshape_like(b, _ungather_selected(b, g, condition, flat, 0, 1), x)]
    rank = require_rank(b, x, node)
    return [_ungather_selected(b, g, condition, x, normalize_axis(axis, rank), rank)]


def _ungather_selected(b, g: str, condition: str, x: str, axis: int, rank: int) -> str:
    length = b.op("Gather", b.shape_of(x), b.ints([axis]), axis=0)
    missing = b.op("Sub", length, b.op("Shape", condition))
    kept = b.op("Pad", b.op("Cast", condition, to=7), b.op("Concat", b.ints([0]), missing, axis=0))
    rows = b.mul(b.op("CumSum", kept, b.ints(0)), kept)
    pads = [0] * (2 * rank)
    pads[axis] = 1
    return b.op("Gather", b.op("Pad", g, b.ints(pads)), rows, axis=axis)


@register("ReverseSequence", since=11)
def reverse_sequence_grad(b, node, grads, needs):
    """A permutation that is its own inverse: ``x_bar = ReverseSequence(y_bar, max(lens, 1))``.

    Lengths 0 and 1 both leave a sequence as it is; the clamp keeps the gradient right on
    runtimes whose kernel leaves a length-0 row unwritten (onnxruntime 1.19).
    """
    attrs = {name: node.attr(name) for name in ("batch_axis", "time_axis")}
    return [b.op("ReverseSequence", grads[0], _at_least_one(b, node.inputs[1]), **attrs), None]


def _at_least_one(b, lens: str) -> str:
    known = b.constant_value(lens)
    if known is not None:
        return lens if (known >= 1).all() else b.const(np.maximum(known, 1))
    one = b.const(1, dtype=np.int64)
    return b.op("Where", b.op("Less", lens, one), one, lens)


@register("TensorScatter", since=24)
def tensor_scatter_grad(b, node, grads, needs):
    """``y`` is ``past_cache`` with ``update`` written at positions ``w_b + s`` (mod the
    cache length in circular mode) along ``axis``: ``past_cache_bar`` is ``y_bar`` with those
    positions zeroed (the same op writing zeros), ``update_bar`` is ``y_bar`` read there."""
    (g,) = grads
    cache, update = node.inputs[0], node.inputs[1]
    write = node.input(2)
    attrs = {name: node.attr(name) for name in ("axis", "mode")}
    results = [None, None, None]
    if needs[0]:
        results[0] = b.op("TensorScatter", g, zeros_like(b, update), write, **attrs)
    if needs[1]:
        rank = require_rank(b, update, node)
        axis = normalize_axis(node.attr("axis", -2), rank)
        steps = b.op(
            "Range", scalar(b, 0), b.op("Gather", b.shape_of(update), b.ints(axis)), scalar(b, 1)
        )
        positions = b.op("Reshape", steps, b.ints([-1] + [1] * (rank - axis - 1)))
        if write is not None:
            starts = b.op("Reshape", to_int64(b, write), b.ints([-1] + [1] * (rank - 1)))
            positions = b.add(positions, starts)
        if node.attr("mode", "linear") == "circular":
            length = b.op("Gather", b.shape_of(cache), b.ints(axis))
            positions = b.op("Mod", positions, length)
        positions = b.op("Expand", positions, b.shape_of(update))
        results[1] = b.op("GatherElements", g, positions, axis=axis)
    return results
