"""The update half of a train step: optimizer state inputs, the inlined update graph, and
:class:`TrainStep`, which names the role of every input and output of the fused graph.

Two layouts of the update:

* ``'per_weight'``: one update graph per weight tensor, one output per new weight and per
  state tensor;
* ``'flat'``: the gradients are flattened and concatenated (in the order of
  :attr:`TrainStep.weights`), one update graph runs on the whole vector, the optimizer
  state is flat too and the step returns the new weights as one flat vector. The weights
  come in twice: one input per weight for the forward pass, and the input
  :attr:`TrainStep.flat_weights` which must hold the same values end to end (as fused
  optimizers keep flat parameter buffers). The runner lays the weight buffers in one flat
  array and binds views of it, so both come without a copy and the flat output feeds the
  next step as it is. Fewer and larger kernels than ``'per_weight'``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, TensorProto, ValueInfoProto, helper

from onnxgrad._onnx_utils import default_opset, finalize_model, np_dtype
from onnxgrad.derivative.autodiff.cleanup import clean_graph
from onnxgrad.derivative.leaf_order import readiness_order
from onnxgrad.training.step._builder import StepBuilder, rename_values
from onnxgrad.training.step._inputs import tensor_dims
from onnxgrad.training.step.learning_rate import BaseLearningRate

LAYOUTS = ("per_weight", "flat")

#: the largest number of weight elements the default layout updates end to end on the CPU
FLAT_MAX_ELEMENTS = 1 << 20


def default_layout(model: ModelProto, weights: Sequence[str], device_kind: str) -> str:
    """``'flat'`` on the CPU for at most :data:`FLAT_MAX_ELEMENTS` weight elements (fewer,
    larger kernels where kernel calls dominate), else ``'per_weight'``.

    The flat update holds every gradient until their concatenation and runs on vectors of
    the whole model: about one more copy of the weights at the step's peak (resnet18,
    11.7M weights, batch 16: 272 against 225 MiB), and slower once the vectors leave the
    caches (flat 454 ms, per weight 354 ms of CPU a step, one thread).
    """
    if device_kind != "cpu":
        return "per_weight"
    wanted = set(weights)
    size = sum(
        int(np.prod(init.dims, dtype=np.int64))
        for init in model.graph.initializer
        if init.name in wanted
    )
    return "flat" if size <= FLAT_MAX_ELEMENTS else "per_weight"


@dataclass(frozen=True)
class StateSlot:
    """What one optimizer-state input holds: the state ``suffix`` of ``weight`` (per-weight
    layout), of every weight end to end (``weight=None``, flat layout), or a ``shared``
    ``[1]`` tensor; its shape and initial value."""

    suffix: str
    weight: str | None
    shared: bool
    shape: tuple[int, ...]
    initial: float
    elem_type: int


class DataRoles:
    """The inputs of a graph fed with one row per observation, by role; :attr:`fixed`:
    the other data inputs, fed the same value at every step (a sample rate, an initial
    recurrent state)."""

    features: tuple[str, ...]
    label: str
    sample_weight: str | None
    fixed: tuple[str, ...]

    @property
    def data_inputs(self) -> tuple[str, ...]:
        """Inputs fed with one row per observation: features, label, sample weight."""
        weight = (self.sample_weight,) if self.sample_weight else ()
        return (*self.features, self.label, *weight)


@dataclass(frozen=True)
class TrainStep(DataRoles):
    """The fused train step and the role of each of its inputs and outputs.

    Inputs: :attr:`data_inputs` (a batch), :attr:`weights`, :attr:`state`, and the scalar
    :attr:`learning_rate`. Outputs: :attr:`loss`, :attr:`new_weights` (one per weight, or
    one flat vector in the ``'flat'`` layout), :attr:`new_state` (same order as
    :attr:`state`).
    """

    model: ModelProto
    features: tuple[str, ...]
    label: str
    sample_weight: str | None
    weights: tuple[str, ...]
    weight_shapes: Mapping[str, tuple[int, ...]]
    new_weights: tuple[str, ...]
    state: tuple[str, ...]
    new_state: tuple[str, ...]
    state_slots: Mapping[str, StateSlot]
    learning_rate: str
    loss: str
    layout: str
    #: the flat weight vector input (``'flat'`` layout only)
    flat_weights: str | None = None
    fixed: tuple[str, ...] = ()

    @property
    def weight_slices(self) -> dict[str, slice]:
        """Where each weight lies in the flat vector of the ``'flat'`` layout."""
        slices, start = {}, 0
        for name in self.weights:
            size = int(np.prod(self.weight_shapes[name], dtype=np.int64))
            slices[name] = slice(start, start + size)
            start += size
        return slices

    def weight_inputs(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs carrying ``weights`` (by weight name): one per weight, plus the flat
        vector in the ``'flat'`` layout."""
        inputs = {w: np.asarray(weights[w]) for w in self.weights}
        if self.flat_weights is not None:
            inputs[self.flat_weights] = np.concatenate([inputs[w].ravel() for w in self.weights])
        return inputs

    def initial_state(self) -> dict[str, np.ndarray]:
        """Fresh optimizer state by input name (zeros, step counts...). Zeros are allocated
        lazily (``np.zeros``): a state only saved takes no memory until it is written."""
        return {
            name: _filled(slot.shape, slot.initial, slot.elem_type)
            for name, slot in self.state_slots.items()
        }

    def unpack_weights(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The new weights by weight name from the step's outputs (any layout)."""
        if self.layout == "per_weight":
            return {w: outputs[n] for w, n in zip(self.weights, self.new_weights)}
        flat = outputs[self.new_weights[0]]
        return {w: flat[s].reshape(self.weight_shapes[w]) for w, s in self.weight_slices.items()}

    def state_by_weight(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Optimizer state keyed ``<weight>_<suffix>`` (shared tensors by suffix), whatever
        the layout: the names :meth:`state_inputs` reads back."""
        named = {}
        slices = self.weight_slices
        for name, slot in self.state_slots.items():
            value = state[name]
            if slot.shared:
                named[slot.suffix] = value
            elif slot.weight is not None:
                named[f"{slot.weight}_{slot.suffix}"] = value
            else:
                for w, s in slices.items():
                    named[f"{w}_{slot.suffix}"] = value[s].reshape(self.weight_shapes[w])
        return named

    def state_inputs(self, named: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inverse of :meth:`state_by_weight`: values by state input name."""
        state = {}
        for name, slot in self.state_slots.items():
            if slot.shared:
                state[name] = np.asarray(named[slot.suffix])
            elif slot.weight is not None:
                state[name] = np.asarray(named[f"{slot.weight}_{slot.suffix}"])
            else:
                state[name] = np.concatenate(
                    [np.asarray(named[f"{w}_{slot.suffix}"]).ravel() for w in self.weights]
                )
        return state


def _filled(shape, value: float, elem_type: int) -> np.ndarray:
    dtype = np_dtype(elem_type)
    return np.zeros(shape, dtype) if value == 0 else np.full(shape, value, dtype)


def append_update(
    gradient: ModelProto,
    roles: Mapping[str, object],
    weights: Sequence[str],
    learning_rate: BaseLearningRate,
    layout: str,
) -> TrainStep:
    """Append the optimizer's update to a gradient graph (outputs: gradients, then loss,
    then any others, kept last).

    ``roles`` holds ``features``, ``label``, ``sample_weight`` (and optionally ``fixed``) of
    the data inputs.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}, expected one of {list(LAYOUTS)}")
    graph = gradient.graph
    b = StepBuilder(graph, default_opset(gradient))
    outputs = list(graph.output)
    grads = dict(zip(weights, [o.name for o in outputs[: len(weights)]]))
    loss_info = outputs[len(weights)]
    elem_type = loss_info.type.tensor_type.elem_type
    typed = {i.name: i for i in graph.input}
    shapes = {w: _static_shape(typed[w]) for w in weights}

    lr = b.input("learning_rate", elem_type, [])
    flat_weights = None
    if layout == "flat":
        size = sum(int(np.prod(shapes[w], dtype=np.int64)) for w in weights)
        flat_weights = b.input("weights", elem_type, [size])
        slots, results = _emit_flat(
            b, learning_rate, weights, grads, flat_weights, size, lr, elem_type
        )
    else:
        slots, results = _emit_per_weight(b, learning_rate, weights, grads, shapes, lr, elem_type)
    renames = {value: b.names.unique(f"{key}_new") for key, value in results.items()}
    rename_values(graph, renames)
    new_infos = []
    for key, value in results.items():
        shape = slots[key].shape if key in slots else _new_weight_shape(key, shapes, layout)
        new_infos.append(
            helper.make_tensor_value_info(renames[value], _type_of(key, slots, elem_type), shape)
        )
    extra = outputs[len(weights) + 1 :]
    del graph.output[:]
    graph.output.extend([loss_info, *new_infos, *extra])
    for name in (flat_weights, *slots, lr):
        if name is not None:
            _move_input_to_end(graph, name)
    new_names = [renames[v] for v in results.values()]
    n_weights = len(new_names) - len(slots)
    clean_graph(graph)
    return TrainStep(
        model=finalize_model(gradient),
        features=tuple(roles["features"]),
        label=roles["label"],
        sample_weight=roles["sample_weight"],
        weights=tuple(weights),
        weight_shapes=shapes,
        new_weights=tuple(new_names[:n_weights]),
        state=tuple(slots),
        new_state=tuple(new_names[n_weights:]),
        state_slots=slots,
        learning_rate=lr,
        loss=loss_info.name,
        layout=layout,
        flat_weights=flat_weights,
        fixed=tuple(roles.get("fixed", ())),
    )


_FLAT = "weights"


def _emit_per_weight(b, learning_rate, weights, grads, shapes, lr, elem_type):
    """One update graph per weight; returns the state slots and ``{input: new value}``."""
    slots = _shared_slots(b, learning_rate, elem_type)
    per_weight = {w: {} for w in weights}
    for w in weights:
        for spec in learning_rate.state_specs:
            if not spec.shared:
                name = b.input(f"{w}_{spec.suffix}", elem_type, list(shapes[w]))
                per_weight[w][spec.suffix] = name
                slots[name] = StateSlot(spec.suffix, w, False, shapes[w], spec.initial, elem_type)
    shared = {slot.suffix: name for name, slot in slots.items() if slot.shared}
    feeds, new_shared = learning_rate.emit_shared(b, lr, shared, elem_type)
    new_weights, new_state = {}, {shared[k]: v for k, v in new_shared.items()}
    for w in _by_readiness(b, weights, grads):
        new_w, new_s = learning_rate.emit_update(b, w, grads[w], per_weight[w], feeds, elem_type)
        new_weights[w] = _keep_shape(b, new_w, shapes[w])
        for suffix, name in per_weight[w].items():
            new_state[name] = _keep_shape(b, new_s[suffix], shapes[w])
    return slots, {**{w: new_weights[w] for w in weights}, **{k: new_state[k] for k in slots}}


def _emit_flat(b, learning_rate, weights, grads, flat_weights, size, lr, elem_type):
    """One update graph on the flat weights and the concatenated gradients; returns the
    state slots and ``{input: new value}``."""
    slots = _shared_slots(b, learning_rate, elem_type)
    flat_state = {}
    for spec in learning_rate.state_specs:
        if not spec.shared:
            name = b.input(spec.suffix, elem_type, [size])
            flat_state[spec.suffix] = name
            slots[name] = StateSlot(spec.suffix, None, False, (size,), spec.initial, elem_type)
    shared = {slot.suffix: name for name, slot in slots.items() if slot.shared}
    feeds, new_shared = learning_rate.emit_shared(b, lr, shared, elem_type)
    ready = [grads[w] for w in _by_readiness(b, weights, grads)]
    flat_grads = _concat_flat(b, [grads[w] for w in weights], ready)
    new_w, new_s = learning_rate.emit_update(
        b, flat_weights, flat_grads, flat_state, feeds, elem_type
    )
    new_state = {shared[k]: v for k, v in new_shared.items()}
    new_state.update({name: new_s[suffix] for suffix, name in flat_state.items()})
    return slots, {_FLAT: new_w, **{k: new_state[k] for k in slots}}


def _shared_slots(b, learning_rate, elem_type) -> dict[str, StateSlot]:
    slots = {}
    for spec in learning_rate.state_specs:
        if spec.shared:
            spec_type = spec.elem_type or elem_type
            name = b.input(spec.suffix, spec_type, [1])
            slots[name] = StateSlot(spec.suffix, None, True, (1,), spec.initial, spec_type)
    return slots


def _by_readiness(b: StepBuilder, weights: Sequence[str], grads: Mapping[str, str]) -> list[str]:
    """``weights`` in the order to emit their update nodes: the readiest gradient last
    (:func:`~onnxgrad.derivative.leaf_order.readiness_order`), so that onnxruntime runs each
    weight's gradient and update as soon as the backward reaches it."""
    weight_of = {grads[w]: w for w in weights}
    return [weight_of[g] for g in readiness_order(b.graph, [grads[w] for w in weights])]


def _concat_flat(b: StepBuilder, names: list[str], order: Sequence[str]) -> str:
    """``Concat`` of the flattened ``names`` (in their order), the pieces emitted in
    ``order``."""
    shape = b.const(np.array([-1], dtype=np.int64), TensorProto.INT64, "flat_shape")
    flat = {name: b.op("Reshape", name, shape) for name in order}
    pieces = [flat[name] for name in names]
    return pieces[0] if len(pieces) == 1 else b.op("Concat", *pieces, axis=0)


def _new_weight_shape(key: str, shapes, layout: str) -> list:
    if layout == "flat":
        return [sum(int(np.prod(s, dtype=np.int64)) for s in shapes.values())]
    return list(shapes[key])


def _type_of(key: str, slots: Mapping[str, StateSlot], elem_type: int) -> int:
    return slots[key].elem_type if key in slots else elem_type


def _keep_shape(b: StepBuilder, value: str, shape: tuple) -> str:
    """The authored graphs broadcast against ``[1]`` parameters: rank-0 weights get their
    shape back."""
    if shape:
        return value
    return b.op("Reshape", value, b.const(np.zeros((0,), dtype=np.int64), TensorProto.INT64))


def _static_shape(info: ValueInfoProto) -> tuple[int, ...]:
    dims = tensor_dims(info)
    if None in dims:
        raise ValueError(f"weight {info.name!r} has no static shape")
    return tuple(dims)


def _move_input_to_end(graph, name: str) -> None:
    inputs = list(graph.input)
    del graph.input[:]
    graph.input.extend(
        [i for i in inputs if i.name != name] + [i for i in inputs if i.name == name]
    )


__all__ = [
    "FLAT_MAX_ELEMENTS",
    "LAYOUTS",
    "StateSlot",
    "TrainStep",
    "append_update",
    "default_layout",
]
