"""Checking user arrays against the inputs of a graph before any training starts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import ModelProto, ValueInfoProto

from onnxgrad._onnx_utils import np_dtype


def input_info(model: ModelProto, name: str) -> ValueInfoProto:
    for info in model.graph.input:
        if info.name == name:
            return info
    raise ValueError(f"the graph has no input {name!r}")


def host_array(value) -> np.ndarray:
    """``value`` as a numpy array; an ``OrtValue`` is copied (its ``numpy()`` is a view that
    does not keep the tensor alive)."""
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
        return np.array(value.numpy(), copy=True)
    return np.asarray(value)


def tensor_dims(info: ValueInfoProto) -> list[int | None]:
    """The dimensions of a tensor's type, ``None`` where not fixed (``[]``: no shape)."""
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return []
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]


def check_tensor(info: ValueInfoProto, array: np.ndarray, what: str) -> None:
    """``array`` has the dtype, the rank and the fixed dimensions after the first (the batch
    axis) that ``info`` declares, or a ``TypeError``/``ValueError`` naming ``what``."""
    expected = np_dtype(info.type.tensor_type.elem_type)
    if array.dtype != expected:
        raise TypeError(
            f"{what} has dtype {array.dtype}, the model input {info.name!r} expects {expected}: "
            f"convert it with {what}.astype(numpy.{expected})"
        )
    dims = tensor_dims(info)
    if dims and array.ndim != len(dims):
        raise ValueError(
            f"{what} has shape {array.shape}, the model input {info.name!r} expects {len(dims)} "
            f"dimensions {dims}"
        )
    for axis, (got, want) in enumerate(zip(array.shape, dims)):
        if axis > 0 and want is not None and got != want:
            raise ValueError(
                f"{what} has shape {array.shape}, the model input {info.name!r} expects "
                f"{want} values on axis {axis} (shape {dims})"
            )


def check_finite(array: np.ndarray, what: str, given: np.ndarray | None = None) -> None:
    """A ``ValueError`` naming the first row of ``array`` holding a NaN or an infinity;
    ``given``: the data before its cast to ``array``'s dtype (a finite value it made
    infinite overflowed)."""
    if array.dtype.kind not in "fc":
        return
    finite = np.isfinite(array)
    if finite.all():
        return
    index = tuple(int(i) for i in np.argwhere(~finite)[0])
    position = ", ".join(map(str, index))
    if given is not None and given.shape == array.shape and np.isfinite(given[index]):
        raise ValueError(
            f"{what}[{position}] = {given[index]} overflows {array.dtype} (the model's type, "
            f"largest {np.finfo(array.dtype).max:.4g}): rescale the data"
        )
    raise ValueError(
        f"{what} holds {array[index]} at row {index[0]} ({what}[{position}]): only finite "
        "values are accepted, remove or impute that row"
    )


def check_batch_axis(model: ModelProto, names: Sequence[str]) -> None:
    """The inputs ``names`` must leave their first dimension free: training feeds them
    batches (and whole data sets) of any number of rows."""
    for name in names:
        info = input_info(model, name)
        dims = tensor_dims(info)
        if dims and dims[0] is not None:
            raise ValueError(
                f"input {name!r} has a fixed first dimension {dims[0]} (shape {dims}): training "
                "feeds it batches of any size; export the model with a dynamic (symbolic) "
                "batch axis"
            )


def check_features(model: ModelProto, name: str, X, what: str = "X") -> np.ndarray:
    """``X`` as a finite array of the dtype and shape input ``name`` declares, or an error.

    Real numbers (floats, integers, booleans) are cast to the input's float type: float64
    data for a float32 model is rounded to the nearest float32 (``numpy.astype``).
    """
    given = array = host_array(X)
    info = input_info(model, name)
    expected = np_dtype(info.type.tensor_type.elem_type)
    if expected.kind == "f" and array.dtype.kind in "fiub" and array.dtype != expected:
        array = array.astype(expected)
    check_tensor(info, array, what)
    check_finite(array, what, given)
    return np.ascontiguousarray(array)


