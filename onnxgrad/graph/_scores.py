"""The nodes of each loss and penalty, appended with a :class:`GraphBuilder`.

Each loss function returns its pointwise loss ``e`` (one value per element of a regression
prediction, per sample of a classification), :func:`reduce_loss` its rank-0 reduction.
Labels are ``y``, per-sample weights ``w`` (shape ``[N]``) or ``None`` for ``w_i = 1``.
The table naming them is :mod:`onnxgrad.graph.loss_table`.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from onnx import ValueInfoProto

from onnxgrad._onnx_utils import elem_type, np_dtype
from onnxgrad.graph._builder import GraphBuilder


def is_number(value: Any) -> bool:
    """A real number, booleans excluded."""
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def elem_type_of(info: ValueInfoProto) -> int:
    return info.type.tensor_type.elem_type if info.type.HasField("tensor_type") else 0


def dims_of(info: ValueInfoProto) -> list:
    """Dimensions as ints, names or ``None``; ``[]`` when the shape is unknown."""
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return []
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
    ]


def penalty_term(
    b: GraphBuilder, weight: str, weight_type: int, kind: str, coef: float, dtype: int
) -> str:
    """``coef * sum |W|`` (``l1``) or ``coef * sum W^2`` (``l2``), cast to ``dtype``."""
    magnitude = b.op("Abs", weight) if kind == "l1" else b.op("Mul", weight, weight, hint="square")
    total = b.reduce("ReduceSum", magnitude, hint=f"{kind}_{weight}")
    if weight_type != dtype:
        total = b.op("Cast", total, to=dtype)
    coef_name = b.const(np.array(coef, dtype=np_dtype(dtype)), f"{kind}_coef_{weight}")
    return b.op("Mul", total, coef_name, hint=f"penalty_{kind}_{weight}")


def reduce_loss(
    b: GraphBuilder, elementwise: str, weight: str | None, reduction: str, np_type: np.dtype
) -> str:
    """The reduction of the pointwise loss ``e`` (``[N, ...]``) with per-sample weights ``w``.

    * ``'sum'``: ``sum_i w_i sum_j e_ij``;
    * ``'mean'``: ``sum_i w_i mean_j e_ij / max(sum_i w_i, tiny)``, the mean over every
      element without weights (scikit-learn's ``mean_squared_error``, torch's ``'mean'``).
    """
    op_type = "ReduceSum" if check_reduction(reduction) == "sum" else "ReduceMean"
    if weight is None:
        return b.reduce(op_type, elementwise, hint=f"{reduction}_loss")
    rows = b.op("Flatten", elementwise, axis=1, hint="rows")
    per_sample = b.reduce(op_type, rows, axes=[1], hint="per_sample")
    weighted = b.reduce("ReduceSum", b.op("Mul", per_sample, weight, hint="weighted"))
    if reduction == "sum":
        return weighted
    total_weight = b.reduce("ReduceSum", weight, hint="total_weight")
    tiny = b.const(np.array(ml_dtypes.finfo(np_type).tiny, dtype=np_type), "tiny")
    positive = b.op("Max", total_weight, tiny, hint="positive_total_weight")
    return b.op("Div", weighted, positive, hint="weighted_mean")


def squared_error(b: GraphBuilder, prediction: ValueInfoProto, label: str) -> str:
    """``e_ij = (f_ij - y_ij)^2``."""
    diff = b.op("Sub", prediction.name, label, hint="diff")
    return b.op("Mul", diff, diff, hint="diff_2")


def absolute_error(b: GraphBuilder, prediction: ValueInfoProto, label: str) -> str:
    """``e_ij = |f_ij - y_ij|``."""
    diff = b.op("Sub", prediction.name, label, hint="diff")
    return b.op("Abs", diff, hint="abs_diff")


def elastic(
    b: GraphBuilder,
    prediction: ValueInfoProto,
    label: str,
    l1_weight: float,
    l2_weight: float,
) -> str:
    """``e_ij = l1_weight |d_ij| + l2_weight d_ij^2`` with ``d = f - y``."""
    for arg, value in (("l1_weight", l1_weight), ("l2_weight", l2_weight)):
        if not is_number(value) or not np.isfinite(value):
            raise ValueError(f"{arg} must be a finite number, got {value!r}")
    np_type = np_dtype(elem_type_of(prediction))
    diff = b.op("Sub", prediction.name, label, hint="diff")
    l1_coef = b.const(np.array(l1_weight, dtype=np_type), "l1_weight")
    l2_coef = b.const(np.array(l2_weight, dtype=np_type), "l2_weight")
    l1 = b.op("Mul", b.op("Abs", diff, hint="abs_diff"), l1_coef, hint="l1")
    l2 = b.op("Mul", b.op("Mul", diff, diff, hint="diff_2"), l2_coef, hint="l2")
    return b.op("Add", l1, l2, hint="elastic")


def binary_log(b: GraphBuilder, prediction: ValueInfoProto, label: str, eps: float | None) -> str:
    """``e_i = -(y_i log p_i + (1 - y_i) log(1 - p_i))``, ``p`` the probability of class 1:
    one column (``[N]`` or ``[N, 1]``) or the two columns ``[1 - p, p]`` of a classifier.
    An output whose number of columns is unknown (no declared shape, or ``[N, None]``) is
    read as either: ``p`` is its last column, and the loss is NaN when it has more than two
    (never a silent answer)."""
    np_type = np_dtype(elem_type_of(prediction))
    columns = _binary_columns(prediction, "log", "cross_entropy")
    probabilities = prediction.name
    if columns is None:
        columns, probabilities = 1, _last_of_two_columns(b, prediction.name, np_type)
    if columns == 1:
        p = _column(b, probabilities)
        one = b.const(np.array(1, dtype=np_type), "one")
        probabilities = b.op("Concat", b.op("Sub", one, p, hint="p0"), p, axis=1, hint="p01")
    log_p = _clipped_log(b, probabilities, np_type, eps)
    return _negative_log_likelihood(b, log_p, label, 2, np_type)


def binary_log_logits(b: GraphBuilder, prediction: ValueInfoProto, label: str) -> str:
    """``e_i = -(y_i log sigmoid(s_i) + (1 - y_i) log sigmoid(-s_i))`` on one column of raw
    scores ``s``, computed as ``LogSoftmax([0, s])`` (stable for large ``|s|``)."""
    _binary_columns(prediction, "log_logits", "cross_entropy_logits")
    s = _column(b, prediction.name)
    zero = b.op("Sub", s, s, hint="zero")
    log_p = b.op("LogSoftmax", b.op("Concat", zero, s, axis=1, hint="logits01"), axis=1)
    np_type = np_dtype(elem_type_of(prediction))
    return _negative_log_likelihood(b, log_p, label, 2, np_type)


def cross_entropy(
    b: GraphBuilder, prediction: ValueInfoProto, label: str, eps: float | None
) -> str:
    """``e_i = -log p_{i, y_i}`` on probabilities ``p`` clipped to ``[eps, 1 - eps]``."""
    np_type = np_dtype(elem_type_of(prediction))
    log_p = _clipped_log(b, prediction.name, np_type, eps)
    return _negative_log_likelihood(b, log_p, label, n_classes_of(prediction), np_type)


def cross_entropy_logits(b: GraphBuilder, prediction: ValueInfoProto, label: str) -> str:
    """``e_i = -log softmax(z_i)_{y_i} = -LogSoftmax(z)_{i, y_i}`` on logits ``z``."""
    np_type = np_dtype(elem_type_of(prediction))
    log_p = b.op("LogSoftmax", prediction.name, axis=1, hint="log_p")
    return _negative_log_likelihood(b, log_p, label, n_classes_of(prediction), np_type)


def _negative_log_likelihood(
    b: GraphBuilder, log_p: str, label: str, n_classes: int, np_type: np.dtype
) -> str:
    """``-log p_{i, y_i}`` picked by a one-hot mask (Equal, Cast, Mul).

    A label outside ``0..n_classes-1`` matches no column: its row is divided by the number
    of matches, ``0 / 0``, so the loss is NaN (never a silent 0, a perfect fit)."""
    column_shape = b.const(np.array([-1, 1], dtype=np.int64), "column_shape")
    column = b.op("Reshape", label, column_shape, hint="label_column")
    classes = b.const(np.arange(n_classes, dtype=np.int64).reshape((1, -1)), "classes")
    dtype = elem_type(np_type)
    one_hot = b.op("Cast", b.op("Equal", column, classes, hint="is_class"), to=dtype)
    picked = b.op("Mul", one_hot, log_p, hint="picked_log_p")
    log_likelihood = b.reduce("ReduceSum", picked, axes=[1], hint="log_likelihood")
    matches = b.reduce("ReduceSum", one_hot, axes=[1], hint="label_matches")
    checked = b.op("Div", log_likelihood, matches, hint="nan_if_out_of_range")
    return b.op("Neg", checked, hint="neg_log_likelihood")


def _clipped_log(b: GraphBuilder, probabilities: str, np_type: np.dtype, eps) -> str:
    eps = float(ml_dtypes.finfo(np_type).eps) if eps is None else eps
    if not is_number(eps) or not 0 < eps < 0.5:
        raise ValueError(f"eps must be a number in (0, 0.5), got {eps!r}")
    low = b.const(np.array(eps, dtype=np_type), "eps")
    high = b.const(np.array(1 - eps, dtype=np_type), "one_minus_eps")
    return b.op("Log", b.op("Clip", probabilities, low, high, hint="clipped"), hint="log_p")


def _column(b: GraphBuilder, prediction: str) -> str:
    shape = b.const(np.array([-1, 1], dtype=np.int64), "column_shape")
    return b.op("Reshape", prediction, shape, hint="column")


def _last_of_two_columns(b: GraphBuilder, prediction: str, np_type: np.dtype) -> str:
    """The last column of ``prediction`` seen as rows (``Flatten(axis=1)``), times ``1`` when
    it has at most two columns and ``NaN`` (``0 / 0``) when it has more."""
    rows = b.op("Flatten", prediction, axis=1, hint="rows")
    last = b.op(
        "Slice",
        rows,
        b.const(np.array([-1], dtype=np.int64), "last_start"),
        b.const(np.array([np.iinfo(np.int64).max], dtype=np.int64), "last_end"),
        b.const(np.array([1], dtype=np.int64), "last_axis"),
        hint="last_column",
    )
    columns = b.op(
        "Gather", b.op("Shape", rows, hint="rows_shape"), b.const(np.array(1), "axis_one")
    )
    two = b.const(np.array(2, dtype=np.int64), "two_columns")
    at_most_two = b.op("Cast", b.op("Not", b.op("Greater", columns, two)), to=elem_type(np_type))
    one_or_nan = b.op("Div", at_most_two, at_most_two, hint="one_or_nan")
    return b.op("Mul", last, one_or_nan, hint="p_checked")


def _binary_columns(prediction: ValueInfoProto, name: str, multi: str) -> int | None:
    """The number of columns of a binary prediction; ``None`` for ``'log'`` when unknown."""
    dims = dims_of(prediction)
    unknown = not prediction.type.tensor_type.HasField("shape") or (
        len(dims) == 2 and not isinstance(dims[1], int)
    )
    if unknown and name == "log":
        return None
    columns = 1 if len(dims) == 1 else (dims[1] if len(dims) == 2 else None)
    allowed = (1, 2) if name == "log" else (1,)
    if columns not in allowed:
        raise ValueError(
            f"loss {name!r} needs {' or '.join(map(str, allowed))} column(s) for the positive "
            f"class, {prediction.name!r} has shape {dims}: use {multi!r}"
        )
    return columns


def n_classes_of(prediction: ValueInfoProto) -> int:
    dims = dims_of(prediction)
    if len(dims) != 2 or not isinstance(dims[1], int):
        raise ValueError(
            f"a classification loss needs an output of shape [N, n_classes] with a known "
            f"number of classes, {prediction.name!r} has shape {dims}"
        )
    return dims[1]


#: the reductions of every loss, the default first
REDUCTIONS = ("sum", "mean")


def check_reduction(reduction: str) -> str:
    """``reduction`` if it is one of :data:`REDUCTIONS`, else a ``ValueError``."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    return reduction
