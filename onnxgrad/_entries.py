"""Public entry points normalise their model once, at the entry.

:func:`normalizing` turns ``core(model, ...)``, a function of a model already made regular by
:func:`onnxgrad.normalize.normalized_model`, into the public function taking the model as
the user has it. An entry built on another calls that one's core, ``entry.normalized``, with
the model it has already normalised: the pipeline runs once per public call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from onnxgrad._onnx_utils import ModelLike

R = TypeVar("R")


def normalizing(core: Callable[..., R]) -> Callable[..., R]:
    """The public entry of ``core(model, ...)``: ``model`` (a ModelProto or a path) goes
    through :func:`~onnxgrad.normalize.normalized_model` first, its quantized activations
    differentiated as ``quantized_activations=`` says (:mod:`onnxgrad.normalize.ste`:
    ``"straight_through"``, the default, or ``"exact"``).

    ``core`` stays reachable as ``entry.normalized`` for code that already holds a normalised
    model: it takes that model over (it may rewrite it), so a caller still using it passes a
    copy."""

    @functools.wraps(core)
    def entry(
        model: ModelLike, *args, quantized_activations: str = "straight_through", **kwargs
    ) -> R:
        from onnxgrad.normalize import normalized_model  # the pipeline lowers with onnxgrad.graph
        from onnxgrad.normalize.ste import quantized_activations as rounding

        with rounding(quantized_activations):
            normalized = normalized_model(model)
        return core(normalized, *args, **kwargs)

    entry.normalized = core
    return entry
