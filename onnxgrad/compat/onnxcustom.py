"""onnxcustom's defaults and return forms, for code written against onnxcustom.

Replace ``from onnxcustom.training.grad_helper``, ``.optimizers_partial``,
``.sgd_learning_rate``, ``onnxcustom.utils.orttraining_helper`` and ``.onnx_rewriter``
imports by ``from onnxgrad.compat.onnxcustom import ...``. The names are onnxgrad's, with
these differences (each one onnxcustom's choice, not onnxgrad's default):

* :func:`add_loss_output` declares the loss ``[1, 1]`` (onnxgrad's is a scalar ``[]``);
* :func:`unreduced_onnx_loss` returns the terms of the final reduction (``[N, K]``), not
  one score a row;
* :func:`onnx_derivative` takes ``options`` as :class:`DerivativeOptions` only (an integer
  raises ``TypeError``), ``path_name=`` (the result is also saved there), and builds
  ``KeepYieldOp`` graphs with onnxruntime-training's builder (``backend='ort'``);
* :class:`LearningRateSGDNesterov` uses the ``'invscaling'`` schedule by default (onnxgrad's
  ``'constant'`` is scikit-learn's MLP), and :class:`OrtGradientForwardBackwardOptimizer`
  selects it for ``learning_rate='Nesterov'``;
* ``OrtGradientForwardBackwardOptimizer.get_state()`` returns the trained weights as a
  list of C-level ``OrtValue`` in training order, and ``set_state`` takes that list
  (``OrtValue`` or numpy arrays) as well as onnxgrad's dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto

from onnxgrad._onnx_utils import ModelLike, finalize_model
from onnxgrad.derivative import DerivativeOptions
from onnxgrad.derivative import onnx_derivative as _onnx_derivative
from onnxgrad.graph import add_loss_output as _add_loss_output
from onnxgrad.graph import get_train_initializer
from onnxgrad.graph import unreduced_onnx_loss as _unreduced_onnx_loss
from onnxgrad.graph.loss import reshape_loss
from onnxgrad.training import OrtGradientForwardBackwardOptimizer as _ForwardBackwardOptimizer
from onnxgrad.training.running.ort_devices import get_ort_device, numpy_to_ort_value
from onnxgrad.training.step._params import ResolvedParam
from onnxgrad.training.step.learning_rate import (
    BaseLearningRate,
    LearningRateSGD,
    select_learning_rate,
)
from onnxgrad.training.step.learning_rate import LearningRateSGDNesterov as _LearningRateSGDNesterov


def add_loss_output(model: ModelLike, *args: Any, **kwargs: Any) -> ModelProto:
    """:func:`onnxgrad.add_loss_output` with the loss reshaped to ``[1, 1]``, as onnxcustom
    declared it (same value: ``loss[0, 0]`` is onnxgrad's scalar)."""
    result = _add_loss_output(model, *args, **kwargs)
    loss_name = kwargs.get("loss_name", args[1] if len(args) > 1 else "loss")
    reshape_loss(result, loss_name, (1, 1))
    return finalize_model(result)


def unreduced_onnx_loss(onx: ModelLike, output_name: str = "score") -> ModelProto:
    """:func:`onnxgrad.unreduced_onnx_loss` with ``per_row=False``: the terms the loss
    reduces, ``[N, K]`` (one score a row when the loss has one column), as onnxcustom."""
    return _unreduced_onnx_loss(onx, output_name=output_name, per_row=False)


def onnx_derivative(
    onx: ModelLike,
    weights: Sequence[str] | None = None,
    inputs: Sequence[str] | None = None,
    options: DerivativeOptions = DerivativeOptions.Zero,
    loss: str | None = None,
    label: str | None = None,
    path_name: str | None = None,
    backend: str | None = None,
    **kwargs: Any,
) -> ModelProto:
    """:func:`onnxgrad.onnx_derivative` with onnxcustom's signature.

    ``options`` must be a :class:`DerivativeOptions` (``TypeError`` otherwise: onnxgrad reads
    an integer as flags); ``KeepYieldOp`` selects ``backend='ort'`` when no backend is given
    (the ``YieldOp`` nodes are onnxruntime-training's); the result is also saved to
    ``path_name`` when one is given.
    """
    if not isinstance(options, DerivativeOptions):
        raise TypeError(f"options must be a DerivativeOptions, not {type(options).__name__}")
    if backend is None:
        backend = "ort" if options & DerivativeOptions.KeepYieldOp else "onnx"
    result = _onnx_derivative(
        onx, weights, inputs, options, loss=loss, label=label, backend=backend, **kwargs
    )
    if path_name is not None:
        onnx.save(result, path_name)
    return result


class LearningRateSGDNesterov(_LearningRateSGDNesterov):
    """:class:`onnxgrad.training.LearningRateSGDNesterov` with onnxcustom's default schedule,
    ``'invscaling'``: ``eta = eta0 / t^power_t``, ``t`` the samples seen."""

    def __init__(
        self,
        eta0: float = 0.01,
        alpha: float = 0.0001,
        power_t: float = 0.25,
        learning_rate: str = "invscaling",
        momentum: float = 0.9,
        nesterov: bool = True,
    ):
        super().__init__(eta0, alpha, power_t, learning_rate, momentum, nesterov)


def _select_learning_rate(learning_rate) -> BaseLearningRate:
    """``'Nesterov'`` is this module's :class:`LearningRateSGDNesterov`, the rest as onnxgrad."""
    if isinstance(learning_rate, str) and learning_rate.lower() == "nesterov":
        return LearningRateSGDNesterov()
    return select_learning_rate(learning_rate)


class OrtGradientForwardBackwardOptimizer(_ForwardBackwardOptimizer):
    """:class:`onnxgrad.OrtGradientForwardBackwardOptimizer` with onnxcustom's
    ``learning_rate='Nesterov'`` (:class:`LearningRateSGDNesterov` above) and state as a list
    of ``OrtValue``."""

    learning_rate = ResolvedParam(BaseLearningRate, _select_learning_rate)

    def get_state(self) -> list:
        """The trained weights, C-level ``OrtValue`` copies on the estimator's device, in
        training order (:meth:`get_state_dict` gives onnxgrad's dict)."""
        device = get_ort_device(self.device)
        return [numpy_to_ort_value(v, device) for v in self.get_state_dict().values()]

    def get_state_dict(self) -> dict[str, np.ndarray]:
        """onnxgrad's :meth:`~onnxgrad.OrtGradientForwardBackwardOptimizer.get_state`."""
        return super().get_state()

    def set_state(self, state) -> OrtGradientForwardBackwardOptimizer:
        """Overwrite the weights from :meth:`get_state`'s list (``OrtValue`` or numpy arrays,
        training order) or from onnxgrad's dict."""
        if isinstance(state, dict):
            return super().set_state(state)
        names = list(self.get_state_dict())
        if len(state) != len(names):
            raise ValueError(
                f"expected {len(names)} tensors for the weights {names}, got {len(state)}"
            )
        arrays = [v.numpy() if hasattr(v, "numpy") else np.asarray(v) for v in state]
        return super().set_state(dict(zip(names, arrays)))


__all__ = [
    "BaseLearningRate",
    "DerivativeOptions",
    "LearningRateSGD",
    "LearningRateSGDNesterov",
    "OrtGradientForwardBackwardOptimizer",
    "add_loss_output",
    "get_train_initializer",
    "onnx_derivative",
    "unreduced_onnx_loss",
]
