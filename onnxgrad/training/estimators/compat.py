"""What the seeds' estimators did besides training, kept for code written against them."""

from __future__ import annotations

import os

from onnx import ModelProto

from onnxgrad._files import save_model
from onnxgrad.derivative import DerivativeOptions, onnx_derivative
from onnxgrad.training.step.composition import LossModel


def save_loss_gradient(
    model: ModelProto, evaluation: LossModel, path: str | os.PathLike, backend: str
) -> None:
    """Save the gradient graph of ``model``'s loss output with respect to the trained weights
    of ``evaluation`` (``OrtGradientOptimizer(saved_gradient=path)``): inputs the data and
    the weights, outputs ``<weight>_grad`` then the loss."""
    gradient = onnx_derivative(
        model,
        weights=list(evaluation.weights),
        inputs=[],
        options=DerivativeOptions.Loss,
        loss=evaluation.loss,
        label=evaluation.label,
        backend=backend,
    )
    save_model(gradient, os.fspath(path))
