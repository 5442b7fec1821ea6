"""Training ops onnxruntime puts in the default domain, replaced by standard ONNX.

onnxruntime-training's builder emits ``AveragePoolGrad`` and ``MaxPoolGrad`` in the default
ONNX domain, where they have no ONNX schema: onnx's checker rejects the result, and no other
runtime knows them. Each such node ``<F>_Grad/...`` (``F`` the forward pooling node, input
``x``, output ``y``; the node reads ``dy`` and writes ``dx``) is replaced by the native
engine's gradient of ``F`` alone, ``dx = (dy/dx)^T dy``, spliced under the node's name: the
result holds standard ops and onnxruntime's ``com.microsoft`` ops only.
"""

from __future__ import annotations

import onnx
from onnx import ModelProto, NodeProto

from onnxgrad._onnx_utils import make_model_like

#: Default-domain training ops the splice replaces, by the forward op they differentiate.
REPLACED = {"AveragePoolGrad": "AveragePool", "MaxPoolGrad": "MaxPool"}


def replace_training_ops(result: ModelProto, forward: ModelProto) -> None:
    """Replace, in place, the nodes of ``result`` (built by onnxruntime-training from
    ``forward``) that are default-domain ops without an ONNX schema (see the module doc);
    ``NotImplementedError`` names one it cannot replace."""
    graph = result.graph
    nodes = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or onnx.defs.has(node.op_type):
            nodes.append(node)
            continue
        spliced, initializers = _native_gradient(node, result, forward)
        nodes.extend(spliced)
        graph.initializer.extend(initializers)
    del graph.node[:]
    graph.node.extend(nodes)


def _native_gradient(grad: NodeProto, result: ModelProto, forward: ModelProto):
    from onnxgrad.derivative.api import onnx_derivative
    from onnxgrad.derivative.autodiff.value_types import infer_value_types, value_info

    node = _forward_node(grad, forward)
    types = infer_value_types(forward)
    x, y = node.input[0], node.output[0]
    if x not in types or y not in types:
        raise NotImplementedError(_refusal(grad, f"the types of {x!r} and {y!r} are unknown"))
    single = onnx.helper.make_graph(
        [_copy(node, outputs=[y])], "single", [value_info(x, types[x])], [value_info(y, types[y])]
    )
    gradient = onnx_derivative(make_model_like(single, forward), weights=[], inputs=[x])
    prefix = f"{grad.name}/"
    names = {x: x, f"{y}_grad": grad.input[0], f"{x}_grad": grad.output[0]}
    available = _available(result)
    read = {n for native in gradient.graph.node for n in native.input}
    for info in gradient.graph.input:
        if info.name in read and (info.name not in names or names[info.name] not in available):
            raise NotImplementedError(_refusal(grad, f"its native gradient reads {info.name!r}"))
    spliced = []
    for index, native in enumerate(gradient.graph.node):
        copy = _copy(native)
        copy.name = f"{prefix}{native.name or index}"
        copy.input[:] = [names.get(n, prefix + n) if n else n for n in native.input]
        copy.output[:] = [names.get(n, prefix + n) if n else n for n in native.output]
        spliced.append(copy)
    initializers = []
    for init in gradient.graph.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = prefix + init.name
        initializers.append(copy)
    return spliced, initializers


def _forward_node(grad: NodeProto, forward: ModelProto) -> NodeProto:
    name = grad.name.split("_Grad/")[0]
    op_type = REPLACED.get(grad.op_type)
    found = [n for n in forward.graph.node if n.name == name and n.op_type == op_type]
    if op_type is None or len(found) != 1:
        raise NotImplementedError(
            _refusal(grad, "it is no ONNX operator and onnxgrad has no standard replacement")
        )
    return found[0]


def _available(model: ModelProto) -> set[str]:
    graph = model.graph
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    return names | {o for node in graph.node for o in node.output if o}


def _copy(node: NodeProto, outputs=None) -> NodeProto:
    copy = NodeProto()
    copy.CopyFrom(node)
    if outputs is not None:
        copy.output[:] = outputs
    return copy


def _refusal(grad: NodeProto, why: str) -> str:
    return (
        f"backend='ort': onnxruntime-training's {grad.op_type} (node {grad.name!r}) cannot be "
        f"replaced by standard ONNX operators ({why}); use backend='onnx'"
    )
