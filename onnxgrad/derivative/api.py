"""``onnx_derivative``: resolves what to differentiate, then hands over to a backend.

Both backends receive the same resolved request and return graphs with the same interface:

* inputs: the model's inputs, then the differentiated weights (former initializers, same
  names), then one ``<output>_grad`` per output (``Zero`` only);
* outputs: ``<input>_grad`` for each differentiated input, then ``<weight>_grad`` for each
  weight, then the original outputs (``KeepOutputs``) or the loss (``Loss``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

from onnx import ModelProto

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    real_inputs,
    supported_ir_version,
)
from onnxgrad.derivative.options import DerivativeOptions, check_options
from onnxgrad.normalize import normalized_model

#: backend name -> "module:function" implementing ``fn(request) -> ModelProto``.
BACKENDS = {
    "onnx": "onnxgrad.derivative.native:native_derivative",
    "ort": "onnxgrad.derivative.ort:ort_derivative",
}


@dataclass(frozen=True)
class DerivativeRequest:
    """A validated request: the model (a private copy) and what to differentiate."""

    model: ModelProto
    weights: tuple[str, ...]
    inputs: tuple[str, ...]
    options: DerivativeOptions
    loss: str | None = None
    label: str | None = None


def onnx_derivative(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    inputs: Sequence[str] | None = None,
    options: DerivativeOptions | int = DerivativeOptions.Zero,
    loss: str | None = None,
    label: str | None = None,
    backend: str = "onnx",
) -> ModelProto:
    """The gradient graph of ``model`` with respect to weights and/or inputs.

    For outputs ``y_k = f_k(x, w)`` and output gradients ``g_k`` (``<y_k>_grad`` inputs,
    ones with ``FillGrad``, 1 for the loss with ``Loss``), the graph returns the
    vector-Jacobian products ``x_grad = sum_k g_k . dy_k/dx`` and ``w_grad = sum_k g_k . dy_k/dw``.

    :param model: ModelProto or path; never modified. It is first made regular by
        :func:`onnxgrad.normalize.normalized_model` (``ValueError`` naming the node or value
        at fault): nodes in topological order, weights stored as ``Constant`` nodes become
        initializers, a model below opset 13 is converted to it, ``ai.onnx.ml`` operators
        are lowered into standard ONNX (ZipMap dropped, its probability tensor exposed as
        the output ``probabilities``), declared shapes are reconciled with inferred ones.
    :param weights: initializers to differentiate; ``None`` means every weight returned by
        :func:`onnxgrad.get_train_initializer`, ``[]`` none. They become graph inputs.
    :param inputs: graph inputs to differentiate; ``None`` means every float input (the
        label excepted with ``Loss``), ``[]`` none.
    :param options: :class:`DerivativeOptions` flags.
    :param loss: with ``Loss``, the name of the scalar loss output (default: ``'loss'`` if it
        exists, else the only output).
    :param label: with ``Loss``, the name of the label input (excluded from the default inputs).
    :param backend: ``"onnx"`` (native engine, standard ONNX ops only) or ``"ort"``
        (onnxruntime-training's gradient builder).
    """
    _check_arguments(options, backend)
    return derive_in_place(normalized_model(model), weights, inputs, options, loss, label, backend)


def derive_in_place(
    model: ModelProto,
    weights: Sequence[str] | None = None,
    inputs: Sequence[str] | None = None,
    options: DerivativeOptions | int = DerivativeOptions.Zero,
    loss: str | None = None,
    label: str | None = None,
    backend: str = "onnx",
) -> ModelProto:
    """:func:`onnx_derivative` of a private model already normalised (see
    :func:`onnxgrad.normalize.normalized_model`), which it may rewrite into the result:
    the command and the train step use it so that no weight is copied."""
    options = _check_arguments(options, backend)
    model.ir_version = supported_ir_version(model)
    request = resolve_request(model, weights, inputs, options, loss, label)
    module_name, function_name = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module_name), function_name)(request)


def _check_arguments(options: DerivativeOptions | int, backend: str) -> DerivativeOptions:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}, expected one of {sorted(BACKENDS)}")
    return check_options(options, backend)


def resolve_request(
    model: ModelProto,
    weights: Sequence[str] | None,
    inputs: Sequence[str] | None,
    options: DerivativeOptions,
    loss: str | None,
    label: str | None,
) -> DerivativeRequest:
    """Check names and fill the defaults of :func:`onnx_derivative`."""
    if DerivativeOptions.Loss in options:
        loss, label = _resolve_loss(model, loss, label)
    elif loss is not None or label is not None:
        raise ValueError("loss= and label= need options=DerivativeOptions.Loss")
    resolved_weights = _resolve_weights(model, weights)
    resolved_inputs = _resolve_inputs(model, inputs, exclude=label)
    if not resolved_weights and not resolved_inputs:
        raise ValueError("nothing to differentiate: no weight and no input selected")
    return DerivativeRequest(model, resolved_weights, resolved_inputs, options, loss, label)


def _string_list(names: Sequence[str], what: str) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{what} must be a list of names, not the string {names!r}")
    names = list(names)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{what} lists {duplicates} more than once")
    return names


def _resolve_weights(model: ModelProto, weights: Sequence[str] | None) -> tuple[str, ...]:
    from onnxgrad.graph.initializers import train_initializer_names

    if weights is None:
        return tuple(train_initializer_names(model))
    names = _string_list(weights, "weights")
    initializers = {init.name: init for init in model.graph.initializer}
    unknown = [n for n in names if n not in initializers]
    if unknown:
        raise ValueError(f"unknown weights {unknown}: they are not initializers of the model")
    not_float = [n for n in names if initializers[n].data_type not in FLOAT_TYPES]
    if not_float:
        raise ValueError(f"weights {not_float} are not float tensors and have no gradient")
    return tuple(names)


def graph_inputs(model: ModelProto) -> list[str]:
    """Names of the inputs a caller feeds (see :func:`onnxgrad._onnx_utils.real_inputs`)."""
    return [i.name for i in real_inputs(model)]


def _resolve_inputs(
    model: ModelProto, inputs: Sequence[str] | None, exclude: str | None
) -> tuple[str, ...]:
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    real_inputs = graph_inputs(model)
    if inputs is None:
        return tuple(n for n in real_inputs if types[n] in FLOAT_TYPES and n != exclude)
    names = _string_list(inputs, "inputs")
    unknown = [n for n in names if n not in real_inputs]
    if unknown:
        raise ValueError(f"unknown inputs {unknown}, the model's inputs are {real_inputs}")
    not_float = [n for n in names if types[n] not in FLOAT_TYPES]
    if not_float:
        raise ValueError(f"inputs {not_float} are not float tensors and have no gradient")
    return tuple(names)


def _resolve_loss(model: ModelProto, loss: str | None, label: str | None) -> tuple[str, str | None]:
    outputs = [o.name for o in model.graph.output]
    if loss is None:
        if "loss" in outputs:
            loss = "loss"
        elif len(outputs) == 1:
            loss = outputs[0]
        else:
            raise ValueError(f"the model has several outputs {outputs}: name the loss with loss=")
    if loss not in outputs:
        raise ValueError(f"loss output {loss!r} not found among the outputs {outputs}")
    _check_scalar_loss(next(o for o in model.graph.output if o.name == loss))
    if label is not None and label not in graph_inputs(model):
        raise ValueError(f"label input {label!r} not found among the inputs {graph_inputs(model)}")
    return loss, label


def _check_scalar_loss(output) -> None:
    """A loss is one float number: shape ``[]``, ``[1]``, ``[1, 1]``... (unknown shapes pass)."""
    tensor = output.type.tensor_type
    if tensor.elem_type and tensor.elem_type not in FLOAT_TYPES:
        raise ValueError(f"loss output {output.name!r} is not a float tensor")
    if tensor.HasField("shape"):
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if any(d is not None and d != 1 for d in dims):
            raise ValueError(
                f"loss output {output.name!r} has shape {dims}: DerivativeOptions.Loss needs a "
                "scalar loss (use FillGrad to differentiate the sum of an output)"
            )
