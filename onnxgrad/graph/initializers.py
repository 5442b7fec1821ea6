"""Initializers: which ones are weights, and replacing or adding values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import ModelProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    all_names,
    finalize_model,
    load_model,
    np_dtype,
)
from onnxgrad.graph._differentiable import differentiable_values, model_opsets, value_elem_types
from onnxgrad.graph.ml_lowering import lowered_if_needed


def get_train_initializer(model: ModelLike) -> dict[str, tuple[np.ndarray, TensorProto]]:
    """The initializers worth training: ``{name: (array, TensorProto)}`` in graph order.

    An initializer is a weight when it holds floats and a small change of it reaches a graph
    output through inputs the op schemas mark differentiable. ``Unknown`` schema categories
    (and ops with no schema: custom domains, local functions) count as differentiable, except
    known non-trainable parameters (BatchNormalization running statistics, Upsample scales,
    Range bounds, quantisation scales...). So a float initializer only feeding a Reshape
    shape, Clip bounds, Resize scales or Dropout ratio is not a weight. Uses inside
    subgraphs count, and so do initializers an old exporter also listed in ``graph.input``.
    The arrays are writable copies; the TensorProtos belong to a private copy of the model,
    which is checked first (``ValueError`` naming the node or value at fault) and whose
    nodes are put in topological order.
    A model with ``ai.onnx.ml`` operators (a converted scikit-learn model) is seen through
    :func:`onnxgrad.lower_ml_operators`: its weights are the lowered model's initializers.
    """
    from onnxgrad._model_checks import checked_model

    model = lowered_if_needed(checked_model(model), min_opset=0)
    names = set(train_initializer_names(model))
    return {
        init.name: (numpy_helper.to_array(init).copy(), init)
        for init in model.graph.initializer
        if init.name in names
    }


def weight_names(model: ModelProto) -> list[str]:
    """The names :func:`get_train_initializer` returns for a model without ``ai.onnx.ml``
    operators, found on a weightless view: no weight is copied (the model's size, not a
    multiple of it, at the peak)."""
    from onnxgrad._model_checks import checked_model, weightless_view

    view = checked_model(weightless_view(model))
    live = differentiable_values(view.graph, model_opsets(view), value_elem_types(view))
    return [
        init.name
        for init in model.graph.initializer
        if init.data_type in FLOAT_TYPES and init.name in live
    ]


def train_initializer_names(model: ModelProto) -> list[str]:
    """The names :func:`get_train_initializer` returns, for a checked model (its nodes in
    topological order), without copying any data."""
    live = differentiable_values(model.graph, model_opsets(model), value_elem_types(model))
    return [
        init.name
        for init in model.graph.initializer
        if init.data_type in FLOAT_TYPES and init.name in live
    ]


def to_numpy(value: Any, name: str) -> np.ndarray:
    """``value`` as a numpy array: arrays, numpy scalars and anything with ``.numpy()``
    (onnxruntime ``OrtValue``, torch tensors)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.generic):
        return np.asarray(value)
    numpy_method = getattr(value, "numpy", None)
    if callable(numpy_method):
        return np.asarray(numpy_method())
    raise TypeError(
        f"the value of {name!r} must be a numpy array or an OrtValue, got {type(value).__name__}"
    )


def replace_initializers_into_onnx(model: ModelLike, values: Mapping[str, Any]) -> ModelProto:
    """A copy of ``model`` whose (main-graph) initializers named in ``values`` hold new values.

    ``values`` maps initializer names to numpy arrays or OrtValues. Each new value must keep
    the dtype and shape of the initializer it replaces; the initializer keeps its position.
    """
    if not isinstance(values, Mapping):
        raise TypeError(
            f"values must be a dict {{initializer: array}}, got {type(values).__name__}"
        )
    model = load_model(model)
    position = {init.name: i for i, init in enumerate(model.graph.initializer)}
    unknown = sorted(set(values) - set(position))
    if unknown:
        raise ValueError(f"unknown initializers {unknown}: the model has no initializer so named")
    for name, value in values.items():
        old = model.graph.initializer[position[name]]
        array = to_numpy(value, name)
        expected = np_dtype(old.data_type)
        if array.dtype != expected:
            raise ValueError(
                f"weight {name!r}: the new value has dtype {array.dtype}, "
                f"the initializer {expected}"
            )
        shape = tuple(old.dims)
        if array.shape != shape:
            raise ValueError(
                f"weight {name!r}: the new value has shape {array.shape}, the initializer {shape}"
            )
        old.CopyFrom(numpy_helper.from_array(array, name=name))
    return finalize_model(model)


def add_initializer(model: ModelLike, name: str, value: Any) -> ModelProto:
    """A copy of ``model`` with one more initializer ``name`` holding ``value``.

    ``value`` is a numpy array (or scalar) or an OrtValue; ``name`` must be new to the graph
    and its subgraphs.
    """
    model = load_model(model)
    if not isinstance(name, str) or not name:
        raise TypeError(f"an initializer name must be a non-empty string, got {name!r}")
    if name in all_names(model.graph):
        raise ValueError(f"name {name!r} already exists in the graph")
    model.graph.initializer.append(numpy_helper.from_array(to_numpy(value, name), name=name))
    return finalize_model(model)
