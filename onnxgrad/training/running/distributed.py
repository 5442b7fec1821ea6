"""Data-parallel training on ``torch.distributed``: one onnxruntime session per rank.

Every rank (a process started by ``torchrun``, or by Ray Train's ``TorchTrainer``) holds
the same model and data. A global batch of ``B = world_size * batch_size`` rows is split
as ``DistributedSampler`` splits an epoch: rank ``r`` takes rows ``r, r + R, r + 2R...`` of
it, so every row is used once per epoch across the ranks and the union of the shards is
the batch one process would take with ``batch_size = B``. Each step:

1. the gradient graph runs on the rank's shard: ``g_r = dL_r/dW`` and the loss ``L_r``;
2. ``g = sum_r c_r g_r`` by the process group's all-reduce (gloo on the CPU), with
   ``c_r = 1`` for a loss summed over the batch and ``c_r = W_r / W`` for a mean
   (``W_r``: the rank's rows, or their sample weights; ``W``: the batch's), so ``g`` is the
   gradient of the loss of the whole batch; the loss rides in the same buffer;
3. the update graph adds the penalty's gradient and applies the optimizer: the same
   arithmetic on every rank, so the weights stay identical (checked every
   ``check_every`` steps by a CRC of the weights, all-reduced).

The fused single-process step cannot serve here: its update needs the reduced gradient
before the step ends. Splitting it costs one more session run per step (measured in
``benchmarks/bench_distributed.py``); the single-process path keeps the fused step.

``torch`` is imported only when a runner starts (the extra ``onnxgrad[distributed]``).

The estimators and ``onnxgrad train`` switch to this runner by themselves when
``WORLD_SIZE > 1``. Below them, the same pieces by hand, in a script every rank runs::

    step = make_split_step(model, loss=..., learning_rate=...)   # split_step.py
    runner = DistributedRunner(step, check_device("cpu"), weights)
    loader = OrtDataLoader(X, y, batch_size=world_size() * 32, random_state=0)
    losses = runner.run_epoch(loader, 0.01)                       # one epoch, all ranks
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import zlib
from collections.abc import Iterator, Mapping
from datetime import timedelta

import numpy as np
import onnxruntime as ort
from onnx import ModelProto

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.training.running.data import OrtDataLoader
from onnxgrad.training.running.devices import Device
from onnxgrad.training.running.feeds import FixedFeeds
from onnxgrad.training.running.runner import (
    StepBuffers,
    TrainingRunner,
    _checked_values,
    _state_types,
    _weight_types,
    check_loader,
    make_session,
)
from onnxgrad.training.step.composition import with_batch_indices
from onnxgrad.training.step.split_step import SplitStep
from onnxgrad.training.step.train_step import TrainStep

#: seconds a collective waits for the other ranks before it fails (``ONNXGRAD_DIST_TIMEOUT``)
DEFAULT_TIMEOUT = 300.0


class DistributedError(RuntimeError):
    """Another rank died, hung, or disagrees with this one."""


def _torch():
    try:
        import torch
        import torch.distributed
    except ImportError as exc:
        raise ImportError(
            "data-parallel training needs torch.distributed: pip install 'onnxgrad[distributed]'"
        ) from exc
    return torch


def _initialized_group():
    """``torch.distributed`` when torch is already loaded and its group started, else None
    (never imports torch)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def world_size() -> int:
    """The ranks of the job: the started process group's, else torchrun's ``WORLD_SIZE``
    (1 outside a distributed launch)."""
    dist = _initialized_group()
    if dist is not None:
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} is not a number of processes") from None


def rank() -> int:
    """This process's rank (0 outside a distributed launch)."""
    dist = _initialized_group()
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", "0")) if world_size() > 1 else 0


def data_parallel() -> bool:
    """Whether this process is one of several ranks: training is then data-parallel."""
    return world_size() > 1


def threads_per_rank() -> int | None:
    """onnxruntime's threads for one rank: ``OMP_NUM_THREADS`` when several ranks share the
    machine (torchrun sets it to 1 unless told), else None (onnxruntime's choice)."""
    value = os.environ.get("OMP_NUM_THREADS")
    return int(value) if data_parallel() and value and value.isdigit() else None


@contextlib.contextmanager
def rank0_prints() -> Iterator[None]:
    """Silence the standard output of every rank but 0 (progress is printed once)."""
    if rank() == 0:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def timeout_seconds() -> float:
    """How long a collective waits for the other ranks (``ONNXGRAD_DIST_TIMEOUT``)."""
    value = os.environ.get("ONNXGRAD_DIST_TIMEOUT")
    if value is None:
        return DEFAULT_TIMEOUT
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"ONNXGRAD_DIST_TIMEOUT must be a positive number, got {value!r}")
    return seconds


