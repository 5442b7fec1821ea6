"""Differentiation layer: :func:`onnx_derivative` and its backends."""

from onnxgrad.derivative.api import onnx_derivative
from onnxgrad.derivative.forward import onnx_hvp, onnx_jvp
from onnxgrad.derivative.jacobian import onnx_jacobian
from onnxgrad.derivative.options import DerivativeOptions

__all__ = ["DerivativeOptions", "onnx_derivative", "onnx_hvp", "onnx_jacobian", "onnx_jvp"]
