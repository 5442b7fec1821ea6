"""bfloat16 operators computed in float32, their results rounded to bfloat16.

onnxruntime's CPU provider has bfloat16 kernels for data movement only (``Cast``,
``Transpose``; ``LayerNormalization`` from 1.20 on), not for arithmetic (``Add``, ``MatMul``,
``Softmax``... are missing in 1.19 and 1.32 alike), so a bfloat16 model, its gradient and its
train step would not load. :func:`bfloat16_in_float32` rewrites every default-domain node
that reads or writes bfloat16 to read float32 copies of its bfloat16 inputs (one
``Cast`` per value, shared by its readers) and to round its results back::

    y = op(x)   ->   y = Cast(op(Cast(x, float32)), bfloat16)

which is what a bfloat16 kernel computes (float32 arithmetic, bfloat16 results), up to the
order of accumulation. Values keep their names and types, so the model's interface is
unchanged; the gradient rules then see float32 operators between casts, and a bfloat16
value's gradient is rounded to bfloat16 where the value is. ``Cast``, ``CastLike``,
``Constant`` and nodes with a ``dtype`` attribute or subgraphs are left as they are.
"""

from __future__ import annotations

import onnx
from onnx import ModelProto, TensorProto, helper

from onnxgrad._onnx_utils import NameScope, all_names, subgraphs

BF16 = TensorProto.BFLOAT16
#: nodes whose bfloat16 inputs or outputs stay as they are
KEPT = frozenset({"Cast", "CastLike", "Constant"})


def bfloat16_in_float32(model: ModelProto) -> ModelProto:
    """``model`` with its bfloat16 operators computing in float32 (module docstring); a
    model without bfloat16 values is returned as it is."""
    graph = model.graph
    types = _value_types(model)
    if BF16 not in types.values():
        return model
    names = NameScope(all_names(graph))
    copies: dict[str, str] = {}
    nodes = []
    for node in graph.node:
        if not _converted(node, types):
            nodes.append(node)
            continue
        for k, name in enumerate(node.input):
            if types.get(name) == BF16:
                if name not in copies:
                    copies[name] = names.unique(f"{name}_float32")
                    nodes.append(_cast(names, name, copies[name], TensorProto.FLOAT))
                node.input[k] = copies[name]
        rounded = []
        for k, name in enumerate(node.output):
            if types.get(name) == BF16:
                node.output[k] = names.unique(f"{name}_float32")
                rounded.append(_cast(names, node.output[k], name, BF16))
        nodes.extend([node, *rounded])
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _converted(node, types) -> bool:
    if node.domain not in ("", "ai.onnx") or node.op_type in KEPT or subgraphs(node):
        return False
    if any(a.name == "dtype" for a in node.attribute):
        return False
    return any(types.get(n) == BF16 for n in (*node.input, *node.output))


def _cast(names: NameScope, source: str, target: str, to: int):
    return helper.make_node("Cast", [source], [target], to=to, name=names.unique(f"{target}_cast"))


def _value_types(model: ModelProto) -> dict[str, int]:
    """The element type of every typed value of the main graph (onnx's inference)."""
    graph = model.graph
    types = {t.name: t.data_type for t in graph.initializer}
    if BF16 not in types.values() and not _mentions_bfloat16(graph):
        return types
    inferred = onnx.shape_inference.infer_shapes(model).graph
    for info in (*inferred.input, *inferred.value_info, *inferred.output):
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    return types


def _mentions_bfloat16(graph) -> bool:
    infos = (*graph.input, *graph.output, *graph.value_info)
    if any(i.type.tensor_type.elem_type == BF16 for i in infos):
        return True
    return any(
        (a.name == "to" and a.i == BF16) or (a.type == a.TENSOR and a.t.data_type == BF16)
        for node in graph.node
        for a in node.attribute
    )


__all__ = ["bfloat16_in_float32"]
