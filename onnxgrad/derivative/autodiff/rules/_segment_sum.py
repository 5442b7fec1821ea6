r"""Scatter-add below opset 16, where ScatterElements / ScatterND cannot add: a sorted
segment sum in ``O(positions + elements)`` memory.

``out[p, m, r] = sum_{q : index[p, q, r] = m} u[p, q, r]`` (``index`` broadcast to the
updates ``u``, of shape ``[P, Q, R]``; ``m`` in ``[0, M)``) is computed along axis 1:

1. ``index`` sorted ascending (TopK with ``k = Q``), ``u`` read in that order: equal
   indices form runs;
2. ``c = cumsum(u)`` along the sorted axis, in float64 (the differences below then lose
   ``2^-52`` of the running sum, not ``2^-23``), and ``c^- `` the same sum shifted by one
   (the sum *before* each position);
3. a run ``[s, e]`` of index ``m`` sums to ``c_e - c^-_s``: ``c`` is scattered at the last
   position of each run, ``c^-`` at the first, both to ``m``, into zeros with ``M + Q``
   slots along the axis. Every other position writes to its own spare slot ``M + q``, so
   the indices of each ScatterElements are distinct (no reduction needed), and the spare
   slots are cut off;
4. ``out = hi - lo``, zero where no index points, cast back to the updates' type.

No tensor is larger than ``P (M + Q) R``, where the one-hot product needs ``Q M``.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxgrad.derivative.autodiff.rules._shape_helpers import scalar_tensor


def sorted_scatter_add(b, index: str, updates: str, rows: str, like: str) -> str:
    """``zeros([P, M, R])`` plus ``updates`` (``[P, Q, R]``) added at rows ``index`` (int64,
    in ``[0, M)``, of shape ``[P or 1, Q, R or 1]``) along axis 1; ``rows`` is ``M`` as a
    1-D int64 tensor of one element. Typed like ``like``."""
    shape = b.op("Shape", updates)
    count = _axis_size(b, index, 1)
    ordered, order = b.op("TopK", index, count, axis=1, largest=0, sorted=1, outputs=2)
    wide = b.op("Cast", updates, to=TensorProto.DOUBLE)
    read = b.op("GatherElements", wide, b.op("Expand", order, shape), axis=1)
    running = b.op("CumSum", read, b.const(1, dtype=np.int64))
    before = _shifted(b, running, b.const(0.0, dtype=np.float64))
    spare = b.op("Add", rows, b.op("Range", _zero(b), b.squeeze(count, [0]), _one(b)))
    spare = b.unsqueeze(b.unsqueeze(spare, [0]), [2])
    slots = b.op("Concat", b.op("Slice", shape, b.ints([0]), b.ints([1])),
                 b.op("Add", rows, count), b.op("Slice", shape, b.ints([2]), b.ints([3])),
                 axis=0)  # fmt: skip
    zeros = b.op("ConstantOfShape", slots, value=scalar_tensor(0.0, TensorProto.DOUBLE))
    ends = []
    for value, later in ((running, True), (before, False)):
        at = b.op("Where", _run_end(b, ordered, later), ordered, spare)
        ends.append(b.op("ScatterElements", zeros, b.op("Expand", at, shape), value, axis=1))
    summed = b.op("Sub", *ends)
    kept = b.op("Slice", summed, b.ints([0]), rows, b.ints([1]))
    return b.op("Cast", kept, to=b.dtype(like))


def _axis_size(b, t: str, axis: int) -> str:
    """``t.shape[axis]`` as a 1-D int64 tensor of one element."""
    return b.op("Slice", b.op("Shape", t), b.ints([axis]), b.ints([axis + 1]))


def _zero(b) -> str:
    return b.const(0, dtype=np.int64)


def _one(b) -> str:
    return b.const(1, dtype=np.int64)


def _shifted(b, t: str, fill: str, later: bool = True) -> str:
    """``t`` (``[P, Q, R]``) moved one step along axis 1, ``fill`` entering: later
    (``t[q - 1]`` at ``q``) or earlier (``t[q + 1]`` at ``q``)."""
    if later:
        cut = b.op("Slice", t, b.ints([0]), b.ints([-1]), b.ints([1]))
        return b.op("Pad", cut, b.ints([0, 1, 0, 0, 0, 0]), fill)
    cut = b.op("Slice", t, b.ints([1]), b.ints([np.iinfo(np.int64).max]), b.ints([1]))
    return b.op("Pad", cut, b.ints([0, 0, 0, 0, 1, 0]), fill)


def _run_end(b, ordered: str, later: bool) -> str:
    """Whether each position of the sorted ``ordered`` (non-negative) ends its run of equal
    values: the last of the run (``later``) or the first."""
    neighbour = _shifted(b, ordered, b.const(-1, dtype=np.int64), later=not later)
    return b.op("Not", b.op("Equal", ordered, neighbour))
