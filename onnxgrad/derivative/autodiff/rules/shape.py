"""Ops that only move, copy, pad or resample data. Each is linear, ``y = A x``, so
``x_bar = A^T y_bar``:

* Reshape, Flatten, Squeeze, Unsqueeze: ``x_bar = reshape(y_bar, shape(x))``
* Transpose with ``perm``: ``x_bar = transpose(y_bar, perm^-1)``
* Concat: ``x_bar_i = split(y_bar)_i``; Split: ``x_bar = concat(y_bar_k)`` (zeros for
  outputs without a gradient)
* Expand: ``x_bar = unbroadcast(y_bar)`` (done by the engine); Tile with repeats ``r``:
  ``y_bar`` viewed as ``[r0, d0, r1, d1, ...]`` summed over the ``r`` axes
* DepthToSpace / SpaceToDepth: the inverse rearrangement (same ``mode``)
* Pad (constant): the slice of ``y_bar`` where ``x`` was copied, ``c_bar = sum(y_bar) -
  sum(x_bar)`` for the padding value; negative pads (cropping) are not supported (the
  ONNX reference evaluator rejects them as well; a crop visible in static shapes raises).
  Reflect, edge and wrap modes: each output copies one input element, whose flat index is
  found by padding an index grid the same way; ``x_bar`` is the scatter-add of ``y_bar``
  at those indices (opset >= 16)
* Resize (every coordinate transformation, tf_crop_and_resize included): through per-axis
  interpolation matrices, or for nearest by the same index-grid
  scatter-add (see :func:`resize_grad`)
* Col2Im: each column element read back from the image position it was added to
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._pad_fold import folded_pad_grad
from onnxgrad.derivative.autodiff.rules._shape_helpers import (
    arange,
    as_tensor,
    constant_ints,
    filled,
    index_grid,
    inverse_permutation,
    is_static,
    normalize_axis,
    numel,
    require_rank,
    reshape,
    reshape_like,
    reshape_to,
    scatter_flat,
    shape_parts,
    shape_slice,
    shape_tensor,
    sum_parts,
    to_int64,
    unsupported,
    zeros_like,
)


def _axes(node, index: int = 1):
    """Axes from the attribute (opset < 13) or the input (opset >= 13); None if absent."""
    return node.attr("axes") if node.opset < 13 else node.input(index)


@register("Reshape", "Flatten")
def reshape_grad(b, node, grads, needs):
    if node.op_type == "Reshape" and _keeps_shape(b, node):
        return [grads[0]]
    return [reshape_like(b, grads[0], node.inputs[0])]


def _keeps_shape(b, node) -> bool:
    """Whether a Reshape gives back its input's shape: a constant target of the same rank
    matching every dimension (a 0 copies it) but at most one -1, the one left to infer."""
    x_shape = b.shape(node.inputs[0])
    target = constant_ints(b, node.inputs[1])
    if x_shape is None or target is None or len(target) != len(x_shape):
        return False
    copies = not node.attr("allowzero", 0)
    inferred = 0
    for dim, wanted in zip(x_shape, target):
        if wanted == -1:
            inferred += 1
        elif not ((wanted == 0 and copies) or dim == wanted):
            return False
    return inferred <= 1


@register("Squeeze")
def squeeze_grad(b, node, grads, needs):
    x, axes = node.inputs[0], _axes(node)
    if b.static_shape(x) is None and _known_axes(b, axes):
        return [b.unsqueeze(grads[0], axes)]
    return [reshape_like(b, grads[0], x)]


@register("Unsqueeze")
def unsqueeze_grad(b, node, grads, needs):
    x, axes = node.inputs[0], _axes(node)
    if b.static_shape(x) is None and _known_axes(b, axes):
        return [b.squeeze(grads[0], axes)]
    return [reshape_like(b, grads[0], x)]


def _known_axes(b, axes) -> bool:
    """Whether Squeeze/Unsqueeze ``axes`` (attribute list or input) are known and not empty.
    Axes computed at run time may be empty: Unsqueeze by none is the identity, but Squeeze
    by an empty axes tensor removes *every* size-1 axis (a ``[1, 1]`` gradient became a
    scalar); the gradient is then a Reshape to the input's shape."""
    if axes is None:
        return False
    if not isinstance(axes, str):
        return len(axes) > 0
    value = b.constant_value(axes)
    return value is not None and value.size > 0


