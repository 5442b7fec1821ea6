"""Bounds a model is checked against in its own terms, before shape inference runs.

onnx's shape inference and onnxruntime size their work by what a model declares: a
``Reshape`` whose shape input holds five million elements makes an output of rank five
million (seconds and gigabytes in inference, ``std::bad_alloc`` further on). Ranks are
bounded by :data:`MAX_RANK` (numpy's own limit: no array of higher rank exists):

* the declared type of every value (inputs, outputs, ``value_info``) and the dims of every
  tensor the model holds (initializers, ``Constant`` values);
* the length of every constant read where a list of dims or axes is expected
  (:data:`RANK_INPUTS`), with the 1-D lists a ``ConstantOfShape`` or ``Range`` makes from
  constants counted by their length.

Each breach is a ``ValueError`` naming the value or node.
"""

from __future__ import annotations

import math

from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import normalize_domain, subgraphs

#: The highest rank a value may have (numpy's limit).
MAX_RANK = 64
#: Default-domain inputs read as lists of dims or axes: ``{op: {input index: entries per
#: dim}}`` (``Pad``'s pads hold two per dim).
RANK_INPUTS = {
    "Reshape": {1: 1},
    "Expand": {1: 1},
    "ConstantOfShape": {0: 1},
    "Tile": {1: 1},
    "Unsqueeze": {1: 1},
    "Squeeze": {1: 1},
    "Pad": {1: 2},
    "Resize": {2: 1, 3: 1},
    "Upsample": {1: 1},
    "Slice": {1: 1, 2: 1, 3: 1, 4: 1},
}
#: Attributes holding a list of axes or dims.
RANK_ATTRIBUTES = frozenset({"axes", "perm", "shape", "pads", "kernel_shape", "strides"})


def check_bounds(model: ModelProto) -> None:
    """``ValueError`` naming the first value, tensor or node past :data:`MAX_RANK`."""
    _check_graph(model.graph)
    for function in model.functions:
        graph = GraphProto()
        graph.node.extend(function.node)
        _check_graph(graph)


def _check_graph(graph: GraphProto) -> None:
    for info in [*graph.input, *graph.output, *graph.value_info]:
        tensor = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if tensor is not None and len(tensor.shape.dim) > MAX_RANK:
            raise ValueError(
                _past(f"value {info.name!r} is declared with rank", len(tensor.shape.dim))
            )
    lengths, values = {}, {}
    for init in graph.initializer:
        _check_tensor(init, f"initializer {init.name!r}")
        lengths[init.name] = math.prod(init.dims)
        values[init.name] = _small_values(init)
    for index, node in enumerate(graph.node):
        _check_node(node, index, lengths, values)
        for sub in subgraphs(node):
            _check_graph(sub)


def _check_node(node: NodeProto, index: int, lengths: dict, values: dict) -> None:
    label = f"node {node.name or f'#{index}'!r} ({node.op_type})"
    for attribute in node.attribute:
        if attribute.type == AttributeProto.TENSOR:
            _check_tensor(attribute.t, f"{label} attribute {attribute.name!r}")
        elif (
            attribute.type == AttributeProto.INTS
            and attribute.name in RANK_ATTRIBUTES
            and len(attribute.ints) > 2 * MAX_RANK
        ):
            raise ValueError(
                _past(f"{label} attribute {attribute.name!r} lists", len(attribute.ints))
            )
    if normalize_domain(node.domain):
        return
    for position, per_dim in RANK_INPUTS.get(node.op_type, {}).items():
        if position < len(node.input) and lengths.get(node.input[position], 0) > per_dim * MAX_RANK:
            raise ValueError(
                _past(
                    f"{label} reads {node.input[position]!r} as dims or axes, a list of",
                    lengths[node.input[position]],
                )
            )
    lengths.update(_made_lengths(node, values))


def _made_lengths(node: NodeProto, values: dict) -> dict[str, int]:
    """The element counts of the outputs of ``node`` known from constants alone: a
    ``Constant``'s, and the 1-D list a ``ConstantOfShape`` or ``Range`` makes from
    constants."""
    found = {}
    if node.op_type == "Constant":
        for attribute in node.attribute:
            if attribute.type == AttributeProto.TENSOR:
                found[node.output[0]] = math.prod(attribute.t.dims)
                values[node.output[0]] = _small_values(attribute.t)
            elif attribute.type in (AttributeProto.INTS, AttributeProto.FLOATS):
                found[node.output[0]] = len(attribute.ints or attribute.floats)
    elif node.op_type == "ConstantOfShape" and node.input:
        dims = values.get(node.input[0])
        if dims is not None and len(dims) == 1:
            found[node.output[0]] = max(int(dims[0]), 0)
    elif node.op_type == "Range" and len(node.input) == 3:
        start, limit, delta = (values.get(name) for name in node.input)
        if all(v is not None and len(v) == 1 for v in (start, limit, delta)) and delta[0]:
            found[node.output[0]] = max(math.ceil((limit[0] - start[0]) / delta[0]), 0)
    return found


def _small_values(tensor: TensorProto) -> list | None:
    """The values of a tensor of at most one element (scalars feeding sizes), else None."""
    if math.prod(tensor.dims) != 1 or tensor.data_location == TensorProto.EXTERNAL:
        return None
    try:
        return numpy_helper.to_array(tensor).reshape(-1).tolist()
    except (ValueError, TypeError):
        return None


def _check_tensor(tensor: TensorProto, label: str) -> None:
    if len(tensor.dims) > MAX_RANK:
        raise ValueError(_past(f"{label} has rank", len(tensor.dims)))


def _past(what: str, count: int) -> str:
    return f"{what} {count}, over the limit of {MAX_RANK} dims (numpy's) for any value"
