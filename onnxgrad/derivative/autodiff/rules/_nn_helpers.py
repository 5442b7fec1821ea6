"""Shared pieces of the neural-network rules: attributes of windowed ops, per-axis integer
vectors known at build time or computed at run time, and cropping to a target shape.

A :data:`Vec` holds one integer per spatial axis: a tuple when every value is known while
the gradient is built, otherwise the name of a 1-D int64 tensor. The arithmetic helpers fold
tuples in Python and emit ``Add``/``Sub``/``Mul``/``Div``/``Max`` only for tensors, so one
code path serves static and dynamic shapes and emits nothing when shapes are known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView

Vec = tuple[int, ...] | str

INT64_MAX = np.iinfo(np.int64).max


def unsupported(node: NodeView, what: str) -> NotImplementedError:
    """The error of an attribute setting or input a rule does not differentiate."""
    return NotImplementedError(
        f"no gradient for {node.op_type} node {node.name or '<unnamed>'!r}: {what}"
    )


def spatial_rank(b: GradBuilder, node: NodeView, *values: str | None) -> int:
    """Number of spatial axes of a windowed op, from its attributes or value ranks."""
    for name in ("kernel_shape", "strides", "dilations", "output_padding", "output_shape"):
        if node.has_attr(name):
            return len(node.attr(name))
    if node.has_attr("pads"):
        return len(node.attr("pads")) // 2
    for value in (*values, *node.inputs, *node.outputs):
        rank = b.rank(value) if value else None
        if rank is not None:
            return rank - 2
    raise unsupported(node, "the rank of its input is unknown")


def tensor_rank(b: GradBuilder, node: NodeView, name: str) -> int:
    rank = b.rank(name)
    if rank is None:
        raise unsupported(node, f"the rank of {name!r} is unknown")
    return rank


def ints_attr(node: NodeView, name: str, default: int, k: int) -> tuple[int, ...]:
    values = node.attr(name)
    return tuple(values) if values else (default,) * k


def static_dims(b: GradBuilder, name: str, start: int = 2) -> tuple[int, ...] | None:
    """``shape(name)[start:]`` when every one of those dims is known."""
    shape = b.shape(name)
    if shape is None or not all(isinstance(d, int) for d in shape[start:]):
        return None
    return tuple(shape[start:])


def shape_slice(b: GradBuilder, x: str, start: int, end: int | None = None) -> str:
    """``Shape(x)[start:end]`` as a 1-D int64 tensor."""
    if b.opset >= 15:
        return b.op("Shape", x, start=start, end=end)
    return b.op(
        "Slice", b.shape_of(x), b.ints([start]), b.ints([INT64_MAX if end is None else end])
    )


def dims(b: GradBuilder, x: str, start: int = 2) -> Vec:
    """``shape(x)[start:]``, static when known."""
    known = static_dims(b, x, start)
    return known if known is not None else shape_slice(b, x, start)


def as_tensor(b: GradBuilder, v: Vec) -> str:
    return v if isinstance(v, str) else b.ints(list(v))


def _elementwise(op_type: str, fn: Callable[[int, int], int]):
    def apply(b: GradBuilder, a: Vec | int, c: Vec | int) -> Vec:
        if not isinstance(a, str) and not isinstance(c, str):
            if isinstance(a, int) and isinstance(c, int):
                return fn(a, c)
            n = len(c) if isinstance(a, int) else len(a)
            left = (a,) * n if isinstance(a, int) else a
            right = (c,) * n if isinstance(c, int) else c
            return tuple(fn(x, y) for x, y in zip(left, right))
        left = b.ints(a) if isinstance(a, int) else as_tensor(b, a)
        right = b.ints(c) if isinstance(c, int) else as_tensor(b, c)
        return b.op(op_type, left, right)

    return apply


vadd = _elementwise("Add", lambda x, y: x + y)
vsub = _elementwise("Sub", lambda x, y: x - y)
vmul = _elementwise("Mul", lambda x, y: x * y)
vdiv = _elementwise("Div", lambda x, y: x // y)
vmax = _elementwise("Max", lambda x, y: max(x, y))


def is_static(*values: Vec | None) -> bool:
    return all(isinstance(v, tuple) for v in values)


def extents(b: GradBuilder, kernel: Vec, dilations: Sequence[int]) -> Vec:
    """Span of a dilated window: ``(k - 1) d + 1``."""
    return vadd(b, vmul(b, vsub(b, kernel, 1), tuple(dilations)), 1)


def same_pads(b: GradBuilder, auto_pad: str, total: Vec) -> tuple[Vec, Vec]:
    """Split a total padding: the odd unit goes at the end (SAME_UPPER) or the beginning."""
    half = vdiv(b, total, 2)
    rest = vsub(b, total, half)
    return (half, rest) if auto_pad == "SAME_UPPER" else (rest, half)


def window_pads(
    b: GradBuilder, node: NodeView, k: int, inputs: Vec, ext: Vec, strides: Sequence[int]
) -> tuple[Vec, Vec]:
    """Begin and end pads of Conv and pools, ``auto_pad`` resolved against the input sizes."""
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        pads = ints_attr(node, "pads", 0, 2 * k)
        return pads[:k], pads[k:]
    if auto_pad == "VALID":
        return (0,) * k, (0,) * k
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        s = tuple(strides)
        outputs = vdiv(b, vadd(b, inputs, vsub(b, s, 1)), s)
        total = vmax(b, vsub(b, vadd(b, vmul(b, vsub(b, outputs, 1), s), ext), inputs), 0)
        return same_pads(b, auto_pad, total)
    raise unsupported(node, f"auto_pad={auto_pad!r}")


def spatial_axes(k: int) -> list[int]:
    return list(range(2, 2 + k))


def crop_to(b: GradBuilder, z: str, starts: Vec, sizes: Vec, z_sizes: Vec | None, k: int) -> str:
    """``z[..., starts : starts + sizes]`` on the spatial axes, zero-padded at the end where
    ``z`` is shorter (positions no window reached get no gradient)."""
    if is_static(starts, sizes, z_sizes):
        ends = tuple(min(s + n, zs) for s, n, zs in zip(starts, sizes, z_sizes))
        if any(starts) or ends != z_sizes:
            z = b.op("Slice", z, b.ints(list(starts)), b.ints(list(ends)), b.ints(spatial_axes(k)))
        missing = [n - (e - s) for s, e, n in zip(starts, ends, sizes)]
        if any(missing):
            z = b.op("Pad", z, b.ints([0] * (k + 4) + missing))
        return z
    ends = vadd(b, starts, sizes)
    z = b.op("Slice", z, as_tensor(b, starts), as_tensor(b, ends), b.ints(spatial_axes(k)))
    missing = vsub(b, sizes, shape_slice(b, z, 2))
    return b.op("Pad", z, b.op("Concat", b.ints([0] * (k + 4)), missing, axis=0))


def pad_spatial(b: GradBuilder, x: str, begin: Vec, end: Vec, k: int) -> str:
    """Zero-pad the spatial axes of ``x``."""
    if is_static(begin, end):
        if not any(begin) and not any(end):
            return x
        return b.op("Pad", x, b.ints([0, 0, *begin, 0, 0, *end]))
    zeros = b.ints([0, 0])
    pads = b.op("Concat", zeros, as_tensor(b, begin), zeros, as_tensor(b, end), axis=0)
    return b.op("Pad", x, pads)


def swap_batch_and_channels(b: GradBuilder, x: str, rank: int) -> str:
    return b.op("Transpose", x, perm=[1, 0, *range(2, rank)])


def per_channel(b: GradBuilder, v: str, rank: int) -> str:
    """A ``(C,)`` vector shaped ``(C, 1, ..., 1)`` to broadcast along axis 1 of a rank-``rank``
    tensor."""
    if rank <= 2:
        return v
    return b.op("Reshape", v, b.ints([-1] + [1] * (rank - 2)))


def all_but_channel(rank: int) -> list[int]:
    return [0, *range(2, rank)]


def cast_like(b: GradBuilder, v: str, like: str, v_like: str | None = None) -> str:
    """``v`` cast to the element type of ``like`` when the types differ (``v_like`` names a
    value of ``v``'s type when ``v`` itself is untyped)."""
    source = b.dtype(v_like or v)
    target = b.dtype(like)
    return v if source == target else b.op("Cast", v, to=target)