@register("Transpose")
def transpose_grad(b, node, grads, needs):
    perm = node.attr("perm")
    if perm is None:
        return [b.op("Transpose", grads[0])]
    return [b.op("Transpose", grads[0], perm=inverse_permutation(perm))]


@register("Concat")
def concat_grad(b, node, grads, needs):
    (g,) = grads
    inputs = node.inputs
    if len(inputs) == 1:
        return [g]
    axis = node.attr("axis")
    if all(b.rank(x) is None for x in inputs) and node.opset >= 13:
        sizes = [b.op("Gather", b.shape_of(x), b.ints([axis]), axis=0) for x in inputs]
        pieces = b.op("Split", g, b.op("Concat", *sizes, axis=0), axis=axis, outputs=len(inputs))
        return [piece if need else None for piece, need in zip(pieces, needs)]
    known = next((x for x in inputs if b.rank(x) is not None), inputs[0])
    axis = normalize_axis(axis, require_rank(b, known, node))
    sizes = [_size_along(b, x, axis) for x in inputs]
    if node.opset >= 13:
        pieces = b.op("Split", g, as_tensor(b, sizes), axis=axis, outputs=len(inputs))
    elif is_static(sizes):
        pieces = b.op("Split", g, axis=axis, split=sizes, outputs=len(inputs))
    else:
        return _slices_along(b, g, sizes, axis, needs)
    return [piece if need else None for piece, need in zip(pieces, needs)]


def _size_along(b, x: str, axis: int):
    """``x.shape[axis]``: an int when known, else a 1-D int64 tensor."""
    if b.rank(x) is None:
        return b.op("Gather", b.shape_of(x), b.ints([axis]), axis=0)
    return shape_parts(b, x, axis, axis + 1)[0]


def _slices_along(b, g: str, sizes: list, axis: int, needs: list[bool]) -> list[str | None]:
    """``g`` cut into consecutive pieces of ``sizes`` along ``axis`` (one Slice per need)."""
    results = []
    for i, need in enumerate(needs):
        if not need:
            results.append(None)
            continue
        start = sum_parts(b, sizes[:i])
        end = sum_parts(b, sizes[: i + 1])
        results.append(b.op("Slice", g, as_tensor(b, [start]), as_tensor(b, [end]), b.ints([axis])))
    return results


@register("Split")
def split_grad(b, node, grads, needs):
    x = node.inputs[0]
    pieces = [g if g is not None else zeros_like(b, y, like=x) for g, y in zip(grads, node.outputs)]
    if len(pieces) == 1:
        return [pieces[0]]
    return [b.op("Concat", *pieces, axis=node.attr("axis", 0))]


@register("Expand", broadcast=True)
def expand_grad(b, node, grads, needs):
    return [grads[0], None]