def process_group(device: Device):
    """``torch.distributed``, its default group started (gloo on the CPU, NCCL on CUDA, with
    :func:`timeout_seconds`) unless a launcher such as Ray Train started it already."""
    dist = _torch().distributed
    if not dist.is_initialized():
        backend = "nccl" if device.kind == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_seconds()))
        atexit.register(_close, dist)
    return dist


def finish() -> None:
    """Wait for every rank, then close the process group (the end of a job: no rank tears
    its connections down while another still uses them)."""
    dist = _initialized_group()
    if dist is None:
        return
    with collective("waiting for the other ranks to finish"):
        dist.barrier()
    dist.destroy_process_group()


def _close(dist) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a failed collective into a :class:`DistributedError` that says which."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, DistributedError):
            raise
        raise DistributedError(
            f"rank {rank()} of {world_size()}: {what} failed: another rank died or did not "
            f"answer within {timeout_seconds():g} s (ONNXGRAD_DIST_TIMEOUT) ({exc})"
        ) from exc


def agreed(value: float) -> float:
    """``value`` as rank 0 has it, on every rank (a stopping decision taken by all)."""
    if not data_parallel():
        return value
    torch = _torch()
    tensor = torch.tensor([value], dtype=torch.float64)
    with collective("agreeing on a validation score"):
        torch.distributed.broadcast(tensor, 0)
    return float(tensor[0])


def check_same_everywhere(values: Mapping[str, object]) -> None:
    """Refuse to start when any rank's ``values`` (what it was given: model, data...) differ
    from rank 0's; the error names what differs and on which ranks."""
    dist = _initialized_group()
    if dist is None or dist.get_world_size() == 1:
        return
    gathered: list = [None] * dist.get_world_size()
    with collective("comparing the ranks' models and data"):
        dist.all_gather_object(gathered, dict(values))
    reference = gathered[0]
    differing = {
        name: [r for r, other in enumerate(gathered) if other.get(name) != value]
        for name, value in reference.items()
    }
    differing = {name: ranks for name, ranks in differing.items() if ranks}
    if differing:
        listed = "; ".join(f"{name} (ranks {ranks})" for name, ranks in differing.items())
        raise DistributedError(
            f"the ranks were not given the same inputs: {listed} differ from rank 0's; every "
            "rank must load the same model and the same data (each takes its shard itself)"
        )


def digest(*arrays: np.ndarray) -> str:
    """A CRC-32 of the shapes, dtypes and bytes of ``arrays``."""
    crc = 0
    for array in arrays:
        array = np.ascontiguousarray(array)
        crc = zlib.crc32(f"{array.dtype.str}{array.shape}".encode(), crc)
        crc = zlib.crc32(memoryview(array).cast("B"), crc)
    return f"{crc:08x}"


def model_digest(model: ModelProto) -> str:
    return f"{zlib.crc32(model.SerializeToString(deterministic=True)):08x}"


