"""Trained weights put back into the model as the user gave it."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import ModelProto

from onnxgrad._onnx_utils import ModelLike, load_model
from onnxgrad.graph.initializers import replace_initializers_into_onnx
from onnxgrad.graph.ml_lowering import lower_ml_operators, needs_lowering
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
    trained ``weights`` (named as in its lowered form, when it needed one) as initializers."""
    if not needs_lowering(original):
        return replace_initializers_into_onnx(original, weights)
    lowered = lower_ml_operators(original, keep_zipmap=True)
    trained = replace_initializers_into_onnx(lowered, weights)
    return select_model_inputs_outputs(trained, outputs=[o.name for o in original.graph.output])
