"""The runner: executes composed graphs with onnxruntime, the training state on the device.

Weights and optimizer state live in two sets of device buffers used in turn (ping-pong):
step ``k`` reads set ``k % 2`` and writes the other one, so nothing is copied back to the
host between steps. A value whose update can be written over it (see
:mod:`~onnxgrad.training.step._in_place`: optimizer state, and the weights of a per-weight update,
which waits for the backward's reads of them, :mod:`~onnxgrad.training.step.update_gates`) has
one buffer, shared by both sets. The data set is on the device too;
each step only names its rows (:func:`~onnxgrad.training.step.composition.with_batch_indices`).
Every binding of an epoch is prepared once, so the hot loop is one ``run_with_iobinding``
call per batch.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import ModelProto

from onnxgrad import _files
from onnxgrad._arrays import c_contiguous
from onnxgrad._onnx_utils import default_opset, np_dtype, serialized_size
from onnxgrad.training.running.data import OrtDataLoader, to_ortvalue
from onnxgrad.training.running.devices import Device
from onnxgrad.training.running.feeds import FixedFeeds
from onnxgrad.training.running.session_options import training_session_options
from onnxgrad.training.step._in_place import in_place_inputs
from onnxgrad.training.step._inputs import check_tensor, host_array, tensor_dims
from onnxgrad.training.step.composition import with_batch_indices
from onnxgrad.training.step.train_step import TrainStep


def make_session(
    model: ModelProto, device: Device, options: ort.SessionOptions | None = None
) -> ort.InferenceSession:
    """An ``InferenceSession`` of ``model`` on ``device`` (default options: those of
    :mod:`~onnxgrad.training.running.session_options`); a model past protobuf's 2 GiB limit goes
    through a temporary file with external data."""
    options = options or training_session_options()
    try:
        if serialized_size(model) < _files.PROTOBUF_LIMIT:
            return ort.InferenceSession(
                model.SerializeToString(), options, providers=device.providers
            )
        with tempfile.TemporaryDirectory(prefix="onnxgrad-", ignore_cleanup_errors=True) as folder:
            path = Path(folder) / "model.onnx"
            _files.save_model(model, path)
            return ort.InferenceSession(str(path), options, providers=device.providers)
    except Exception as exc:
        if "ValidateOpsetForDomain" not in str(exc):
            raise
        opset = default_opset(model)
        raise ValueError(
            f"onnxruntime {ort.__version__} does not load default-domain opset {opset}, the "
            f"model's: convert the model to an older opset (onnx.version_converter."
            f"convert_version(model, {opset - 1})) or install a newer onnxruntime"
        ) from exc


class StepBuffers:
    """One set of the tensors a train step reads, on the device: weights and optimizer state.

    On the CPU, every ``OrtValue`` shares the memory of a numpy array, so the values can be
    read without a copy; in the ``'flat'`` layout the weight arrays are views of one flat
    array, the buffer the step writes its flat output into. The values named in ``in_place``
    are those of ``shared`` (the other set), not copies.
    """

    def __init__(
        self,
        step: TrainStep,
        device: Device,
        weights: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray],
        shared: StepBuffers | None = None,
        in_place: frozenset[str] = frozenset(),
    ):
        self.device = device
        self._shared = shared if in_place else None
        self._in_place = in_place
        self.host: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.values: dict[str, ort.OrtValue] = {}
        #: step output name -> the buffer of this set it writes into
        self.targets: dict[str, ort.OrtValue] = {}
        if step.layout == "flat":
            if device.kind != "cpu":
                raise ValueError(f"the 'flat' layout runs on the CPU only, not on {device}")
            flat = np.concatenate([np.asarray(weights[w]).ravel() for w in step.weights])
            for name, part in step.weight_slices.items():
                self._add(name, flat[part].reshape(step.weight_shapes[name]))
            self._add(step.flat_weights, flat)
            self.targets[step.new_weights[0]] = self.values[step.flat_weights]
        else:
            for name, new in zip(step.weights, step.new_weights):
                self._add(name, self._copy(weights, name))
                self.targets[new] = self.values[name]
        for name, new in zip(step.state, step.new_state):
            self._add(name, self._copy(state, name))
            self.targets[new] = self.values[name]

    def _copy(self, values: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
        if self._shared is not None and name in self._in_place:
            return None
        return np.array(values[name], copy=True)

    def _add(self, name: str, array: np.ndarray) -> None:
        if self._shared is not None and name in self._in_place:
            self.dtypes[name] = self._shared.dtypes[name]
            if name in self._shared.host:
                self.host[name] = self._shared.host[name]
            self.values[name] = self._shared.values[name]
            return
        self.dtypes[name] = array.dtype
        if self.device.kind == "cpu":
            self.host[name] = array
        self.values[name] = to_ortvalue(array, self.device)

    def numpy(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Host copies of the values ``names``."""
        if self.device.kind == "cpu":
            return {n: self.host[n].copy() for n in names}
        return {n: np.array(self.values[n].numpy(), copy=True) for n in names}

    def assign(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite values in place (the bindings keep pointing at the same buffers)."""
        for name, value in values.items():
            shape = tuple(self.values[name].shape())
            if tuple(np.shape(value)) != shape:
                raise ValueError(
                    f"{name!r}: new value of shape {np.shape(value)}, expected {shape}"
                )
            if self.device.kind == "cpu":
                np.copyto(self.host[name], value, casting="same_kind")
            else:
                array = c_contiguous(value, dtype=self.dtypes[name])
                self.values[name].update_inplace(array)


class TrainingRunner:
    """Runs a :class:`~onnxgrad.training.step.train_step.TrainStep` epoch after epoch.

    :param weights: initial weights by name; ``state``: initial optimizer state by input
        name of the step (default: :meth:`TrainStep.initial_state`); ``feeds``: the values
        of the step's :attr:`~TrainStep.fixed` inputs, bound to every batch.
    """

    indices_name = "batch_indices"

    def __init__(
        self,
        step: TrainStep,
        device: Device,
        weights: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray] | None = None,
        session_options: ort.SessionOptions | None = None,
        feeds: Mapping[str, np.ndarray] | None = None,
    ):
        self.step = step
        self.device = device
        self.feeds = FixedFeeds(step, device, feeds)
        self.model = with_batch_indices(step, self.indices_name)
        self.session = make_session(self.model, device, session_options)
        weights = _checked_values(weights, _weight_types(step), "weight")
        state = _checked_values(
            step.initial_state() if state is None else state, _state_types(step), "state"
        )
        first = StepBuffers(step, device, weights, state)
        self._sets = [first, StepBuffers(step, device, weights, state, first, in_place(step))]
        self._current = 0
        self._lr = np.zeros((), dtype=self._lr_dtype())
        self._lr_value = ort.OrtValue.ortvalue_from_numpy(self._lr)
        self._epoch: _EpochBindings | None = None

    def _lr_dtype(self) -> np.dtype:
        for info in self.model.graph.input:
            if info.name == self.step.learning_rate:
                return np_dtype(info.type.tensor_type.elem_type)
        raise AssertionError("the train step has no learning-rate input")

    # -- state ------------------------------------------------------------------------------
    @property
    def current(self) -> StepBuffers:
        """The buffers holding the latest weights and optimizer state."""
        return self._sets[self._current]

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.current.numpy(self.step.weights)

    def get_state(self) -> dict[str, np.ndarray]:
        """The optimizer state by input name of the step."""
        return self.current.numpy(self.step.state)

    def set_feeds(self, feeds: Mapping[str, np.ndarray] | None) -> None:
        """New values of the fixed inputs, bound from the next epoch on."""
        self.feeds = FixedFeeds(self.step, self.device, feeds)
        self._epoch = None

    def set_values(self, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite weights and/or optimizer state (by input name of the step)."""
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


def check_loader(
    step: TrainStep, model: ModelProto, loader: OrtDataLoader, feeds: FixedFeeds
) -> None:
    """Check that ``loader`` holds one array per data input of ``step`` (read from ``model``,
    the graph that takes them), each of its input's type and shape, and that ``feeds`` holds
    every fixed input; labels ``[N]`` or ``[N, 1]`` are first matched to the label's rank."""
    arrays = loader.arrays()
    if len(arrays) != len(step.data_inputs):
        raise ValueError(
            f"the train step expects the inputs {list(step.data_inputs)}, "
            f"the data loader holds {len(arrays)} arrays"
        )
    missing = [n for n in step.fixed if n not in feeds.values]
    if missing:
        raise ValueError(f"no value for the fixed inputs {missing}: see set_feeds")
    inputs = {i.name: i for i in model.graph.input}
    loader.match_label_rank(len(tensor_dims(inputs[step.label])))
    features = [f"X[{n!r}]" for n in step.features] if len(step.features) > 1 else ["X"]
    roles = (*features, "y", "sample_weight")
    for name, array, what in zip(step.data_inputs, loader.arrays(), roles):
        check_tensor(inputs[name], array, what)


class _EpochBindings:
    """The ``IOBinding`` of every (buffer set, batch) pair for one data loader."""

    def __init__(self, runner: TrainingRunner, loader: OrtDataLoader):
        self.loader = loader
        step = runner.step
        check_loader(step, step.model, loader, runner.feeds)
        data = loader.device_data()
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
        source, target = runner._sets[parity], runner._sets[1 - parity]
        binding = runner.session.io_binding()
        for name, value in zip(step.data_inputs, data):
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_input(runner.indices_name, self._indices[j])
        binding.bind_ortvalue_input(step.learning_rate, runner._lr_value)
        for name, value in {**source.values, **runner.feeds.values}.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in target.targets.items():
            binding.bind_ortvalue_output(name, value)
        binding.bind_ortvalue_output(step.loss, self._loss_values[j])
        return binding

    def shuffle(self) -> None:
        """Write the loader's next epoch order in place: every index ``OrtValue`` sees it."""
        self.order[:] = self.loader.epoch_order()


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
        # OrtValue.numpy() views the tensor's memory without keeping it alive: copy it
        return [np.array(v.numpy(), copy=True) for v in binding.get_outputs()]


def in_place(step: TrainStep) -> frozenset[str]:
    """The weights and state inputs of ``step`` its update may overwrite (one buffer each);
    in the ``'flat'`` layout the weights are views of one buffer read by the backward, so
    only the state."""
    updates = dict(zip(step.state, step.new_state))
    if step.layout == "per_weight":
        updates.update(zip(step.weights, step.new_weights))
    return frozenset(in_place_inputs(step.model, updates))


def _weight_types(step: TrainStep) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    inputs = {i.name: i for i in step.model.graph.input}
    return {
        w: (step.weight_shapes[w], np_dtype(inputs[w].type.tensor_type.elem_type))
        for w in step.weights
    }


def _state_types(step: TrainStep) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {name: (slot.shape, np_dtype(slot.elem_type)) for name, slot in step.state_slots.items()}


def _checked_values(
    values: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    what: str,
) -> dict[str, np.ndarray]:
    """``values`` in the order of ``expected`` (name -> shape, dtype), each with exactly
    that shape and dtype: a transposed weight must not be read as a reshaped one."""
    missing = [n for n in expected if n not in values]
    if missing:
        raise ValueError(f"no value for {what} {missing}")
    unknown = sorted(set(values) - set(expected))
    if unknown:
        raise ValueError(f"unknown {what} {unknown}, the train step's are {list(expected)}")
    arrays = {}
    for name, (shape, dtype) in expected.items():
        array = host_array(values[name])
        if array.dtype != dtype:
            raise TypeError(
                f"{what} {name!r} has dtype {array.dtype}, the train step expects {dtype}"
            )
        if array.shape != shape:
            raise ValueError(
                f"{what} {name!r} has shape {array.shape}, the train step expects {shape}"
            )
        arrays[name] = array
    return arrays


__all__ = ["GraphRunner", "StepBuffers", "TrainingRunner", "make_session"]