# -- runner ---------------------------------------------------------------------------------
class DistributedRunner:
    """:class:`~onnxgrad.training.running.runner.TrainingRunner`'s interface for a
    :class:`SplitStep` on one rank of a started (or startable) ``torch.distributed`` group.

    :meth:`run_epoch` takes the loader of the *global* batches (``world_size`` times the
    per-rank batch size); every rank must hold the same data, model and weights (checked).

    :param check_every: steps between two checks that the ranks' weights are identical
    """

    indices_name = "batch_indices"

    def __init__(
        self,
        step: SplitStep,
        device: Device,
        weights: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray] | None = None,
        session_options: ort.SessionOptions | None = None,
        check_every: int = 100,
    ):
        if device.kind != "cpu":
            raise ValueError(f"data-parallel training runs on the CPU (gloo) only, not on {device}")
        self.dist = process_group(device)
        self.torch = _torch()
        self.step = step
        self.device = device
        self.check_every = int(check_every)
        self.model = with_batch_indices(step.gradient_model, self.indices_name)
        self.session = make_session(self.model, device, session_options)
        self.update_session = make_session(step.model, device, session_options)
        weights = _checked_values(weights, _weight_types(step), "weight")
        state = _checked_values(
            step.initial_state() if state is None else state, _state_types(step), "state"
        )
        check_same_everywhere(
            {
                "the gradient graph": model_digest(step.gradient),
                "the update graph": model_digest(step.model),
                "the initial weights": digest(*weights.values()),
                "the optimizer state": digest(*state.values()),
            }
        )
        self._sets = [StepBuffers(step, device, weights, state) for _ in range(2)]
        self._current = 0
        dtype = np_dtype(step.gradient.graph.output[len(step.weights)].type.tensor_type.elem_type)
        size = sum(s.stop - s.start for s in step.weight_slices.values())
        #: the gradients end to end, then the loss: the buffer the all-reduce sums
        self._reduced = np.zeros(size + 1, dtype=dtype)
        self._reduced_tensor = self.torch.from_numpy(self._reduced)
        self._grads = {
            w: ort.OrtValue.ortvalue_from_numpy(self._reduced[s].reshape(step.weight_shapes[w]))
            for w, s in step.weight_slices.items()
        }
        self._loss = ort.OrtValue.ortvalue_from_numpy(self._reduced[size:].reshape(()))
        self._penalty = np.zeros((), dtype=dtype)
        self._penalty_value = ort.OrtValue.ortvalue_from_numpy(self._penalty)
        self._lr = np.zeros((), dtype=self._input_dtype(step.learning_rate))
        self._lr_value = ort.OrtValue.ortvalue_from_numpy(self._lr)
        self._updates = [self._bind_update(parity) for parity in (0, 1)]
        self._reduction = step.reduction
        self._shards: _Shards | None = None
        self.steps = 0
        self.feeds = FixedFeeds(step, device, None)

    def set_feeds(self, feeds: Mapping[str, np.ndarray] | None) -> None:
        """Fixed inputs are not fed to data-parallel steps yet: refused by name."""
        if feeds:
            raise ValueError(
                f"data-parallel training does not take fixed inputs yet ({sorted(feeds)}): "
                "train in one process"
            )

    def _input_dtype(self, name: str) -> np.dtype:
        info = next(i for i in self.step.model.graph.input if i.name == name)
        return np_dtype(info.type.tensor_type.elem_type)

    # -- state, as TrainingRunner ------------------------------------------------------------
    current = TrainingRunner.current
    get_weights = TrainingRunner.get_weights
    get_state = TrainingRunner.get_state
    set_values = TrainingRunner.set_values

    @property
    def rank(self) -> int:
        return self.dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.dist.get_world_size()

    # -- training ---------------------------------------------------------------------------
    def run_epoch(self, loader: OrtDataLoader, learning_rate: float) -> np.ndarray:
        """One epoch of global batches of ``loader`` (rank 0's shuffle); returns the loss of
        each global batch with the weights before its update (penalty included)."""
        if self._shards is None or self._shards.loader is not loader:
            self._shards = _Shards(self, loader)
            self._reduction = self._reduction or probe_reduction(self, loader.device_data())
        shards = self._shards
        order = loader.epoch_order()
        ranks = self.world_size
        if ranks > 1:
            with collective("sharing the epoch's row order"):
                self.dist.broadcast(self.torch.from_numpy(order), 0)
        shards.shuffle(order, self._reduction == "mean")
        self._lr[...] = learning_rate
        losses = np.zeros(len(shards.coefficients), dtype=self._reduced.dtype)
        parity = self._current
        for j, coefficient in enumerate(shards.coefficients):
            if coefficient:
                self.session.run_with_iobinding(shards.bindings[parity][j])
                if coefficient != 1:
                    self._reduced *= coefficient
            else:
                self._reduced[:] = 0
            if ranks > 1:
                self._all_reduce()
            self.update_session.run_with_iobinding(self._updates[parity])
            losses[j] = self._reduced[-1] + self._penalty
            parity ^= 1
            self._current = parity
            self.steps += 1
            if ranks > 1 and self.steps % self.check_every == 0:
                self.check_weights()
        return losses

    def _all_reduce(self) -> None:
        try:
            self.dist.all_reduce(self._reduced_tensor)
        except RuntimeError as exc:
            with collective(f"the gradients' all-reduce of step {self.steps + 1}"):
                raise exc from None

    def check_weights(self) -> None:
        """Raise :class:`DistributedError` naming the step when the ranks' weights differ."""
        flat = self.current.host[self.step.flat_weights]
        crc = zlib.crc32(memoryview(flat).cast("B"))
        tensor = self.torch.tensor([crc, -crc], dtype=self.torch.int64)
        with collective(f"the weights' check after step {self.steps}"):
            self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        if int(tensor[0]) != -int(tensor[1]):
            raise DistributedError(
                f"the ranks' weights differ after step {self.steps} (CRC-32 of rank "
                f"{self.rank}: {crc:08x}): a rank ran different graphs or data"
            )

    def _bind_update(self, parity: int) -> ort.IOBinding:
        source, target = self._sets[parity], self._sets[1 - parity]
        binding = self.update_session.io_binding()
        needed = {i.name for i in self.update_session.get_inputs()}
        for name, value in source.values.items():
            if name in needed:
                binding.bind_ortvalue_input(name, value)
        for name, w in zip(self.step.gradients, self.step.weights):
            binding.bind_ortvalue_input(name, self._grads[w])
        binding.bind_ortvalue_input(self.step.learning_rate, self._lr_value)
        for name, value in target.targets.items():
            binding.bind_ortvalue_output(name, value)
        binding.bind_ortvalue_output(self.step.loss, self._penalty_value)
        return binding

    def _bind_gradient(self, data, indices: ort.OrtValue, parity: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        for name, value in zip(self.step.data_inputs, data):
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_input(self.indices_name, indices)
        needed = {i.name for i in self.session.get_inputs()}
        for name, value in self._sets[parity].values.items():
            if name in needed:
                binding.bind_ortvalue_input(name, value)
        outputs = [o.name for o in self.session.get_outputs()]
        for name, w in zip(outputs, self.step.weights):
            binding.bind_ortvalue_output(name, self._grads[w])
        binding.bind_ortvalue_output(outputs[len(self.step.weights)], self._loss)
        return binding

    def loss_on_rows(self, rows: np.ndarray, data) -> float:
        """The gradient graph's loss on the rows ``rows`` of the data (a probe)."""
        indices = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        self.session.run_with_iobinding(self._bind_gradient(data, indices, self._current))
        return float(self._reduced[-1])


class _Shards:
    """This rank's rows of every global batch of a loader, and their bindings."""

    def __init__(self, runner: DistributedRunner, loader: OrtDataLoader):
        self.loader = loader
        step = runner.step
        check_loader(step, step.gradient, loader, runner.feeds)
        arrays = loader.arrays()
        n, size, ranks = len(loader), loader.batch_size, runner.world_size
        check_same_everywhere(
            {
                "the training data": digest(*arrays),
                "the global batch size": size,
                "the rows": n,
            }
        )
        self.sample_weight = loader.sample_weight
        self.starts = np.arange(0, n, size)
        self.ends = np.minimum(self.starts + size, n)
        pieces = [np.arange(s + runner.rank, e, ranks) for s, e in zip(self.starts, self.ends)]
        self.sizes = np.array([len(p) for p in pieces])
        self.positions = np.concatenate(pieces).astype(np.int64)
        self.rows = np.zeros(len(self.positions), dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.offsets = offsets
        data = loader.device_data()
        indices = [
            ort.OrtValue.ortvalue_from_numpy(self.rows[a:b]) if b > a else None
            for a, b in itertools.pairwise(offsets)
        ]
        self.bindings = [
            [None if i is None else runner._bind_gradient(data, i, parity) for i in indices]
            for parity in (0, 1)
        ]
        self.coefficients = np.zeros(len(pieces))

    def shuffle(self, order: np.ndarray, mean: bool) -> None:
        """Take this rank's rows of ``order`` and each batch's share ``c_r`` of the loss
        (``mean``: a loss averaged over the batch)."""
        self.rows[:] = order[self.positions]
        if not mean:
            self.coefficients[:] = self.sizes > 0
            return
        weight = np.ones(len(order)) if self.sample_weight is None else self.sample_weight
        weight = np.asarray(weight, dtype=np.float64)
        total = _segment_sums(weight[order], self.starts, self.ends)
        mine = _segment_sums(weight[self.rows], self.offsets[:-1], self.offsets[1:])
        self.coefficients[:] = np.divide(mine, total, out=np.zeros_like(mine), where=total > 0)


def _segment_sums(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    cumulated = np.concatenate([[0.0], np.cumsum(values)])
    return cumulated[ends] - cumulated[starts]


def probe_reduction(runner: DistributedRunner, data) -> str:
    """``'sum'`` or ``'mean'``: how the model's own loss output reduces a batch, told from
    its value on one row and on that row twice (``2 L`` for a sum, ``L`` for a mean)."""
    for row in range(min(int(data[0].shape()[0]), 16)):
        once = runner.loss_on_rows(np.array([row]), data)
        twice = runner.loss_on_rows(np.array([row, row]), data)
        if once != 0 and np.isfinite(once):
            if np.isclose(twice, 2 * once, rtol=1e-4):
                return "sum"
            if np.isclose(twice, once, rtol=1e-4):
                return "mean"
            break
    raise ValueError(
        f"cannot tell whether the loss output of the model sums or averages a batch: "
        f"data-parallel training needs one of them (the gradient graph's outputs: "
        f"{[o.name for o in runner.model.graph.output]})"
    )


def make_runner(
    step: TrainStep,
    device: Device,
    weights: Mapping[str, np.ndarray],
    state: Mapping[str, np.ndarray] | None = None,
    session_options: ort.SessionOptions | None = None,
):
    """A :class:`DistributedRunner` for a :class:`SplitStep`, else a ``TrainingRunner``."""
    runner = DistributedRunner if isinstance(step, SplitStep) else TrainingRunner
    return runner(step, device, weights, state, session_options)


__all__ = [
    "DistributedError",
    "DistributedRunner",
    "agreed",
    "data_parallel",
    "finish",
    "make_runner",
    "rank",
    "rank0_prints",
    "threads_per_rank",
    "world_size",
]