def check_labels(
    model: ModelProto, name: str, y, n_rows: int, what: str = "y", n_classes: int | None = None
) -> np.ndarray:
    """``y`` reshaped and typed for the label input ``name``.

    Integer labels (and floats holding integers) are cast to an integer label's dtype and,
    given ``n_classes``, must lie in ``0..n_classes-1``; real labels are cast to a float
    label's dtype (as ``X``, see :func:`check_features`) and must be finite. A vector
    feeds a one-column label and the reverse.
    """
    info = input_info(model, name)
    given = array = host_array(y)
    if array.ndim == 0 or array.shape[0] != n_rows:
        raise ValueError(
            f"X and {what} have different numbers of observations: {n_rows} and "
            f"{array.shape[0] if array.ndim else 'a scalar'}"
        )
    expected = np_dtype(info.type.tensor_type.elem_type)
    if expected.kind in "iu" and array.dtype.kind in "iubf":
        array = _class_indices(array, expected, what, n_classes)
    elif expected.kind == "f" and array.dtype.kind in "fiub":
        array = array.astype(expected)
    elif array.dtype != expected:
        raise TypeError(
            f"{what} has dtype {array.dtype}, the label input {name!r} expects {expected}"
        )
    check_finite(array, what, given)
    dims = tensor_dims(info)
    if dims:
        array = _reshape_labels(array, dims, name, what)
    return np.ascontiguousarray(array)


def _class_indices(array: np.ndarray, dtype: np.dtype, what: str, n_classes: int | None):
    valid = f"0..{n_classes - 1}" if n_classes else "integers >= 0"
    if array.dtype.kind == "f":
        check_finite(array, what)
        fractional = np.flatnonzero(array.ravel() != np.round(array.ravel()))
        if fractional.size:
            i = fractional[0]
            raise ValueError(
                f"{what} holds the non-integer class label {array.ravel()[i]} (flat index {i}): "
                f"class labels are integers in {valid}"
            )
    flat = array.ravel()
    bad = flat < 0 if n_classes is None else (flat < 0) | (flat >= n_classes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{what} holds the class label {flat[i]} (flat index {i}), outside the valid range "
            f"{valid}"
            + (f" of a {n_classes}-class output" if n_classes else "")
            + ": encode the classes as 0..C-1 (sklearn.preprocessing.LabelEncoder) or use "
            "OrtGradientClassifier, which does"
        )
    return array.astype(dtype)


def _reshape_labels(array: np.ndarray, dims: list, name: str, what: str) -> np.ndarray:
    if array.ndim == 1 and len(dims) == 2 and dims[1] in (1, None):
        return array.reshape((-1, 1))
    if array.ndim == 2 and len(dims) == 1 and array.shape[1] == 1:
        return array.reshape((-1,))
    if array.ndim != len(dims) or any(
        want is not None and got != want for got, want in zip(array.shape[1:], dims[1:])
    ):
        raise ValueError(f"{what} has shape {array.shape}, the label input {name!r} expects {dims}")
    return array


def weight_vector(array: np.ndarray) -> np.ndarray:
    """Sample weights of shape ``(N, 1)`` as the vector ``(N,)`` (as labels, a column of
    one is accepted); any other shape is returned as is, for the caller to reject."""
    return array.reshape(-1) if array.ndim == 2 and array.shape[1] == 1 else array


def check_sample_weight(model: ModelProto, name: str, weight, n_rows: int) -> np.ndarray:
    """Per-observation weights as a float vector of the input's dtype: finite, ``>= 0``,
    not all zero (a weighted mean needs a positive total)."""
    info = input_info(model, name)
    array = weight_vector(host_array(weight))
    if array.ndim != 1 or array.shape[0] != n_rows:
        raise ValueError(
            f"sample_weight must be a vector of {n_rows} weights, got shape {array.shape}"
        )
    if array.dtype.kind not in "fiub":
        raise TypeError(f"sample_weight must be numeric, got dtype {array.dtype}")
    check_finite(array, "sample_weight")
    negative = np.flatnonzero(array < 0)
    if negative.size:
        raise ValueError(
            f"sample_weight[{negative[0]}] is {array[negative[0]]}: weights must be >= 0"
        )
    array = array.astype(np_dtype(info.type.tensor_type.elem_type))
    if not array.any():
        raise ValueError("sample_weight is all zeros: no observation would count")
    return np.ascontiguousarray(array)
