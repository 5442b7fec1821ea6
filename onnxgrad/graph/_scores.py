"""The nodes of each loss and penalty, appended with a :class:`GraphBuilder`.

Every function returns the name of a rank-0 tensor of the prediction's dtype. Labels are
``y``, per-sample weights ``w`` (shape ``[N]``) or ``None`` for ``w_i = 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from onnx import ValueInfoProto

from onnxgrad._onnx_utils import np_dtype
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


def _sum_per_sample(b: GraphBuilder, elementwise: str, weight: str | None) -> str:
    """``sum_i w_i sum_j e_ij`` over the samples ``i`` (first axis) of ``e``; Flatten makes
    the per-sample sum independent of the rank."""
    if weight is None:
        return b.reduce("ReduceSum", elementwise)
    rows = b.op("Flatten", elementwise, axis=1, hint="rows")
    per_sample = b.reduce("ReduceSum", rows, axes=[1], hint="per_sample")
    return b.reduce("ReduceSum", b.op("Mul", per_sample, weight, hint="weighted"))


def squared_error(
    b: GraphBuilder, prediction: ValueInfoProto, label: str, weight: str | None
) -> str:
    """``sum_i w_i sum_j (f_ij - y_ij)^2``."""
    diff = b.op("Sub", prediction.name, label, hint="diff")
    return _sum_per_sample(b, b.op("Mul", diff, diff, hint="diff_2"), weight)


def absolute_error(
    b: GraphBuilder, prediction: ValueInfoProto, label: str, weight: str | None
) -> str:
    """``sum_i w_i sum_j |f_ij - y_ij|``."""
    diff = b.op("Sub", prediction.name, label, hint="diff")
    return _sum_per_sample(b, b.op("Abs", diff, hint="abs_diff"), weight)


def elastic(
    b: GraphBuilder,
    prediction: ValueInfoProto,
    label: str,
    weight: str | None,
    l1_weight: float,
    l2_weight: float,
) -> str:
    """``sum_i w_i sum_j (l1_weight |d_ij| + l2_weight d_ij^2)`` with ``d = f - y``."""
    for arg, value in (("l1_weight", l1_weight), ("l2_weight", l2_weight)):
        if not is_number(value) or not np.isfinite(value):
            raise ValueError(f"{arg} must be a finite number, got {value!r}")
    np_type = np_dtype(elem_type_of(prediction))
    diff = b.op("Sub", prediction.name, label, hint="diff")
    l1_coef = b.const(np.array(l1_weight, dtype=np_type), "l1_weight")
    l2_coef = b.const(np.array(l2_weight, dtype=np_type), "l2_weight")
    l1 = b.op("Mul", b.op("Abs", diff, hint="abs_diff"), l1_coef, hint="l1")
    l2 = b.op("Mul", b.op("Mul", diff, diff, hint="diff_2"), l2_coef, hint="l2")
    return _sum_per_sample(b, b.op("Add", l1, l2, hint="elastic"), weight)


def binary_log(
    b: GraphBuilder, prediction: ValueInfoProto, label: str, weight: str | None, eps: float | None
) -> str:
    """``-sum_i w_i (y_i log p_i1 + (1 - y_i) log p_i0) / sum_i w_i`` on 2 columns."""
    n_classes = n_classes_of(prediction)
    if n_classes != 2:
        raise ValueError(
            f"score 'log' needs a 2-column probability output, {prediction.name!r} has "
            f"{n_classes} columns: use 'cross_entropy'"
        )
    return cross_entropy(b, prediction, label, weight, eps, probabilities=True)


def cross_entropy(
    b: GraphBuilder,
    prediction: ValueInfoProto,
    label: str,
    weight: str | None,
    eps: float | None,
    probabilities: bool,
) -> str:
    """``-sum_i w_i log p_{i,y_i} / max(sum_i w_i, tiny)`` (0, not NaN, when every weight
    is 0), ``p`` clipped to ``[eps, 1 - eps]`` or
    ``log p = LogSoftmax(logits)``; the class is picked by a one-hot mask (Equal, Cast, Mul)."""
    dtype = elem_type_of(prediction)
    np_type = np_dtype(dtype)
    log_p = _log_probabilities(b, prediction.name, np_type, eps, probabilities)
    column_shape = b.const(np.array([-1, 1], dtype=np.int64), "column_shape")
    column = b.op("Reshape", label, column_shape, hint="label_column")
    n_classes = n_classes_of(prediction)
    classes = b.const(np.arange(n_classes, dtype=np.int64).reshape((1, -1)), "classes")
    is_class = b.op("Equal", column, classes, hint="is_class")
    one_hot = b.op("Cast", is_class, to=dtype, hint="one_hot")
    picked = b.op("Mul", one_hot, log_p, hint="picked_log_p")
    log_likelihood = b.reduce("ReduceSum", picked, axes=[1], hint="log_likelihood")
    if weight is None:
        mean = b.reduce("ReduceMean", log_likelihood, hint="mean_log_likelihood")
    else:
        weighted = b.op("Mul", log_likelihood, weight, hint="weighted")
        weighted_sum = b.reduce("ReduceSum", weighted, hint="weighted_sum")
        total_weight = b.reduce("ReduceSum", weight, hint="total_weight")
        tiny = b.const(np.array(ml_dtypes.finfo(np_type).tiny, dtype=np_type), "tiny")
        positive = b.op("Max", total_weight, tiny, hint="positive_total_weight")
        mean = b.op("Div", weighted_sum, positive, hint="mean_log_likelihood")
    return b.op("Neg", mean)


def _log_probabilities(
    b: GraphBuilder, prediction: str, np_type: np.dtype, eps: float | None, probabilities: bool
) -> str:
    if probabilities is False:
        return b.op("LogSoftmax", prediction, axis=1, hint="log_p")
    if probabilities is not True:
        raise TypeError(f"probabilities must be True or False, got {probabilities!r}")
    eps = float(ml_dtypes.finfo(np_type).eps) if eps is None else eps
    if not is_number(eps) or not 0 < eps < 0.5:
        raise ValueError(f"eps must be a number in (0, 0.5), got {eps!r}")
    low = b.const(np.array(eps, dtype=np_type), "eps")
    high = b.const(np.array(1 - eps, dtype=np_type), "one_minus_eps")
    return b.op("Log", b.op("Clip", prediction, low, high, hint="clipped"), hint="log_p")


def n_classes_of(prediction: ValueInfoProto) -> int:
    dims = dims_of(prediction)
    if len(dims) != 2 or not isinstance(dims[1], int):
        raise ValueError(
            f"a classification loss needs an output of shape [N, n_classes] with a known "
            f"number of classes, {prediction.name!r} has shape {dims}"
        )
    return dims[1]


#: score -> (builder, keyword arguments with their defaults, whether labels are classes)
SCORES: dict[str, tuple[Callable[..., str], dict[str, Any], bool]] = {
    "squared_error": (squared_error, {}, False),
    "absolute_error": (absolute_error, {}, False),
    "elastic": (elastic, {"l1_weight": 0.5, "l2_weight": 0.5}, False),
    "log": (binary_log, {"eps": None}, True),
    "cross_entropy": (cross_entropy, {"eps": None, "probabilities": True}, True),
}

#: other names of the scores
ALIASES = {"l2": "squared_error", "l1": "absolute_error"}
