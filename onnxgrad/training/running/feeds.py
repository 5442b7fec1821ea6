"""Inputs besides the feature matrix: per-row arrays and fixed feeds.

A model may take more than one input: a second feature array, an audio model's recurrent
state, a sample rate. The estimators take them as ``X`` given as a dict ``{input: array}``
(every array one row per observation) and/or as ``feeds={input: array}``. A feed is

* **per-row** when the array has the input's rank and as many rows as ``X``, and the
  input's first dimension is free or the one ``X``'s input declares: it is batched with
  ``X`` (the same rows);
* **fixed** otherwise (a 0-d sample rate, a ``[2, 1, 128]`` initial state): the same value
  is fed as is with every batch (the :attr:`~onnxgrad.training.step.train_step.DataRoles.fixed`
  role of the composed graphs).

Several per-row arrays travel together as :class:`Rows`, which indexes like one array, so
the estimators' batching, held-out rows and per-row losses need no change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort
from onnx import ModelProto, ValueInfoProto

from onnxgrad._arrays import c_contiguous
from onnxgrad._onnx_utils import np_dtype
from onnxgrad.training.running.data import OrtDataLoader
from onnxgrad.training.running.devices import Device
from onnxgrad.training.step._inputs import (
    check_features,
    check_finite,
    host_array,
    input_info,
    tensor_dims,
)


class Rows:
    """Per-row arrays of several inputs (same number of rows) indexed together:
    ``rows[i]`` selects the rows ``i`` of every array."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = dict(arrays)
        lengths = {n: len(a) for n, a in self.arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"the per-row inputs have different numbers of rows: {lengths}")

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index) -> Rows:
        return Rows({n: a[index] for n, a in self.arrays.items()})


