"""Trained weights put back into the model as the user gave it."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import ModelProto

from onnxgrad._onnx_utils import ModelLike, load_model
from onnxgrad.graph.ml_lowering import with_trained_weights
from onnxgrad.normalize.constants import write_back_constants


def trained_model(original: ModelLike, weights: Mapping[str, np.ndarray]) -> ModelProto:
    """``original`` in its own form (its outputs, a converter's ZipMap included) with the
    trained ``weights``, named as in its normalised form: the weights normalisation promoted
    from ``Constant`` nodes go back into those nodes, the others replace initializers (of
    its lowered form when it has ``ai.onnx.ml`` operators)."""
    original = load_model(original)
    remaining = write_back_constants(original, weights)
    return with_trained_weights(original, remaining)
