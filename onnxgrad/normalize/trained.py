"""Trained weights put back into the model as the user gave it."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import ModelProto, helper

from onnxgrad._onnx_utils import ModelLike, load_model
from onnxgrad.graph.initializers import replace_initializers_into_onnx, to_numpy
from onnxgrad.graph.ml_lowering import lower_ml_operators, lowerable_nodes, needs_lowering
from onnxgrad.graph.select import select_model_inputs_outputs
from onnxgrad.normalize.constants import write_back_constants


def trained_model(original: ModelLike, weights: Mapping[str, np.ndarray]) -> ModelProto:
    """``original`` in its own form (its outputs, a converter's ZipMap included) with the
    trained ``weights``, named as in its normalised form: the weights normalisation promoted
    from ``Constant`` nodes go back into those nodes, the others replace initializers (of
    its lowered form when it has ``ai.onnx.ml`` operators)."""
    original = load_model(original)
    remaining = write_back_constants(original, weights)
    return with_trained_weights(original, remaining)


def with_trained_weights(original: ModelProto, weights: Mapping[str, np.ndarray]) -> ModelProto:
    """``original`` in its converter's format (the same outputs, ZipMap included) with the
    trained ``weights`` (named as in its lowered form, when it needed one) as initializers. A
    file below the rules' opset with no ``ai.onnx.ml`` node keeps its opset and operators
    when its initializers are the weights as trained (same names, types and shapes): raising
    it would rewrite nodes (an opset-11 ``Softmax`` as ``Flatten``, ``Softmax``, ``Reshape``)."""
    if not needs_lowering(original) or _holds(original, weights):
        return replace_initializers_into_onnx(original, weights)
    lowered = lower_ml_operators(original, keep_zipmap=True)
    trained = replace_initializers_into_onnx(lowered, weights)
    return select_model_inputs_outputs(trained, outputs=[o.name for o in original.graph.output])


def _holds(original: ModelProto, weights: Mapping[str, np.ndarray]) -> bool:
    """Whether ``original`` has no ``ai.onnx.ml`` node to lower and an initializer of the
    name, element type and shape of each of ``weights``."""
    if lowerable_nodes(original):
        return False
    held = {init.name: init for init in original.graph.initializer}
    for name, value in weights.items():
        init = held.get(name)
        value = to_numpy(value, name)
        if init is None or tuple(init.dims) != value.shape:
            return False
        if helper.tensor_dtype_to_np_dtype(init.data_type) != value.dtype:
            return False
    return True
