"""Shape arithmetic for gradient rules: static when the sizes are known, ONNX ops otherwise.

A shape is handled as a list of *parts*: an ``int`` is one known size, a ``str`` names a
1-D int64 tensor holding one or more sizes computed at run time. Rules build target shapes
from parts and only pay for ``Shape``/``Concat`` nodes where a size is really unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import numpy as np
from onnx import TensorProto, numpy_helper

from onnxgrad._onnx_utils import np_dtype

Part = int | str


def require_rank(b, name: str, node) -> int:
    """The static rank of ``name``; rules that need it raise naming the node otherwise."""
    rank = b.rank(name)
    if rank is None:
        raise NotImplementedError(
            f"the gradient of {node.op_type} node {node.name or '<unnamed>'!r} needs the rank "
            f"of {name!r}, which shape inference could not determine"
        )
    return rank


def unsupported(node, what: str) -> NotImplementedError:
    """The error of an attribute setting a rule does not differentiate."""
    return NotImplementedError(
        f"no gradient for {node.op_type} node {node.name or '<unnamed>'!r} with {what}"
    )


def constant_ints(b, name: str | None) -> list[int] | None:
    """The values of an integer tensor known while the gradient is built (an initializer or
    a ``Constant`` output), flattened; ``None`` when unknown.

    Rules use it to pick leaner graphs (a Slice with unit ``steps`` has a Pad for gradient).
    """
    value = None if name is None else b.constant_value(name)
    return None if value is None else [int(v) for v in np.asarray(value).ravel()]


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return inverse


def shape_parts(b, x: str, start: int = 0, end: int | None = None) -> list[Part]:
    """The sizes ``x.shape[start:end]`` as parts (requires a known rank unless the slice is
    the whole shape): known sizes stay ints, runs of unknown sizes are sliced from
    ``Shape(x)``."""
    shape = b.shape(x)
    if shape is None:
        if start == 0 and end is None:
            return [b.shape_of(x)]
        raise ValueError(f"the rank of {x!r} is unknown")
    end = len(shape) if end is None else end
    parts: list[Part] = []
    i = start
    while i < end:
        if isinstance(shape[i], int):
            parts.append(shape[i])
            i += 1
            continue
        j = i
        while j < end and not isinstance(shape[j], int):
            j += 1
        parts.append(shape_slice(b, x, i, j))
        i = j
    return parts


def shape_slice(b, x: str, start: int, end: int) -> str:
    """``Shape(x)[start:end]`` as a 1-D int64 tensor."""
    if b.opset >= 15:
        return b.op("Shape", x, start=start, end=end)
    return b.op("Slice", b.shape_of(x), b.ints([start]), b.ints([end]))


def is_static(parts: Sequence[Part]) -> bool:
    return all(isinstance(p, int) for p in parts)


def as_tensor(b, parts: Sequence[Part]) -> str:
    """A 1-D int64 tensor concatenating ``parts`` (a constant when every size is known)."""
    groups: list[str] = []
    run: list[int] = []
    for part in parts:
        if isinstance(part, int):
            run.append(part)
            continue
        if run:
            groups.append(b.ints(run))
            run = []
        groups.append(part)
    if run or not groups:
        groups.append(b.ints(run))
    return groups[0] if len(groups) == 1 else b.op("Concat", *groups, axis=0)


def numel(b, parts: Sequence[Part]) -> Part:
    """The product of the sizes: an int, or a 1-D int64 tensor of one element."""
    known = prod(p for p in parts if isinstance(p, int))
    unknown = [p for p in parts if isinstance(p, str)]
    if not unknown:
        return known
    products = [b.op("ReduceProd", p, keepdims=1) for p in unknown]
    total = products[0]
    for other in products[1:]:
        total = b.op("Mul", total, other)
    return total if known == 1 else b.op("Mul", total, b.ints([known]))


def sum_parts(b, parts: Sequence[Part]) -> Part:
    """The sum of sizes: an int, or a 1-D int64 tensor of one element."""
    known = sum(p for p in parts if isinstance(p, int))
    total: Part = known
    for part in parts:
        if isinstance(part, str):
            total = part if total == 0 else b.op("Add", as_tensor(b, [total]), part)
    return total


def scalar(b, part: Part) -> str:
    """A 0-D int64 tensor: a Constant node for an int (``b.ints`` of an int comes out 1-D),
    a Squeeze of a one-element tensor."""
    if isinstance(part, int):
        return b.op("Constant", value=numpy_helper.from_array(np.array(part, dtype=np.int64)))
    return b.squeeze(part, [0])


def arange(b, end: str) -> str:
    """``range(end)`` as int64, ``end`` a 0-D int64 tensor."""
    return b.op("Range", scalar(b, 0), end, scalar(b, 1))


def shape_tensor(b, x: str) -> str:
    """The shape of ``x``: a constant if static, else ``Shape(x)``."""
    static = b.static_shape(x)
    return b.ints(list(static)) if static is not None else b.shape_of(x)


def reshape(b, t: str, parts: Sequence[Part]) -> str:
    return b.op("Reshape", t, as_tensor(b, parts))


def reshape_like(b, t: str, x: str) -> str:
    """``t`` reshaped to the shape of ``x`` (``allowzero`` keeps zero-sized dims of a
    computed shape as they are; an empty ``x`` of known shape gets an empty tensor)."""
    static = b.static_shape(x)
    if static is not None and 0 in static:
        return b.op("ConstantOfShape", b.ints(list(static)), value=scalar_tensor(0, b.dtype(t)))
    if static is not None:
        return b.op("Reshape", t, b.ints(list(static)))
    return reshape_to(b, t, b.shape_of(x))


def reshape_to(b, t: str, shape: str, like: str | None = None, **out) -> str:
    """``t`` reshaped to ``shape``, a 1-D int64 tensor of sizes computed at run time, a 0 a
    size like any other (never "copy this dimension", never -1); ``like``, when given, is a
    value of that shape (a plain Reshape where its sizes are known and none is 0).

    From opset 14 that is ``Reshape(allowzero=1)``. Below, a 0 in ``shape`` would copy the
    input's size: ``t`` is then empty, and so is the result, which only its shape tells
    apart. With ``s1 = Max(shape, 1)``,

    ``y = Reshape(Expand(Reshape(t, [s1, -1]), [shape, 1]), shape)``,

    where ``Reshape(t, [s1, -1])`` is ``[shape, 1]`` for a non-empty ``t`` (``s1 = shape``)
    and ``[s1, 0]`` for an empty one; the Expand turns the 1s of ``s1`` into the 0s of
    ``shape``, which the last Reshape then copies. The cost, one copy of ``t``, is paid
    only where a size is unknown. ``out`` (``out=name``) names the result where ``b`` takes
    it (the seed axis).
    """
    static = None if like is None else b.static_shape(like)
    if static is not None and 0 not in static:
        return b.op("Reshape", t, shape, **out)
    if b.opset >= 14:
        return b.op("Reshape", t, shape, allowzero=1, **out)
    one = b.ints([1])
    safe = b.op("Concat", b.op("Max", shape, one), b.ints([-1]), axis=0)
    spread = b.op("Expand", b.op("Reshape", t, safe), b.op("Concat", shape, one, axis=0))
    return b.op("Reshape", spread, shape, **out)


def expand_like(b, t: str, x: str) -> str:
    return b.op("Expand", t, shape_tensor(b, x))


def scalar_tensor(value, elem_type: int) -> TensorProto:
    """The ``value`` attribute of a ``ConstantOfShape``."""
    return numpy_helper.from_array(np.array([value], dtype=np_dtype(elem_type)))


def filled(b, parts: Sequence[Part], value, like: str) -> str:
    """A tensor of shape ``parts`` filled with ``value``, typed like ``like``."""
    return b.op("ConstantOfShape", as_tensor(b, parts), value=scalar_tensor(value, b.dtype(like)))


def zeros_like(b, x: str, like: str | None = None) -> str:
    """Zeros of the shape of ``x`` and the element type of ``like`` (default ``x``)."""
    return b.op("ConstantOfShape", shape_tensor(b, x), value=scalar_tensor(0, b.dtype(like or x)))


def to_int64(b, name: str) -> str:
    """``name`` as int64 (index inputs may be int32)."""
    if b.dtype(name) == TensorProto.INT64:
        return name
    return b.op("Cast", name, to=TensorProto.INT64)


def cast_like(b, t: str, like: str) -> str:
    return b.op("Cast", t, to=b.dtype(like))


def index_grid(b, x: str) -> str:
    """``reshape(range(size(x)), shape(x))``: the flat index of every element of ``x``."""
    static = b.static_shape(x)
    size = scalar(b, prod(static)) if static is not None else b.op("Size", x)
    return reshape_like(b, arange(b, size), x)


def scatter_flat(b, x: str, sources: str, g: str, reduction: str = "none") -> str:
    """The adjoint of ``y = x.flat[sources]``: ``g`` scattered (``reduction`` ``'add'`` when
    sources repeat) into zeros shaped like ``x``."""
    static = b.static_shape(x)
    size = (
        b.ints([prod(static)])
        if static is not None
        else b.op("Reshape", b.op("Size", x), b.ints([-1]))
    )
    zeros = b.op("ConstantOfShape", size, value=scalar_tensor(0, b.dtype(x)))
    flat = b.ints([-1])
    scattered = b.op(
        "ScatterElements",
        zeros,
        b.op("Reshape", sources, flat),
        b.op("Reshape", g, flat),
        axis=0,
        reduction=None if reduction == "none" else reduction,
    )
    return reshape_like(b, scattered, x)
