"""Quantized weights as LoRA targets (QLoRA): float adapters over a frozen quantized base.

A model holding onnxruntime's quantized operators (``MatMulNBits``, ``QLinearMatMul``,
``quantize_dynamic``'s ``MatMulInteger`` or ``DynamicQuantizeMatMul``, QDQ weights) or fused
ones is first normalised, which lowers the quantized ones to a ``MatMul``
reading the dequantized weight ``W = (q - z) s`` computed in the graph from the integer
initializer ``q``. That float
value is the adapter's target: ``W + s_{lora} A B`` replaces it in the ``MatMul``, ``q``, its
scales and zero points stay as they are (integers and structural constants, never trained).
The adapter is named after ``q``.
"""

from __future__ import annotations

import onnx
from onnx import ModelProto, TensorProto

from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain

#: Operators whose weights are quantized: a model with one is normalised before adapting.
QUANTIZED_OPS = frozenset(
    {
        ("com.microsoft", "MatMulNBits"),
        ("", "QLinearMatMul"),
        ("", "MatMulInteger"),
        ("com.microsoft", "DynamicQuantizeMatMul"),
        ("", "DequantizeLinear"),
        ("com.microsoft", "DequantizeLinear"),
    }
)
#: Operators a dequantized weight passes through on its way to the MatMul (data input 0).
_CHAIN = frozenset({"DequantizeLinear", "Transpose", "Reshape", "Slice", "Cast", "Identity"})
_INTEGER_TYPES = frozenset(
    {TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32, TensorProto.UINT4, TensorProto.INT4}
)


def lowered_if_quantized(model: ModelProto) -> ModelProto:
    """``model`` normalised when it holds a quantized operator or one of onnxruntime's fused
    operators (which onnx's checker may refuse), else ``model`` itself."""
    from onnxgrad.normalize import normalize_in_place
    from onnxgrad.normalize.contrib import CONTRIB_LOWERINGS

    deployed = QUANTIZED_OPS | set(CONTRIB_LOWERINGS)
    if not any((normalize_domain(n.domain), n.op_type) in deployed for n in model.graph.node):
        return model
    return normalize_in_place(model)


def dequantized_weights(model: ModelProto) -> dict[str, tuple[str, tuple[int, int], int]]:
    """``{integer initializer q: (the dequantized value a MatMul reads, its static 2-D
    shape, its element type)}`` (see the module docstring)."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    inits = {init.name: init for init in graph.initializer}
    types = _static_types(model)
    found = {}
    for node in graph.node:
        if node.op_type != "MatMul" or normalize_domain(node.domain) or len(node.input) < 2:
            continue
        value = node.input[1]
        source = _integer_source(value, producers, inits)
        known = types.get(value)
        if source is None or known is None or source in found:
            continue
        shape, elem = known
        if len(shape) == 2 and all(isinstance(d, int) and d > 0 for d in shape):
            found[source] = (value, shape, elem)
    return found


def _integer_source(value: str, producers, inits) -> str | None:
    """The integer initializer ``value`` dequantizes through :data:`_CHAIN` down to a
    ``DequantizeLinear`` whose codes come from one integer initializer (unpacked, for
    ``MatMulNBits``, by integer arithmetic), or ``None``."""
    while value not in inits:
        node = producers.get(value)
        if node is None or node.op_type not in _CHAIN or normalize_domain(node.domain):
            return None
        if node.op_type == "DequantizeLinear":
            return _only_integer_ancestor(node.input[0], producers, inits)
        value = node.input[0]
    return None


def _only_integer_ancestor(value: str, producers, inits) -> str | None:
    """The one integer initializer of rank >= 1 that ``value`` is computed from, if one."""
    found, stack, seen = set(), [value], set()
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in inits:
            init = inits[name]
            if init.data_type in _INTEGER_TYPES and len(init.dims) >= 1 and init.dims[0] > 1:
                found.add(name)
            elif init.data_type in FLOAT_TYPES:
                return None
            continue
        node = producers.get(name)
        if node is not None:
            stack.extend(node.input)
    return found.pop() if len(found) == 1 else None


def _static_types(model: ModelProto) -> dict[str, tuple[tuple, int]]:
    from onnxgrad._model_checks import weightless_view

    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_view(model))
    except Exception:  # without inference no value has a known shape: nothing to adapt
        return {}
    types = {}
    for info in inferred.graph.value_info:
        tensor = info.type.tensor_type
        if tensor.elem_type in FLOAT_TYPES and tensor.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
            types[info.name] = (dims, tensor.elem_type)
    return types
