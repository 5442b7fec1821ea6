r"""The gradient of a reflect or edge ``Pad`` with constant pads, from slices (any opset).

Padding axis ``a`` (size ``n``) by ``(p, q)`` copies input elements into the border, so the
input's gradient is the output gradient's interior plus each border folded back onto the
elements it copies:

* reflect: :math:`y_{p-1-i} = x_{i+1}` and :math:`y_{p+n+k} = x_{n-2-k}`, so the reversed
  left border :math:`\bar y_{p-1}, \dots, \bar y_0` adds to :math:`x_1 \dots x_p` and the
  reversed right border :math:`\bar y_{-1}, \dots, \bar y_{-q}` to
  :math:`x_{n-1-q} \dots x_{n-2}`;
* edge: :math:`\sum_{i<p} \bar y_i` adds to :math:`x_0` and the sum of the right border to
  :math:`x_{n-1}`.

Padding is separable, so the axes fold one after the other. Each folded border is placed by
a zero ``Pad`` (pads computed from ``n`` at run time when it is unknown), which needs no
scatter with reduction (opset 16). A negative pad crops the input first (as onnxruntime
does): the folded gradient is then zero-padded back over the cropped elements (kaldi's
pre-emphasis is an edge ``Pad`` by ``(1, -1)``, a shift by one sample).
"""

from __future__ import annotations

import numpy as np

from onnxgrad.derivative.autodiff.rules._shape_helpers import (
    as_tensor,
    constant_ints,
    shape_slice,
    unsupported,
)

_FIRST, _LAST = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def folded_pad_grad(b, node, g: str, mode: str) -> str:
    """``x_bar`` of ``y = Pad(x, pads, mode)`` for reflect/edge, ``pads`` constant."""
    pads = constant_ints(b, node.input(1))
    if pads is None or node.input(3) is not None:
        raise unsupported(node, f"mode={mode!r} and pads or axes known only at run time")
    rank = len(pads) // 2
    crops = [max(-p, 0) for p in pads]
    x = node.inputs[0]
    for axis in range(rank):
        before, after = max(pads[axis], 0), max(pads[axis + rank], 0)
        if before or after:
            cropped = crops[axis] + crops[axis + rank]
            g = _fold_axis(b, g, x, axis, rank, (before, after), mode, cropped)
    if any(crops):
        g = b.op("Pad", g, b.ints(crops))
    return g


def _fold_axis(b, g: str, x: str, axis, rank, pads: tuple[int, int], mode: str, cropped: int):
    """Fold the borders of ``axis`` of ``g``: ``x`` cropped by ``cropped`` elements there
    was padded by ``pads``."""
    before, after = pads
    size = _size(b, x, axis)
    if cropped:
        size = _minus(b, size, cropped)
    total = _slice(b, g, before, -after if after else _LAST, axis)
    if before:
        if mode == "reflect":
            part, start = _slice(b, g, before - 1, _FIRST, axis, step=-1), 1
        else:
            part, start = b.reduce_sum(_slice(b, g, 0, before, axis), [axis]), 0
        end = _minus(b, size, start + (before if mode == "reflect" else 1))
        total = b.op("Add", total, _placed(b, part, axis, rank, start, end))
    if after:
        if mode == "reflect":
            part, stop = _slice(b, g, -1, -after - 1, axis, step=-1), 1
            start = _minus(b, size, after + 1)
        else:
            part, stop = b.reduce_sum(_slice(b, g, -after, _LAST, axis), [axis]), 0
            start = _minus(b, size, 1)
        total = b.op("Add", total, _placed(b, part, axis, rank, start, stop))
    return total


def _size(b, x: str, axis: int):
    shape = b.shape(x)
    if shape is not None and isinstance(shape[axis], int):
        return shape[axis]
    return shape_slice(b, x, axis, axis + 1)


def _minus(b, size, k: int):
    """``size - k``: an int, or a 1-D int64 tensor."""
    return size - k if isinstance(size, int) else b.op("Sub", size, b.ints([k]))


def _slice(b, g: str, start: int, end: int, axis: int, step: int = 1) -> str:
    steps = [] if step == 1 else [b.ints([step])]
    return b.op("Slice", g, b.ints([start]), b.ints([end]), b.ints([axis]), *steps)


def _placed(b, part: str, axis: int, rank: int, start, end) -> str:
    """``part`` zero-padded along ``axis`` by ``start`` before and ``end`` after."""
    zeros = [0] * rank
    pads = [*zeros[:axis], start, *zeros[axis + 1 :], *zeros[:axis], end, *zeros[axis + 1 :]]
    return b.op("Pad", part, as_tensor(b, pads))