@register("Tile")
def tile_grad(b, node, grads, needs):
    (g,) = grads
    x, repeats = node.inputs[:2]
    rank = require_rank(b, x, node)
    x_shape, y_shape = b.static_shape(x), b.static_shape(node.outputs[0])
    if x_shape is None or y_shape is None or 0 in x_shape:
        pairs = b.op("Concat", b.unsqueeze(repeats, [1]), b.unsqueeze(b.shape_of(x), [1]), axis=1)
        split = reshape_to(b, g, b.op("Reshape", pairs, b.ints([-1])))
        return [b.reduce_sum(split, list(range(0, 2 * rank, 2)), keepdims=False)]
    dims, axes = [], []
    for before, after in zip(x_shape, y_shape):
        if after != before:
            axes.append(len(dims))
            dims.append(after // before)
        dims.append(before)
    if not axes:
        return [g]
    return [b.reduce_sum(b.op("Reshape", g, b.ints(dims)), axes, keepdims=False)]


@register("SpaceToDepth")
def space_to_depth_grad(b, node, grads, needs):
    mode = node.attr("mode", "DCR")
    return [b.op("DepthToSpace", grads[0], blocksize=node.attr("blocksize"), mode=mode)]


@register("DepthToSpace")
def depth_to_space_grad(b, node, grads, needs):
    (g,) = grads
    x = node.inputs[0]
    block = node.attr("blocksize")
    if node.attr("mode", "DCR") == "DCR":
        return [b.op("SpaceToDepth", g, blocksize=block)]
    require_rank(b, x, node)
    n, _, h, w = (shape_parts(b, x, i, i + 1)[0] for i in range(4))
    blocks = reshape(b, g, [n, -1, h, block, w, block])
    moved = b.op("Transpose", blocks, perm=[0, 1, 3, 5, 2, 4])
    return [reshape_like(b, moved, x)]


@register("Pad", since=11)
def pad_grad(b, node, grads, needs):
    (g,) = grads
    mode = node.attr("mode", "constant")
    if mode != "constant":
        return [_pad_copy_grad(b, node, g, mode)]
    x, pads = node.inputs[:2]
    axes = node.input(3)
    _reject_cropping(b, node)
    begin, _ = b.op("Split", pads, axis=0, outputs=2, num_outputs=2 if b.opset >= 18 else None)
    sizes = shape_tensor(b, x) if axes is None else b.op("Gather", b.shape_of(x), axes)
    x_grad = b.op("Slice", g, begin, b.op("Add", begin, sizes), axes)
    value_grad = None
    if len(needs) > 2 and needs[2]:
        value = node.inputs[2]
        total = b.op("Sub", b.reduce_sum(g, None, False), b.reduce_sum(x_grad, None, False))
        value_grad = reshape_like(b, total, value)
    return [x_grad if needs[0] else None, None, value_grad]


def _reject_cropping(b, node) -> None:
    """Negative pads crop: the Slice-based gradient assumes they never do."""
    x_shape, y_shape = b.static_shape(node.inputs[0]), b.static_shape(node.outputs[0])
    if x_shape and y_shape and any(after < before for before, after in zip(x_shape, y_shape)):
        raise unsupported(node, "negative pads (cropping)")


def _pad_copy_grad(b, node, g: str, mode: str) -> str:
    """Reflect/edge with constant pads: the borders folded back (:mod:`._pad_fold`); else
    (wrap, pads known at run time) ``g`` scatter-added to the input elements each output
    copies."""
    constant = constant_ints(b, node.input(1)) is not None and node.input(3) is None
    if mode in ("reflect", "edge") and constant:
        return folded_pad_grad(b, node, g, mode)
    if node.opset < 16:
        raise unsupported(
            node, f"mode={mode!r} and pads known at run time below opset 16 (no scatter-add)"
        )
    x = node.inputs[0]
    sources = b.op("Pad", index_grid(b, x), node.inputs[1], None, node.input(3), mode=mode)
    return scatter_flat(b, x, sources, g, reduction="add")


# -- Resize ---------------------------------------------------------------------------------

_RESIZE_ATTRIBUTES = (
    "mode",
    "coordinate_transformation_mode",
    "cubic_coeff_a",
    "exclude_outside",
    "nearest_mode",
    "antialias",
)


@register("Resize", since=13)
def resize_grad(b, node, grads, needs):
    """The gradient of what onnxruntime computes, which samples each axis ``a`` separately
    with its own scale ``s_a`` (``sizes`` give ``s_a = m_a / n_a``): an axis with
    ``s_a != 1`` is sampled even where it keeps its size (``6 * 1.1 -> 6`` reads
    ``floor(i / 1.1)`` in nearest mode), but when the whole output shape equals ``x``'s,
    onnxruntime copies ``x`` unchanged whatever the scales and ``roi``; the gradient is then
    ``y_bar`` itself. The onnx reference evaluator samples in that case too, so for such a
    node this gradient is not the derivative of the reference evaluator's forward pass. (The
    two runtimes also differ for ``align_corners`` with scales where ``n_a s_a`` is not an
    integer: the reference evaluator divides by ``n_a s_a - 1``, onnxruntime by ``m_a - 1``;
    the interpolation matrices come from the runtime that evaluates the gradient.)

    Two constructions, both built from the runtime's own Resize with the node's mode,
    rounding and coordinate transformation:

    * per-axis interpolation matrices (:func:`_separable_resize_grad`), over the axes whose
      scale is not provably 1 (constant ``scales``/``sizes``/``roi``), or the ``axes``
      attribute, or every axis;
    * for nearest (opset >= 16) when the scales are not constant, the index-grid
      scatter-add (:func:`_nearest_resize_grad`).

    With shapes known only at run time, ``c = (shape(y) == shape(x))`` is computed and both
    constructions resize with unit scales and the whole ``roi`` where ``c`` holds, which
    yields ``y_bar`` whatever the runtime that evaluates the gradient. A size
    ``floor(n_a s_a)`` that float32 and float64 round differently (``10 * 0.7``: 7 on
    onnxruntime, 6 for onnx) is unknown in the value types, so it is read at run time too.
    """
    mode = node.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise unsupported(node, f"mode={mode!r}")
    rank = require_rank(b, node.inputs[0], node)
    x_shape, y_shape = b.shape(node.inputs[0]), b.shape(node.outputs[0])
    if x_shape is not None and all(isinstance(d, int) for d in x_shape) and x_shape == y_shape:
        return [grads[0]]
    copies = None if _changes_shape(x_shape, y_shape) else _copies(b, node)
    policy = node.attr("keep_aspect_ratio_policy", "stretch")
    if policy != "stretch" and (mode != "nearest" or node.opset < 16):
        raise unsupported(node, f"mode={mode!r} and keep_aspect_ratio_policy={policy!r}")
    positions = _resized_axes(b, node, rank)
    if policy != "stretch" or (positions is None and mode == "nearest" and node.opset >= 16):
        return [_nearest_resize_grad(b, node, grads[0], copies)]
    if positions is None:
        positions = {a: a for a in range(rank)}
    return [_separable_resize_grad(b, node, grads[0], positions, copies)]


def _changes_shape(x_shape, y_shape) -> bool:
    """Whether some axis provably changes size (known on both sides and different)."""
    if x_shape is None or y_shape is None:
        return False
    return any(
        isinstance(p, int) and isinstance(q, int) and p != q for p, q in zip(x_shape, y_shape)
    )


def _copies(b, node) -> str:
    """A boolean scalar: ``shape(y) == shape(x)`` (onnxruntime then copies ``x``)."""
    x, y = node.inputs[0], node.outputs[0]
    gap = b.op("Abs", b.op("Sub", b.shape_of(y), b.shape_of(x)))
    return b.op("Equal", b.reduce_sum(gap, None, False), b.ints(0))


def _whole_roi(b, node, length: int, copies: str | None) -> str | None:
    """The node's ``roi`` (``length`` entries), or ``[0.., 1..]`` where ``copies`` holds."""
    roi = node.input(1)
    if copies is None:
        return roi
    whole = b.op(
        "Cast",
        b.const([0.0] * (length // 2) + [1.0] * (length // 2), dtype=np.float32),
        to=b.dtype(roi),
    )
    return b.op("Where", copies, whole, roi)


def _unit_where(b, scales: str, copies: str | None) -> str:
    """``scales``, or 1 where ``copies`` holds."""
    if copies is None:
        return scales
    return b.op("Where", copies, b.const(1.0, dtype=np.float32), scales)


def _nearest_resize_grad(b, node, g: str, copies: str | None) -> str:
    """Nearest: each output copies one input element, found by resizing an (int32) index
    grid with the node's own inputs and attributes; ``x_bar`` is the scatter-add of ``g``
    there. Exact for every axis, scale and rounding mode."""
    x = node.inputs[0]
    grid = b.op("Cast", index_grid(b, x), to=TensorProto.INT32)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.proto.attribute}
    inputs = list(node.inputs[1:])
    if copies is not None:
        if node.input(3) is None:
            inputs[1] = _unit_where(b, node.input(2), copies)
        if _crops(node):
            inputs[0] = _whole_roi(b, node, _roi_length(b, node), copies)
    if _crops(node):
        attrs["extrapolation_value"] = -1.0
    sources = b.op("Resize", grid, *inputs, **attrs)
    if _crops(node):
        inside = b.op("Not", b.op("Less", sources, b.const(0, dtype=np.int32)))
        g = b.mask(inside, g)
        sources = b.op("Max", sources, b.const(0, dtype=np.int32))
    return scatter_flat(b, x, sources, g, reduction="add")


def _crops(node) -> bool:
    """``tf_crop_and_resize``: positions outside the ``roi`` read ``extrapolation_value``,
    not ``x``."""
    return node.attr("coordinate_transformation_mode") == "tf_crop_and_resize"


def _separable_resize_grad(b, node, g: str, positions: dict[int, int], copies) -> str:
    """Resize is linear and separable: along each resized axis ``a``, ``y = W_a x`` with an
    ``m_a x n_a`` interpolation matrix (:func:`_interpolation_matrix` gives ``W_a^T``),
    contracted with ``y_bar`` along ``a``: ``x_bar = y_bar x_1 W_1^T ... x_k W_k^T``
    (``positions``: ``{axis: its index in scales/sizes}``)."""
    x, y = node.inputs[0], node.outputs[0]
    rank = b.rank(x)
    flattened = False
    for axis in sorted(positions, reverse=True):
        matrix = _interpolation_matrix(b, node, axis, positions[axis], copies)
        if axis == rank - 1:
            g = b.op("MatMul", g, b.op("Transpose", matrix, perm=[1, 0]))
        elif axis == rank - 2 and not flattened:
            g = b.op("MatMul", matrix, g)
        else:
            inner = numel(b, shape_parts(b, x, axis + 1))
            size = shape_parts(b, y, axis, axis + 1)[0]
            g = b.op("MatMul", matrix, reshape(b, g, [-1, size, inner]))
            flattened = True
    return reshape_like(b, g, x) if flattened else g


def _resized_axes(b, node, rank: int) -> dict[int, int] | None:
    """``{axis: its index in scales/sizes}``: the listed axes (``axes`` attribute) or every
    axis, less those whose scale is provably 1 (and, for ``tf_crop_and_resize``, whose
    ``roi`` is provably ``[0, 1]``): onnxruntime leaves those untouched. ``None`` when the
    scales are not constant and the node lists no axes (every axis then)."""
    listed = node.attr("axes")
    pairs = (
        [(normalize_axis(a, rank), i) for i, a in enumerate(listed)]
        if listed is not None
        else [(a, a) for a in range(rank)]
    )
    unit = _unit_scales(b, node, pairs)
    if unit is None:
        return dict(pairs) if listed is not None or rank <= 2 else None
    return {a: i for (a, i), one in zip(pairs, unit) if not one}


def _unit_scales(b, node, pairs) -> list[bool] | None:
    """Per entry of ``pairs``: whether that axis' scale is provably 1; None when unknown."""
    sizes, scales = node.input(3), node.input(2)
    if sizes is not None:
        wanted = constant_ints(b, sizes)
        x_shape = b.shape(node.inputs[0])
        if wanted is None or x_shape is None:
            return None
        unit = [x_shape[a] == wanted[i] for a, i in pairs]
    else:
        value = None if scales is None else b.constant_value(scales)
        if value is None:
            return None
        value = np.asarray(value, dtype=np.float32).ravel()
        unit = [bool(value[i] == 1) for _, i in pairs]
    if _crops(node):
        roi = node.input(1)
        value = None if roi is None else b.constant_value(roi)
        if value is None:
            return [False] * len(pairs)
        value = np.asarray(value, dtype=np.float64).ravel()
        half = value.size // 2
        unit = [one and value[i] == 0 and value[half + i] == 1 for one, (_, i) in zip(unit, pairs)]
    return unit


def _interpolation_matrix(b, node, axis: int, position: int, copies: str | None) -> str:
    """``W_a^T``, ``n_a x m_a``: row ``i`` is the resized unit impulse at ``i``.

    The identity ``I_{n_a}`` is viewed as ``[1, n_a, 1, n_a]`` and resized with scales
    ``[1, 1, 2, s_a]`` (or sizes ``[1, n_a, 2, m_a]``, ``m_a`` read from the output's shape
    rather than from a computed ``sizes`` whose value onnx's data propagation may lose;
    ``roi`` ``[0, 0, 0, r_0, 1, 1, 1, r_1]``), then the first of the two rows of axis 2 is
    kept: axis 2 grows, so the output shape always differs from the input's and onnxruntime
    samples the last axis even where ``m_a = n_a`` (an ``[n_a, n_a]`` resize to the same
    shape is a mere copy there); a size-1 axis resized reads its single element in every
    mode. Where ``copies`` holds,
    ``s_a`` is 1 and the ``roi`` whole, so the matrix is the identity."""
    x = node.inputs[0]
    size = shape_parts(b, x, axis, axis + 1)[0]
    identity = b.op("EyeLike", filled(b, [size, size], 0, x))
    impulses = reshape(b, identity, [1, size, 1, size])
    sizes, scales = node.input(3), node.input(2)
    index = b.ints([position])
    attrs = {name: node.attr(name) for name in _RESIZE_ATTRIBUTES}
    roi = None
    if _crops(node):
        whole = b.op("Cast", b.const([0.0, 0.0, 0.0], dtype=np.float32), to=b.dtype(node.input(1)))
        start, end = b.op(
            "Split",
            _axis_roi(b, node, position, copies),
            axis=0,
            outputs=2,
            num_outputs=2 if b.opset >= 18 else None,
        )
        ones = b.op("Cast", b.const([1.0, 1.0, 1.0], dtype=np.float32), to=b.dtype(node.input(1)))
        roi = b.op("Concat", whole, start, ones, end, axis=0)
    if sizes is not None:
        resized_size = shape_parts(b, node.outputs[0], axis, axis + 1)[0]
        target = as_tensor(b, [1, size, 2, resized_size])
        resized = b.op("Resize", impulses, roi, None, target, **attrs)
    else:
        scale = _unit_where(b, b.op("Gather", scales, index), copies)
        target = b.op("Concat", b.const([1.0, 1.0, 2.0], dtype=np.float32), scale, axis=0)
        resized = b.op("Resize", impulses, roi, target, **attrs)
    row = b.op("Slice", resized, b.ints([0]), b.ints([1]), b.ints([2]))
    return b.squeeze(row, [0, 2])


def _roi_length(b, node) -> int:
    roi = node.input(1)
    shape = None if roi is None else b.static_shape(roi)
    if shape is None:
        raise unsupported(node, "tf_crop_and_resize with a roi of unknown length")
    return shape[0]


def _axis_roi(b, node, position: int, copies: str | None) -> str:
    """``[start, end]`` of the ``roi`` for entry ``position`` of scales/sizes (the identity
    matrix resized with it reads 0 outside: ``extrapolation_value`` does not depend on x);
    ``[0, 1]`` where ``copies`` holds."""
    half = _roi_length(b, node) // 2
    pair = b.op("Gather", node.input(1), b.ints([position, half + position]), axis=0)
    if copies is None:
        return pair
    whole = b.op("Cast", b.const([0.0, 1.0], dtype=np.float32), to=b.dtype(node.input(1)))
    return b.op("Where", copies, whole, pair)


@register("Col2Im", since=18)
def col2im_grad(b, node, grads, needs):
    """Col2Im adds column ``l`` of channel ``c B + k`` (``B`` elements per block) at image
    position ``p = o(l) s + u(k) d - pad_begin`` (``o``, ``u`` the multi-indices of ``l``
    among the blocks and of ``k`` within a block): ``x_bar[n, c B + k, l] = g[n, c, p]``,
    0 where ``p`` falls in the padding. Image and block shapes may be known at run time
    only."""
    (g,) = grads
    x, image_shape, block_shape = node.inputs
    d = b.shape(image_shape)[0] if b.shape(image_shape) else None
    if not isinstance(d, int):
        raise unsupported(node, "an image_shape of unknown length")
    strides = node.attr("strides") or [1] * d
    dilations = node.attr("dilations") or [1] * d
    pads = node.attr("pads") or [0] * (2 * d)
    image = to_int64(b, image_shape)
    block = to_int64(b, block_shape)
    span = b.op("Mul", b.op("Sub", block, b.ints([1] * d)), b.ints(dilations))
    room = b.op(
        "Sub", b.op("Add", image, b.ints([p + q for p, q in zip(pads[:d], pads[d:])])), span
    )
    blocks = b.op(
        "Add", b.op("Div", b.op("Sub", room, b.ints([1] * d)), b.ints(strides)), b.ints([1] * d)
    )
    where = _digits(b, blocks, d)  # [L, d]
    within = _digits(b, block, d)  # [B, d]
    positions = b.op(
        "Sub",
        b.add(
            b.unsqueeze(b.mul(where, b.ints(strides)), [0]),
            b.unsqueeze(b.mul(within, b.ints(dilations)), [1]),
        ),
        b.ints(pads[:d]),
    )  # [B, L, d]
    inside = b.op(
        "And", b.op("Not", b.op("Less", positions, b.ints([0] * d))), b.op("Less", positions, image)
    )
    valid = b.op("ReduceMin", b.op("Cast", inside, to=TensorProto.INT64), b.ints([-1]), keepdims=0)
    flat = b.reduce_sum(b.mul(positions, _suffix_products(b, image, d)), [-1], keepdims=False)
    flat = b.mul(flat, valid)
    planes = b.op("Reshape", g, b.op("Concat", shape_slice(b, g, 0, 2), b.ints([-1]), axis=0))
    picked = b.op("Gather", planes, flat, axis=2)  # [N, C, B, L]
    picked = b.mul(picked, b.op("Cast", valid, to=b.dtype(x)))
    return [reshape_like(b, picked, x), None, None]


def _suffix_products(b, v: str, d: int) -> str:
    """``[prod(v[i + 1:]) for i < d]`` for a 1-D int64 tensor of length ``d``."""
    parts = [
        b.op("ReduceProd", b.op("Slice", v, b.ints([i + 1]), b.ints([d])), keepdims=1)
        for i in range(d - 1)
    ]
    return b.op("Concat", *parts, b.ints([1]), axis=0) if parts else b.ints([1])


def _digits(b, radices: str, d: int) -> str:
    """Every multi-index below ``radices`` in row-major order: ``[prod(radices), d]``."""
    count = b.op("ReduceProd", radices, keepdims=0)
    flat = b.unsqueeze(b.op("Range", b.ints(0), count, b.ints(1)), [1])
    return b.op("Mod", b.op("Div", flat, _suffix_products(b, radices, d)), radices)


@register("Range", since=11)
def range_grad(b, node, grads, needs):
    r"""``y_i = start + i \, delta`` for ``i < n = max(ceil((limit - start) / delta), 0)``:
    :math:`\bar{start} = \sum_i g_i`, :math:`\bar{delta} = \sum_i i \, g_i`; ``limit`` only
    moves the length ``n``, an integer, so its derivative is zero wherever it exists (the
    engine reaches this rule for float ranges only: integer outputs carry no gradient)."""
    (g,) = grads
    results = [None, None, None]
    if g is None:
        return results
    if needs[0]:
        results[0] = b.reduce_sum(g, [0], keepdims=False)
    if needs[2]:
        steps = b.op("Cast", arange(b, b.op("Size", g)), to=b.dtype(g))
        results[2] = b.reduce_sum(b.mul(g, steps), [0], keepdims=False)
    return results