def split_inputs(
    model: ModelProto,
    inputs: Sequence[str],
    X,
    feeds: Mapping[str, object] | None,
    defaults: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(per_row, fixed)`` values of the data ``inputs`` of ``model`` from ``X`` (an array
    feeding the first input ``feeds`` leaves, or a dict of per-row arrays) and ``feeds``
    (see the module docstring); ``defaults`` fill fixed inputs given no value."""
    if feeds is not None and not isinstance(feeds, Mapping):
        raise TypeError(f"feeds must be a dict {{input name: array}}, got {feeds!r}")
    feeds = dict(feeds or {})
    _check_names(feeds, inputs, "feeds")
    if isinstance(X, Rows):
        X = X.arrays
    if isinstance(X, Mapping):
        _check_names(X, inputs, "X")
        both = sorted(set(X) & set(feeds))
        if both:
            raise ValueError(f"inputs {both} are given both in X and in feeds")
        per_row = {n: host_array(v) for n, v in X.items()}
    else:
        free = [n for n in inputs if n not in feeds and n not in (defaults or {})]
        if not free:
            raise ValueError(f"every input {list(inputs)} is in feeds: none is left for X")
        per_row = {free[0]: host_array(X)}
    first = next(iter(per_row.values()), None)
    if first is None or first.ndim == 0:
        raise ValueError("X must hold at least one array with one row per observation")
    batch = _first_dims(model, per_row)
    fixed = {}
    for name, value in feeds.items():
        array = host_array(value)
        if _is_per_row(input_info(model, name), array, len(first), batch):
            per_row[name] = array
        else:
            fixed[name] = array
    for name, value in (defaults or {}).items():
        if name not in per_row and name not in fixed:
            fixed[name] = value
    missing = [n for n in inputs if n not in per_row and n not in fixed]
    if missing:
        raise ValueError(
            f"the model inputs {missing} have no value: give them in feeds={{name: array}} "
            "(or X as a dict {name: array})"
        )
    return _ordered(per_row, inputs), _ordered(fixed, inputs)


def as_rows(per_row: Mapping[str, np.ndarray]):
    """The one array of ``per_row``, or :class:`Rows` of several."""
    return next(iter(per_row.values())) if len(per_row) == 1 else Rows(per_row)


def checked_rows(model: ModelProto, features: Sequence[str], X, what: str = "X"):
    """``X`` (an array, a dict of arrays or :class:`Rows`) checked against the per-row
    ``features`` of ``model``: an array for one feature, :class:`Rows` in the order of
    ``features`` for several."""
    arrays = X.arrays if isinstance(X, Rows) else X
    if not isinstance(arrays, Mapping):
        arrays = {features[0]: arrays}
    if sorted(arrays) != sorted(features):
        raise ValueError(
            f"{what} holds the inputs {sorted(arrays)}, the graphs take one row per "
            f"observation of {list(features)}"
        )
    checked = {
        n: check_features(model, n, arrays[n], what if len(features) == 1 else f"{what}[{n!r}]")
        for n in features
    }
    return checked[features[0]] if len(features) == 1 else Rows(checked)


def flat(arrays: Sequence) -> list[np.ndarray]:
    """``[X, y, ...]`` with a :class:`Rows` ``X`` expanded into its arrays."""
    if arrays and isinstance(arrays[0], Rows):
        return [*arrays[0].arrays.values(), *arrays[1:]]
    return list(arrays)


def data_loader(X, y, *weight, **kwargs) -> OrtDataLoader:
    """An :class:`OrtDataLoader` of ``(X, y[, weight])``, ``X`` an array or :class:`Rows`."""
    if not isinstance(X, Rows):
        return OrtDataLoader(X, y, *weight, **kwargs)
    return _RowsLoader(X, y, *weight, **kwargs)


class _RowsLoader(OrtDataLoader):
    """A data loader whose features are several per-row arrays (in input order)."""

    def __init__(self, X: Rows, y, *weight, **kwargs):
        self.features = [c_contiguous(a) for a in X.arrays.values()]
        super().__init__(self.features[0], y, *weight, **kwargs)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (*self.features, *super().arrays()[1:])


class FixedFeeds:
    """The values of the fixed inputs of ``roles`` (a train step or loss model) as
    ``OrtValue`` on ``device`` owning their memory, checked against their declarations;
    ``feeds=None``: none yet (a runner before its first fit)."""

    def __init__(self, roles, device: Device, feeds: Mapping[str, object] | None):
        names = tuple(getattr(roles, "fixed", ()))
        if feeds is None:
            self.arrays: dict[str, np.ndarray] = {}
            self.values: dict[str, ort.OrtValue] = {}
            return
        feeds = dict(feeds)
        missing = [n for n in names if n not in feeds]
        unknown = sorted(set(feeds) - set(names))
        if missing or unknown:
            raise ValueError(
                f"the fixed inputs are {list(names)}: no value for {missing}, unknown {unknown}"
            )
        self.arrays = {n: checked_fixed(input_info(roles.model, n), feeds[n]) for n in names}
        self.values = {n: _owned_value(a, device) for n, a in self.arrays.items()}


def _owned_value(array: np.ndarray, device: Device) -> ort.OrtValue:
    value = ort.OrtValue.ortvalue_from_shape_and_type(
        list(array.shape), array.dtype, device.ort_type, device.index
    )
    value.update_inplace(array)
    return value


def checked_fixed(info: ValueInfoProto, value) -> np.ndarray:
    """A fixed feed cast to the input's type (real numbers to a float input, integral
    values to an integer input) with exactly the rank and fixed dimensions it declares."""
    given = array = host_array(value)
    expected = np_dtype(info.type.tensor_type.elem_type)
    if array.dtype != expected and array.dtype.kind in "fiub" and expected.kind in "fiu":
        array = array.astype(expected)
        if expected.kind in "iu" and not np.array_equal(array, given):
            raise ValueError(f"feed {info.name!r} does not fit the input's type {expected}")
    if array.dtype != expected:
        raise TypeError(f"feed {info.name!r} has dtype {array.dtype}, the input expects {expected}")
    dims = tensor_dims(info)
    declared = info.type.tensor_type.HasField("shape")
    if declared and (
        array.ndim != len(dims) or any(d is not None and d != g for g, d in zip(array.shape, dims))
    ):
        raise ValueError(
            f"feed {info.name!r} has shape {list(array.shape)}, the input declares "
            f"{['?' if d is None else d for d in dims]}"
        )
    check_finite(array, f"feed {info.name!r}")
    return c_contiguous(array)


def _first_dims(model: ModelProto, names) -> set:
    return {(tensor_dims(input_info(model, n)) or [None])[0] for n in names}


def _is_per_row(info: ValueInfoProto, array: np.ndarray, n_rows: int, batch: set) -> bool:
    """Whether a feed has ``n_rows`` rows for an input whose first dimension is free or the
    (fixed, :mod:`~onnxgrad.training.running.batch_axis`) batch dimension ``batch`` of ``X``."""
    dims = tensor_dims(info)
    declared = info.type.tensor_type.HasField("shape")
    if array.ndim == 0 or array.shape[0] != n_rows:
        return False
    return not declared or (len(dims) == array.ndim and (dims[0] is None or dims[0] in batch))


def _check_names(values: Mapping, inputs: Sequence[str], what: str) -> None:
    unknown = sorted(set(values) - set(inputs))
    if unknown:
        raise ValueError(f"{what} names {unknown}, which are not data inputs {list(inputs)}")


def _ordered(values: Mapping, inputs: Sequence[str]) -> dict:
    return {n: values[n] for n in inputs if n in values}


__all__ = [
    "FixedFeeds",
    "Rows",
    "as_rows",
    "checked_fixed",
    "checked_rows",
    "data_loader",
    "split_inputs",
]
