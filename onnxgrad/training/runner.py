"""The runner: executes composed graphs with onnxruntime, the training state on the device.

Weights and optimizer state live in two sets of device buffers used in turn (ping-pong):
step ``k`` reads set ``k % 2`` and writes the other one, so nothing is copied back to the
host between steps. The data set is on the device too; each step only names its rows
(:func:`~onnxgrad.training.composition.with_batch_indices`). Every binding of an epoch is
prepared once, so the hot loop is one ``run_with_iobinding`` call per batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort
from onnx import ModelProto

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.training.composition import TrainStep, with_batch_indices
from onnxgrad.training.data import OrtDataLoader, to_ortvalue
from onnxgrad.training.devices import Device


def make_session(
    model: ModelProto, device: Device, options: ort.SessionOptions | None = None
) -> ort.InferenceSession:
    """An ``InferenceSession`` of ``model`` on ``device``."""
    return ort.InferenceSession(
        model.SerializeToString(), options or ort.SessionOptions(), providers=device.providers
    )


class DeviceTensors:
    """Named tensors on a device; on the CPU the ``OrtValue`` share a numpy array's memory."""

    def __init__(self, values: Mapping[str, np.ndarray], device: Device):
        self.device = device
        self.arrays = {k: np.array(v, copy=True, order="C") for k, v in values.items()}
        self.ortvalues = {k: to_ortvalue(a, device) for k, a in self.arrays.items()}

    def numpy(self) -> dict[str, np.ndarray]:
        """Host copies of the current values."""
        if self.device.kind == "cpu":
            return {k: a.copy() for k, a in self.arrays.items()}
        return {k: v.numpy() for k, v in self.ortvalues.items()}

    def assign(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            target = self.arrays[name]
            if target.shape != np.shape(value):
                raise ValueError(
                    f"{name!r}: new value of shape {np.shape(value)}, expected {target.shape}"
                )
            np.copyto(target, value, casting="same_kind")
            if self.device.kind != "cpu":
                self.ortvalues[name].update_inplace(target)


class TrainingRunner:
    """Runs a :class:`~onnxgrad.training.composition.TrainStep` epoch after epoch.

    :param weights: initial weights by name; ``state``: initial optimizer state (default:
        :meth:`TrainStep.initial_state`).
    """

    indices_name = "batch_indices"

    def __init__(
        self,
        step: TrainStep,
        device: Device,
        weights: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray] | None = None,
        session_options: ort.SessionOptions | None = None,
    ):
        self.step = step
        self.device = device
        self.model = with_batch_indices(step, self.indices_name)
        self.session = make_session(self.model, device, session_options)
        values = {
            **_ordered(weights, step.weights, "weight"),
            **self._initial_state(weights, state),
        }
        self._sets = [DeviceTensors(values, device), DeviceTensors(values, device)]
        self._current = 0
        self._lr = np.zeros((), dtype=self._lr_dtype())
        self._lr_value = ort.OrtValue.ortvalue_from_numpy(self._lr)
        self._epoch: _EpochBindings | None = None

    def _lr_dtype(self) -> np.dtype:
        for info in self.model.graph.input:
            if info.name == self.step.learning_rate:
                return np_dtype(info.type.tensor_type.elem_type)
        raise AssertionError("the train step has no learning-rate input")

    def _initial_state(self, weights, state) -> dict[str, np.ndarray]:
        if state is None:
            return self.step.initial_state(weights)
        return _ordered(state, self.step.state, "optimizer state")

    # -- state ------------------------------------------------------------------------------
    @property
    def current(self) -> DeviceTensors:
        """The buffers holding the latest weights and optimizer state."""
        return self._sets[self._current]

    def get_weights(self) -> dict[str, np.ndarray]:
        values = self.current.numpy()
        return {w: values[w] for w in self.step.weights}

    def get_state(self) -> dict[str, np.ndarray]:
        values = self.current.numpy()
        return {s: values[s] for s in self.step.state}

    def set_values(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite weights and/or optimizer state by name."""
        known = set(self.step.weights) | set(self.step.state)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown weights or state {unknown}, expected names in {sorted(known)}"
            )
        self.current.assign(values)

    # -- training ---------------------------------------------------------------------------
    def run_epoch(self, loader: OrtDataLoader, learning_rate: float) -> np.ndarray:
        """One pass over a new shuffled epoch of ``loader``; returns the loss of each batch.

        The losses are those computed with the weights before each update.
        """
        if self._epoch is None or self._epoch.loader is not loader:
            self._epoch = _EpochBindings(self, loader)
        epoch = self._epoch
        epoch.shuffle()
        self._lr[...] = learning_rate
        run = self.session.run_with_iobinding
        parity = self._current
        bindings = epoch.bindings
        for j in range(len(epoch.losses)):
            run(bindings[parity][j])
            parity ^= 1
        self._current = parity
        return epoch.losses.copy()


class _EpochBindings:
    """The ``IOBinding`` of every (buffer set, batch) pair for one data loader."""

    def __init__(self, runner: TrainingRunner, loader: OrtDataLoader):
        self.loader = loader
        step = runner.step
        data = loader.device_data()
        if len(data) != len(step.data_inputs):
            raise ValueError(
                f"the train step expects the inputs {list(step.data_inputs)}, "
                f"the data loader holds {len(data)} arrays"
            )
        self.order = np.zeros(len(loader), dtype=np.int64)
        size = loader.batch_size
        starts = range(0, len(loader), size)
        self._indices = [ort.OrtValue.ortvalue_from_numpy(self.order[s : s + size]) for s in starts]
        self.losses = np.zeros(len(self._indices), dtype=runner._lr.dtype)
        self._loss_values = [
            ort.OrtValue.ortvalue_from_numpy(self.losses[j : j + 1].reshape(()))
            for j in range(len(self.losses))
        ]
        self.bindings = [
            [self._bind(runner, data, parity, j) for j in range(len(self._indices))]
            for parity in (0, 1)
        ]

    def _bind(self, runner: TrainingRunner, data, parity: int, j: int) -> ort.IOBinding:
        step = runner.step
        source, target = runner._sets[parity].ortvalues, runner._sets[1 - parity].ortvalues
        binding = runner.session.io_binding()
        for name, value in zip(step.data_inputs, data):
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_input(runner.indices_name, self._indices[j])
        binding.bind_ortvalue_input(step.learning_rate, runner._lr_value)
        for old, new in zip(step.weights + step.state, step.new_weights + step.new_state):
            binding.bind_ortvalue_input(old, source[old])
            binding.bind_ortvalue_output(new, target[old])
        binding.bind_ortvalue_output(step.loss, self._loss_values[j])
        return binding

    def shuffle(self) -> None:
        """Write a new permutation of the rows in place: every index ``OrtValue`` sees it."""
        self.order[:] = self.loader.rng.permutation(len(self.loader))


class GraphRunner:
    """Runs a model whose inputs are data then weights, the weights taken from a runner's
    current buffers (evaluation and prediction graphs)."""

    def __init__(
        self,
        model: ModelProto,
        data_inputs: Sequence[str],
        device: Device,
        session_options: ort.SessionOptions | None = None,
    ):
        self.model = model
        self.data_inputs = tuple(data_inputs)
        self.device = device
        self.session = make_session(model, device, session_options)
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, data: Sequence[np.ndarray], weights: Mapping[str, ort.OrtValue]) -> list:
        """The outputs as numpy arrays."""
        binding = self.session.io_binding()
        keep_alive = []
        for name, array in zip(self.data_inputs, data):
            value = to_ortvalue(array, self.device)
            keep_alive.append(value)
            binding.bind_ortvalue_input(name, value)
        needed = {i.name for i in self.session.get_inputs()}
        for name, value in weights.items():
            if name in needed:
                binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        return [v.numpy() for v in binding.get_outputs()]


def _ordered(values: Mapping[str, np.ndarray], names: Sequence[str], what: str) -> dict:
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"no value for {what} {missing}")
    return {n: np.asarray(values[n]) for n in names}


__all__ = ["DeviceTensors", "GraphRunner", "TrainingRunner", "make_session"]
