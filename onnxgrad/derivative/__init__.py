"""Differentiation layer: :func:`onnx_derivative` and its backends."""

from onnxgrad.derivative.api import onnx_derivative
from onnxgrad.derivative.options import DerivativeOptions

__all__ = ["DerivativeOptions", "onnx_derivative"]
