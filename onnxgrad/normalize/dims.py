"""Declared dimensions as onnx's checker and onnxruntime read them (the normalisation's
pass: :func:`onnxgrad.graph.declared_dims.dynamic_dims`)."""

from __future__ import annotations

from onnxgrad.graph.declared_dims import dynamic_dims

__all__ = ["dynamic_dims"]
