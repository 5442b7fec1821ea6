"""Batches of observations: shuffled index batches, numpy views or device tensors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnxruntime as ort

from onnxgrad.training._inputs import host_array
from onnxgrad.training.devices import Device, check_device


class OrtDataLoader:
    """Splits ``(X, y, sample_weight)`` into shuffled batches, every observation once an epoch.

    Batches have ``batch_size`` rows, the last one the remainder (as scikit-learn's
    ``gen_batches``). The whole data set is copied to ``device`` once (:meth:`device_data`),
    so a runner only sends the row indices of each batch: the consecutive slices of
    :meth:`epoch_order` (:meth:`epoch_batches`).

    :param random_state: seed or ``numpy.random.Generator`` of the shuffling
    """

    def __init__(
        self,
        X: np.ndarray,
        y: np.ndarray,
        sample_weight: np.ndarray | None = None,
        batch_size: int = 20,
        device: str | Device = "cpu",
        random_state: int | np.random.Generator | None = None,
    ):
        self.X = _as_array(X, "X")
        self.y = _as_array(y, "y")
        self.sample_weight = (
            None if sample_weight is None else _as_array(sample_weight, "sample_weight")
        )
        _check_lengths(self.X, self.y, self.sample_weight)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(f"batch_size must be an integer, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.device = check_device(device)
        self.rng = np.random.default_rng(random_state)
        self._device_data: tuple[ort.OrtValue, ...] | None = None

    def __len__(self) -> int:
        """The number of observations."""
        return self.X.shape[0]

    @property
    def n_batches(self) -> int:
        return -(-len(self) // self.batch_size)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """``(X, y)`` or ``(X, y, sample_weight)``."""
        if self.sample_weight is None:
            return self.X, self.y
        return self.X, self.y, self.sample_weight

    def epoch_order(self) -> np.ndarray:
        """The int64 row order of a new shuffled epoch (the only draw from :attr:`rng`)."""
        return self.rng.permutation(len(self)).astype(np.int64, copy=False)

    def epoch_batches(self) -> list[np.ndarray]:
        """The int64 row indices of each batch of a new shuffled epoch."""
        order = self.epoch_order()
        return [order[i : i + self.batch_size] for i in range(0, len(self), self.batch_size)]

    def iter_numpy(self) -> Iterator[tuple[np.ndarray, ...]]:
        """The batches of one shuffled epoch as numpy arrays."""
        data = self.arrays()
        for indices in self.epoch_batches():
            yield tuple(a[indices] for a in data)

    __iter__ = iter_numpy

    def iter_ortvalue(self) -> Iterator[tuple[ort.OrtValue, ...]]:
        """The batches of one shuffled epoch as ``OrtValue`` on the device."""
        for batch in self.iter_numpy():
            yield tuple(to_ortvalue(a, self.device) for a in batch)

    def device_data(self) -> tuple[ort.OrtValue, ...]:
        """The whole data set as ``OrtValue`` on the device, copied on the first call."""
        if self._device_data is None:
            self._device_data = tuple(to_ortvalue(a, self.device) for a in self.arrays())
        return self._device_data


def to_ortvalue(array: np.ndarray, device: Device) -> ort.OrtValue:
    """An ``OrtValue`` holding ``array`` on ``device`` (on the CPU it shares the memory of
    ``array``, which must stay alive and unchanged as long as the ``OrtValue`` is used); a
    0-d array stays 0-d (``ascontiguousarray`` alone gives it one dimension)."""
    array = np.ascontiguousarray(array).reshape(np.shape(array))
    if device.kind == "cpu":
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy(array, device.ort_type, device.index)


def _as_array(value, name: str) -> np.ndarray:
    array = host_array(value)
    if array.dtype == object:
        raise TypeError(f"{name} must be a numeric array, got dtype object")
    if array.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    return np.ascontiguousarray(array)


def _check_lengths(X: np.ndarray, y: np.ndarray, weight: np.ndarray | None) -> None:
    if X.shape[0] != y.shape[0]:
        raise ValueError(
            f"X and y have different numbers of observations: X.shape={X.shape}, y.shape={y.shape}"
        )
    if weight is not None and (weight.ndim != 1 or weight.shape[0] != X.shape[0]):
        raise ValueError(
            f"sample_weight must be a vector of {X.shape[0]} weights, got shape {weight.shape}"
        )
    if X.shape[0] == 0:
        raise ValueError("X holds no observation")


__all__ = ["OrtDataLoader", "to_ortvalue"]
