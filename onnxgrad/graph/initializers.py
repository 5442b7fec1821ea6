"""Initializers: which ones are weights, and replacing or adding values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import ModelProto, TensorProto, numpy_helper

from onnxgrad._entries import normalizing
from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    ModelLike,
    all_names,
    checker_knows,
    finalize_model,
    load_model,
    np_dtype,
)
from onnxgrad.graph._differentiable import differentiable_values, model_opsets, value_elem_types
from onnxgrad.graph.weight_roles import weight_initializers


@normalizing
def get_train_initializer(model: ModelLike) -> dict[str, tuple[np.ndarray, TensorProto]]:
    """The initializers worth training: ``{name: (array, TensorProto)}`` in graph order.

    An initializer is a weight when it holds floats and a small change of it reaches a graph
    output through inputs the op schemas mark differentiable. ``Unknown`` schema categories
    (and ops with no schema: custom domains, local functions) count as differentiable, except
    known non-trainable parameters (BatchNormalization running statistics, Upsample scales,
    Range bounds, quantisation scales...). So a float initializer only feeding a Reshape
    shape, Clip bounds, Resize scales or Dropout ratio is not a weight. Among those, only
    the initializers playing a parameter role are weights (kernels, biases, embeddings,
    normalisation scales), not structural constants (epsilons, attention scales, masks,
    rotary tables, the 1 of ``1 - p``): the rule of :mod:`onnxgrad.graph.weight_roles`;
    a constant is trained only when named (``weights=[...]``). Uses inside
    subgraphs count, and so do initializers an old exporter also listed in ``graph.input``.
    The model is seen through :func:`onnxgrad.normalize.normalized_model` (``ValueError``
    naming the node or value at fault): weights stored as ``Constant`` nodes are
    initializers, and a converted scikit-learn model's weights are those of its lowered form
    (:func:`onnxgrad.lower_ml_operators`). The arrays are writable copies; the TensorProtos
    belong to that private normalised copy.
    """
    names = set(train_initializer_names(model))
    return {
        init.name: (numpy_helper.to_array(init).copy(), init)
        for init in model.graph.initializer
        if init.name in names
    }


def train_initializer_names(model: ModelProto) -> list[str]:
    """The names :func:`get_train_initializer` returns, for a normalised model, without
    copying any data."""
    live = differentiable_values(model.graph, model_opsets(model), value_elem_types(model))
    floats = {i.name for i in model.graph.initializer if i.data_type in FLOAT_TYPES} & live
    weights = weight_initializers(model, floats)
    return [init.name for init in model.graph.initializer if init.name in weights]


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
    return finalize_model(model, check=checker_knows(model))


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
