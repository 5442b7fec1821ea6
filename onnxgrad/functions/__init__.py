"""Authored graphs: small fixed ONNX graphs written with onnxscript.

:func:`function_onnx_graph` serves weight updates (``axpy``, ``axpyw``, ``axpyw2``, ``adam``...),
losses with their gradients and penalties, for float32 or float64 and opsets from 13 to the
newest one the installed onnxscript knows;
:func:`get_supported_functions` lists them with a one-line description each.
"""

from onnxgrad.functions.catalogue import function_onnx_graph, get_supported_functions

__all__ = ["function_onnx_graph", "get_supported_functions"]
