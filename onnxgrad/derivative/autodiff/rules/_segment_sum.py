r"""Scatter-add below opset 16, where ScatterElements / ScatterND cannot add: a sorted
segment sum in ``O(positions + elements)`` memory.

``out[m] = sum_{n : t_n = m} u_n`` for flat targets ``t`` (``N`` int64 in ``[0, S)``) and
updates ``u`` (``N``):

1. ``t`` sorted ascending (TopK with ``k = N``), ``u`` read in that order: equal targets
   form runs;
2. ``c = cumsum(u)`` in that order, in float64 (a difference below then loses ``2^-52`` of
   the running sum, not ``2^-23``), and ``c^-`` the sum before each position (``c``
   shifted by one);
3. a run ``[s, e]`` of target ``m`` sums to ``c_e - c^-_s``: ``c`` is scattered at the
   last position of each run and ``c^-`` at the first, both to ``m``, into zeros of
   ``S + N`` slots. Every other position writes to a spare slot ``S + n`` of its own, so
   each ScatterElements has distinct indices (no reduction needed); the spare slots are
   cut off;
4. ``out = hi - lo``: zero where no target points, cast back to the updates' type.

Every tensor is 1-D (ranks known to onnx's inference, for the next derivative) and no
larger than ``S + N``, where a one-hot product needs ``S N``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxgrad.derivative.autodiff.rules._shape_helpers import scalar_tensor

_END = np.iinfo(np.int64).max


def sorted_scatter_add(b, targets: str, updates: str, size: str, like: str) -> str:
    """``zeros(S)`` plus ``updates`` added at ``targets`` (1-D, int64 in ``[0, S)``, as long
    as the 1-D ``updates``); ``size`` is ``S`` as a 1-D int64 tensor of one element. The
    result is 1-D, typed like ``like``."""
    count = b.op("Shape", targets)
    ordered, order = b.op("TopK", targets, count, axis=0, largest=0, sorted=1, outputs=2)
    wide = b.op("Cast", updates, to=TensorProto.DOUBLE)
    running = b.op("CumSum", b.op("Gather", wide, order, axis=0), b.const(0, dtype=np.int64))
    before = _shifted(b, running, b.const(0.0, dtype=np.float64), later=True)
    spare = b.op("Add", size, _range(b, count))
    slots = b.op("Reshape", b.op("Add", size, count), b.ints([1]))
    zeros = b.op("ConstantOfShape", slots, value=scalar_tensor(0.0, TensorProto.DOUBLE))
    ends = []
    for value, last in ((running, True), (before, False)):
        at = b.op("Where", _run_end(b, ordered, last), ordered, spare)
        ends.append(b.op("ScatterElements", zeros, at, value, axis=0))
    kept = b.op("Slice", b.op("Sub", *ends), b.ints([0]), size, b.ints([0]))
    return b.op("Cast", kept, to=b.dtype(like))


def _range(b, count: str) -> str:
    """``[0, 1, ..., n - 1]`` for ``count = [n]``."""
    one = b.const(1, dtype=np.int64)
    return b.op("Range", b.const(0, dtype=np.int64), b.squeeze(count, [0]), one)


def _shifted(b, t: str, fill: str, later: bool) -> str:
    """1-D ``t`` moved one step, ``fill`` entering: later (``t[n - 1]`` at ``n``) or earlier
    (``t[n + 1]`` at ``n``). Padded, then cut: an empty ``t`` stays empty."""
    if later:
        padded = b.op("Pad", t, b.ints([1, 0]), fill)
        return b.op("Slice", padded, b.ints([0]), b.ints([-1]), b.ints([0]))
    padded = b.op("Pad", t, b.ints([0, 1]), fill)
    return b.op("Slice", padded, b.ints([1]), b.ints([_END]), b.ints([0]))


def _run_end(b, ordered: str, last: bool) -> str:
    """Whether each position of the sorted, non-negative ``ordered`` ends its run of equal
    values: is its last (``last``) or its first."""
    neighbour = _shifted(b, ordered, b.const(-1, dtype=np.int64), later=not last)
    return b.op("Not", b.op("Equal", ordered, neighbour))


def scatter_rows_add(
    b, rows: str, updates: str, q: str, inner: str, count: str, size: str, per: str, like: str
) -> str:
    """``zeros([outer, M, inner])`` plus ``updates`` (``[outer, Q, inner]`` in row-major
    order, any shape) added along ``M`` at ``rows`` (int64, non-negative, flat), flattened.
    ``rows`` holds one entry per ``per``: ``"element"``, ``"row"`` (each ``(o, q)``) or
    ``"shared"`` (each ``q``, the same for every ``o``). Element ``e`` of the updates lies in
    row ``r = e // inner = o Q + q`` and goes to ``(o M + row) inner + e mod inner``.
    ``q``, ``inner``, ``count`` (``M``) and ``size`` (``outer M inner``) are 1-D int64
    tensors of one element. ``q`` and ``inner`` divide at least 1: where either is 0 there
    is no element, but onnxruntime 1.32 refuses an integer division by 0 even of nothing."""
    one = b.ints([1])
    q, inner = b.op("Max", q, one), b.op("Max", inner, one)
    flat = b.op("Reshape", updates, b.ints([-1]))
    element = _range(b, b.op("Shape", flat))
    row = b.op("Div", element, inner)
    key = {"element": None, "row": row, "shared": b.op("Mod", row, q)}[per]
    target = rows if key is None else b.op("Gather", rows, key, axis=0)
    start = b.op("Mul", b.op("Div", row, q), count)
    spot = b.op("Mul", b.op("Add", start, target), inner)
    targets = b.op("Add", spot, b.op("Mod", element, inner))
    return sorted_scatter_add(b, targets, flat, size, like)
