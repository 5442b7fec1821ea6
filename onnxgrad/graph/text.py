"""A compact, indented text view of a model."""

from __future__ import annotations

import sys

import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, TensorProto, TypeProto, helper, numpy_helper

from onnxgrad._onnx_utils import ModelLike, load_model, normalize_domain, np_dtype

#: How many values of an initializer the text view shows.
MAX_SHOWN_VALUES = 8
_STEP = "  "


def onnx_simple_text_plot(model: ModelLike) -> str:
    """The model as text, one line per opset, input, initializer, node and output.

    A node is written ``Op(inputs, attribute=value) -> outputs`` and indented one step
    deeper than the shallowest node computing one of its inputs (nodes reading only inputs
    and initializers are not indented). Shapes print unknown dimensions as ``None`` and
    symbolic ones by their name; initializers show their first values. A node's subgraphs
    are printed below it, one step deeper.
    """
    model = load_model(model)
    lines = [f"opset: domain={op.domain!r} version={op.version}" for op in model.opset_import]
    lines.extend(_graph_lines(model.graph, ""))
    for function in model.functions:
        lines.append(
            f"function: domain={function.domain!r} name={function.name!r} "
            f"({', '.join(function.input)}) -> {', '.join(function.output)}"
        )
        lines.extend(_node_lines(function.node, _STEP))
    return "\n".join(lines)


def _graph_lines(graph: GraphProto, margin: str) -> list[str]:
    lines = [f"{margin}input: {_value_text(i.name, i.type)}" for i in graph.input]
    lines += [f"{margin}init: {_initializer_text(init)}" for init in graph.initializer]
    lines += [
        f"{margin}init: {_initializer_text(sparse.values)} (sparse, dense shape "
        f"{tuple(sparse.dims)})"
        for sparse in graph.sparse_initializer
    ]
    lines += _node_lines(graph.node, margin)
    lines += [f"{margin}output: {_value_text(o.name, o.type)}" for o in graph.output]
    return lines


def _node_lines(nodes, margin: str) -> list[str]:
    depth: dict[str, int] = {}
    lines = []
    for node in nodes:
        producers = [depth[name] for name in node.input if name in depth]
        level = 1 + min(producers) if producers else 0
        for out in node.output:
            depth[out] = level
        indent = margin + _STEP * level
        lines.append(indent + _node_text(node))
        for attr in node.attribute:
            for k, sub in enumerate(_attribute_graphs(attr)):
                suffix = f"[{k}]" if attr.type == AttributeProto.GRAPHS else ""
                lines.append(f"{indent}{_STEP}{attr.name}{suffix}:")
                lines.extend(_graph_lines(sub, indent + _STEP * 2))
    return lines


def _attribute_graphs(attr: AttributeProto) -> list[GraphProto]:
    if attr.type == AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def _node_text(node: NodeProto) -> str:
    op = f"{node.domain}.{node.op_type}" if normalize_domain(node.domain) else node.op_type
    arguments = list(node.input)
    arguments += [
        f"{a.name}={_attribute_value(a)}"
        for a in node.attribute
        if a.type not in (AttributeProto.GRAPH, AttributeProto.GRAPHS)
    ]
    return f"{op}({', '.join(arguments)}) -> {', '.join(node.output)}"


def _attribute_value(attr: AttributeProto) -> str:
    if attr.ref_attr_name:
        return f"@{attr.ref_attr_name}"
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return repr(value.decode("utf-8", errors="replace"))
    if isinstance(value, TensorProto):
        return _values_text(value)
    if isinstance(value, list):
        items = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value]
        return repr(items)
    return repr(value)


def _value_text(name: str, type_proto: TypeProto) -> str:
    kind = type_proto.WhichOneof("value")
    if kind != "tensor_type":
        return f"name={name!r} type={_type_text(type_proto)}"
    tensor = type_proto.tensor_type
    text = f"name={name!r} type={_dtype_text(tensor.elem_type)}"
    if tensor.HasField("shape"):
        text += f" shape={_shape_text(tensor.shape)}"
    return text


def _type_text(type_proto: TypeProto) -> str:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        return _dtype_text(type_proto.tensor_type.elem_type)
    if kind == "sequence_type":
        return f"sequence({_type_text(type_proto.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({_type_text(type_proto.optional_type.elem_type)})"
    if kind == "map_type":
        key = _dtype_text(type_proto.map_type.key_type)
        return f"map({key}, {_type_text(type_proto.map_type.value_type)})"
    return "unknown"


def _dtype_text(elem_type: int) -> str:
    try:
        return f"dtype({np_dtype(elem_type).name!r})"
    except (KeyError, TypeError, ValueError):
        return TensorProto.DataType.Name(elem_type)


def _shape_text(shape) -> str:
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape.dim
    )
    return repr(dims)


def _initializer_text(init: TensorProto) -> str:
    return (
        f"name={init.name!r} type={_dtype_text(init.data_type)} shape={tuple(init.dims)} "
        f"-- {_values_text(init)}"
    )


def _values_text(tensor: TensorProto) -> str:
    if tensor.data_location == TensorProto.EXTERNAL and not tensor.raw_data:
        return "<external data>"
    array = numpy_helper.to_array(tensor)
    values = array if array.ndim == 0 else array.ravel()[:MAX_SHOWN_VALUES]
    with np.printoptions(linewidth=sys.maxsize):
        shown = repr(values)
    if array.size > MAX_SHOWN_VALUES:
        shown += f" ... ({array.size} values)"
    return shown
