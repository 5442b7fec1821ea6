"""Batches of observations: shuffled index batches, numpy views or device tensors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnxruntime as ort
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue

from onnxgrad._arrays import c_contiguous
from onnxgrad.training.running.devices import Device, check_device
from onnxgrad.training.running.ort_devices import numpy_to_ort_value
from onnxgrad.training.step._inputs import host_array, weight_vector


class OrtDataLoader:
    """Splits ``(X, y, sample_weight)`` into shuffled batches, every observation once an epoch.

    Batches have ``batch_size`` rows, the last one the remainder (as scikit-learn's
    ``gen_batches``). A float vector ``y`` (regression targets) is held as a column
    ``[N, 1]``, the shape of a regression model's output and of the label input
    :func:`~onnxgrad.add_loss_output` gives it, so batches feed such graphs directly (integer
    class labels stay ``[N]``, as the label of a classification loss); sample weights
    ``[N, 1]`` are held as ``[N]``. The whole data set is copied to ``device`` once
    (:meth:`device_data`), so a runner only sends the row indices of each batch: the
    consecutive slices of :meth:`epoch_order` (:meth:`epoch_batches`).

    :param random_iter: ``False``: the rows in their order, every epoch (no shuffling); the
        arguments up to this one come in the seeds' order
    :param random_state: seed or ``numpy.random.Generator`` of the shuffling
    """

    def __init__(
        self,
        X: np.ndarray,
        y: np.ndarray,
        sample_weight: np.ndarray | None = None,
        batch_size: int = 20,
        device: str | Device = "cpu",
        random_iter: bool = True,
        random_state: int | np.random.Generator | None = None,
    ):
        self.X = _as_array(X, "X")
        self.y = _label_layout(_as_array(y, "y"))
        self.sample_weight = (
            None
            if sample_weight is None
            else weight_vector(_as_array(sample_weight, "sample_weight"))
        )
        _check_lengths(self.X, self.y, self.sample_weight)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(f"batch_size must be an integer, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.device = check_device(device)
        self.rng = np.random.default_rng(random_state)
        self.random_iter = bool(random_iter)
        self._device_data: tuple[ort.OrtValue, ...] | None = None

    def __repr__(self) -> str:
        """``OrtDataLoader(...)`` with the arrays described, not printed."""
        arrays = ", ".join(f"{shape}:{np.dtype(dtype)}" for shape, dtype in self.desc)
        return (
            f"OrtDataLoader(...[{arrays}], batch_size={self.batch_size}, "
            f"device={str(self.device)!r}, random_iter={self.random_iter})"
        )

    @property
    def desc(self) -> list[tuple[tuple[int, ...], type]]:
        """``[(shape, dtype type), ...]`` of ``X``, ``y`` (and ``sample_weight``) as held."""
        return [(a.shape, a.dtype.type) for a in self.arrays()]

    @property
    def data_np(self) -> tuple[np.ndarray, ...]:
        """:meth:`arrays`, onnxcustom's name."""
        return self.arrays()

    @property
    def data_ort(self) -> tuple[ort.OrtValue, ...]:
        """:meth:`device_data`, onnxcustom's name."""
        return self.device_data()

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
        """The int64 row order of a new epoch: shuffled (the only draw from :attr:`rng`), or
        ``0..N-1`` with ``random_iter=False``."""
        if not self.random_iter:
            return np.arange(len(self), dtype=np.int64)
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

    def iter_ortvalue(self) -> Iterator[tuple[C_OrtValue, ...]]:
        """The batches of one shuffled epoch as onnxruntime's C-level ``OrtValue`` on the
        device (``onnxruntime.capi._pybind_state.OrtValue``, what IOBinding's
        ``bind_ortvalue_input`` and onnxcustom's loader gave); each owns its memory.
        ``onnxruntime.OrtValue(value)`` wraps one for ``InferenceSession.run_with_ortvalues``."""
        for batch in self.iter_numpy():
            yield tuple(numpy_to_ort_value(a, str(self.device)) for a in batch)

    def match_label_rank(self, rank: int) -> None:
        """Labels ``[N]`` and ``[N, 1]`` feed a label input of either rank: ``y`` is reshaped to
        ``rank`` when only a trailing axis of 1 differs (the copy on the device follows)."""
        if rank == 1 and self.y.ndim == 2 and self.y.shape[1] == 1:
            self.y = self.y.reshape(-1)
        elif rank == 2 and self.y.ndim == 1:
            self.y = self.y.reshape(-1, 1)
        else:
            return
        self._device_data = None

    def device_data(self) -> tuple[ort.OrtValue, ...]:
        """The whole data set as ``OrtValue`` on the device, copied on the first call."""
        if self._device_data is None:
            self._device_data = tuple(to_ortvalue(a, self.device) for a in self.arrays())
        return self._device_data


def to_ortvalue(array: np.ndarray, device: Device) -> ort.OrtValue:
    """An ``OrtValue`` holding ``array`` on ``device`` (on the CPU it shares the memory of
    ``array``, which must stay alive and unchanged as long as the ``OrtValue`` is used)."""
    array = c_contiguous(array)
    if device.kind == "cpu":
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy(array, device.ort_type, device.index)


def _label_layout(y: np.ndarray) -> np.ndarray:
    """A float vector as a column ``[N, 1]``; other labels as given."""
    return y.reshape((-1, 1)) if y.ndim == 1 and y.dtype.kind == "f" else y


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
