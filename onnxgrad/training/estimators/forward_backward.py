"""A model's forward and backward as two onnxruntime sessions (onnxcustom's
``OrtGradientForwardBackward``), built on onnxgrad's own gradient graph: standard ONNX
operators, any onnxruntime, no PyTorch.

``forward([x..., w...])`` runs ``y = f(x, w)`` and keeps its inputs; ``backward([g...])``
returns the vector-Jacobian products ``[g . dy/dx..., g . dy/dw...]`` at those inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from onnx import ModelProto
from onnxruntime import InferenceSession, SessionOptions
from onnxruntime.capi._pybind_state import OrtValue as C_OrtValue

from onnxgrad._onnx_utils import ModelLike, load_model, real_inputs
from onnxgrad.derivative.api import onnx_derivative
from onnxgrad.graph.initializers import get_train_initializer
from onnxgrad.normalize import normalized_model
from onnxgrad.training.running.ort_devices import get_ort_device_from_session, numpy_to_ort_value
from onnxgrad.training.running.session_options import training_session_options
from onnxgrad.training.step.composition import weights_as_inputs

logger = logging.getLogger("onnxgrad.training")

_KNOWN_PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider")


class ForwardBackwardGraphs:
    """The graphs and sessions one :class:`OrtGradientForwardBackward` shares with its
    instances (onnxcustom's ``cls_type_``), under onnxcustom's attribute names."""

    def __init__(self, model: ModelProto, weights: list[str], session_args: dict, debug: bool):
        self._weights_to_train = weights
        self._input_names = [i.name for i in real_inputs(model)]
        self._output_names = [o.name for o in model.graph.output]
        self._trained_onnx = weights_as_inputs(model, weights)
        gradient = onnx_derivative(model, weights=weights)
        self._grad_input_names = self._input_names + weights
        self._bw_fetches_names = [f"{n}_grad" for n in self._grad_input_names]
        missing = sorted(set(self._bw_fetches_names) - {o.name for o in gradient.graph.output})
        if missing:
            raise ValueError(f"the gradient graph does not return {missing}")
        self._onx_inp = list(self._grad_input_names)
        self._onx_out = list(self._bw_fetches_names)
        self._gradient_onnx = gradient
        self._optimized_pre_grad_model = model if debug else None
        self._weight_shapes = {
            i.name: list(i.dims) for i in model.graph.initializer if i.name in weights
        }
        self._sess_eval = InferenceSession(self._trained_onnx.SerializeToString(), **session_args)
        self._sess_grad = InferenceSession(gradient.SerializeToString(), **session_args)
        self.device = get_ort_device_from_session(self._sess_eval)


class OrtGradientForwardBackward:
    """Forward and backward of ``onx`` for the weights ``weights_to_train`` (default: every
    weight :func:`onnxgrad.get_train_initializer` offers), onnxcustom's signature.

    :meth:`new_instance` gives the object whose ``forward(inputs, training=False)`` and
    ``backward(grad_outputs)`` run the graphs; inputs are the model's inputs then the
    weights (numpy arrays, OrtValues or an ``OrtValueVector``); the backward returns one
    gradient per such input, in that order. ``providers`` lists onnxruntime's execution
    providers (default: CPU); ``sess_options`` defaults to the training sessions' options
    (:mod:`onnxgrad.training.running.session_options`)."""

    def __init__(
        self,
        onx: ModelLike,
        weights_to_train: Sequence[str] | None = None,
        sess_options: SessionOptions | None = None,
        providers: Sequence[str] | None = None,
        enable_logging: bool = False,
        debug: bool = False,
    ):
        self.onx = load_model(onx)
        self.weights_to_train = weights_to_train
        self.sess_options = sess_options
        self.providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self.enable_logging = enable_logging
        self.debug = debug
        unknown = [p for p in self.providers if p not in _KNOWN_PROVIDERS]
        if unknown:
            raise ValueError(f"unknown execution providers {unknown}, use {_KNOWN_PROVIDERS}")
        self.cls_type_ = self._build()

    def _build(self) -> ForwardBackwardGraphs:
        model = normalized_model(self.onx)
        if self.weights_to_train is None:
            weights = list(get_train_initializer(model))
        else:
            weights = list(self.weights_to_train)
        if self.enable_logging:
            logger.debug("[OrtGradientForwardBackward] weights_to_train=%r", weights)
        options = self.sess_options or training_session_options()
        session_args = {"sess_options": options, "providers": self.providers}
        return ForwardBackwardGraphs(model, weights, session_args, self.debug)

    def __repr__(self) -> str:
        return "OrtGradientForwardBackward(...)"

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["cls_type_"]
        state["onx"] = self.onx.SerializeToString()
        state["sess_options"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        model = ModelProto()
        model.ParseFromString(state["onx"])
        self.__dict__.update({**state, "onx": model})
        self.cls_type_ = self._build()

    def new_instance(self) -> OrtGradientForwardBackwardFunction:
        """An object running one forward and its backward at a time."""
        return OrtGradientForwardBackwardFunction(self.cls_type_)


class OrtGradientForwardBackwardFunction:
    """One forward/backward pair: ``backward`` differentiates at the last ``forward``'s inputs."""

    def __init__(self, graphs: ForwardBackwardGraphs):
        self.graphs = graphs
        self.saved_inputs_: list[C_OrtValue] | None = None
        self.saved_outputs_: list[C_OrtValue] | None = None

    def forward(self, inputs, training: bool = False) -> list[C_OrtValue]:
        """The model's outputs at ``inputs`` (its inputs then the weights); with
        ``training=True`` the inputs are kept for :meth:`backward`. A weight with as many
        elements as its initializer is read in the initializer's shape."""
        names = self.graphs._grad_input_names
        values = self._values(inputs, names)
        shapes = self.graphs._weight_shapes
        values = [
            _reshaped(v, shapes[n], self.graphs.device) if n in shapes else v
            for n, v in zip(names, values)
        ]
        outputs = self._run(self.graphs._sess_eval, names, values)
        if training:
            self.saved_inputs_, self.saved_outputs_ = values, outputs
        return outputs

    def backward(self, grad_outputs) -> list[C_OrtValue]:
        """``[g . dy/dv for v in inputs]`` for the output gradients ``g``; a gradient with as
        many elements as its output is read in the output's shape."""
        if self.saved_inputs_ is None:
            raise RuntimeError("backward needs a forward(inputs, training=True) first")
        names = [f"{n}_grad" for n in self.graphs._output_names]
        grads = self._values(grad_outputs, names)
        grads = [
            _reshaped(g, out.shape(), self.graphs.device)
            for g, out in zip(grads, self.saved_outputs_)
        ]
        feeds = self.saved_inputs_ + grads
        sess = self.graphs._sess_grad
        wanted = {i.name for i in sess.get_inputs()}
        pairs = [
            (n, v) for n, v in zip(self.graphs._grad_input_names + names, feeds) if n in wanted
        ]
        return self._run(sess, [n for n, _ in pairs], [v for _, v in pairs])

    def _values(self, values, names: list[str]) -> list[C_OrtValue]:
        values = [values[i] for i in range(len(values))]
        if len(values) != len(names):
            raise ValueError(f"expected {len(names)} values for {names}, got {len(values)}")
        return [_as_c_ortvalue(v, self.graphs.device) for v in values]

    @staticmethod
    def _run(sess: InferenceSession, names: list[str], values: list[C_OrtValue]):
        fetches = [o.name for o in sess.get_outputs()]
        result = sess._sess.run_with_ort_values(dict(zip(names, values)), fetches, None)
        return [result[i] for i in range(len(result))]


def _as_c_ortvalue(value, device) -> C_OrtValue:
    if isinstance(value, C_OrtValue):
        return value
    if hasattr(value, "_ortvalue"):
        return value._ortvalue
    return numpy_to_ort_value(np.ascontiguousarray(value), device)


def _reshaped(value: C_OrtValue, wanted: Sequence[int], device) -> C_OrtValue:
    """``value`` in shape ``wanted`` when only the shape differs, else ``value`` unchanged."""
    shape = value.shape()
    if list(shape) == list(wanted) or int(np.prod(shape)) != int(np.prod(wanted)):
        return value
    return numpy_to_ort_value(value.numpy().reshape(wanted), device)


__all__ = [
    "ForwardBackwardGraphs",
    "OrtGradientForwardBackward",
    "OrtGradientForwardBackwardFunction",
]
