"""onnx's shape inference with data propagation, bounded by what the model holds.

Data propagation (``infer_shapes(..., data_prop=True)``) follows the values of shape
tensors (``Shape -> Gather -> Concat -> Reshape``), which plain inference cannot size.
Its operators (:data:`PROPAGATING_OPS`) read each input as a list of values: from its data
when the model gives data, otherwise, for a 1-D input of static length ``n``, as ``n``
unknown values. That list is allocated whatever ``n`` is: a declared length of ``2**31``
(an 88-byte model) takes gigabytes, a legitimate 1-D weight of ``2**24`` floats takes
seconds and about a gigabyte per operator.

:func:`infer_shapes_bounded` adds data propagation only when every input of a propagating
operator is known to be a 1-D list of at most :data:`MAX_PROPAGATED_VALUES` values in all,
or of rank other than 1. It reads that from the model's own declarations when they tell it
(an exporter that declares every value: inference keeps a declared rank and a declared
dimension, so the plain pass would find the same bound), otherwise from a plain inference
first (its cost grows with the ranks, never with the sizes). A value whose rank or length
that pass leaves open could become a long 1-D list once propagated, so it keeps data
propagation off too: the plain pass's types are then the answer.
"""

from __future__ import annotations

import onnx
from onnx import GraphProto, ModelProto, ValueInfoProto

from onnxgrad._onnx_utils import normalize_domain, onnx_errors_as_value_errors, subgraphs

#: The operators with a data propagation function in onnx (1.16 to 1.23).
PROPAGATING_OPS = frozenset(
    {"Add", "Cast", "Concat", "Div", "Gather", "Identity", "Mul", "Shape", "Size", "Slice"}
    | {"Squeeze", "Sub", "Unsqueeze"}
)
#: The most list elements data propagation may create, all operators together.
MAX_PROPAGATED_VALUES = 2**16


def infer_shapes_bounded(view: ModelProto) -> ModelProto:
    """``view`` with the types shape inference gives, data propagated within the bound
    (see the module docstring); onnx's errors are one-line ``ValueError``."""
    with onnx_errors_as_value_errors():
        if _propagation_is_bounded(view):  # the declarations bound it: no plain pass needed
            return onnx.shape_inference.infer_shapes(view, data_prop=True)
        plain = onnx.shape_inference.infer_shapes(view)
        if not _propagation_is_bounded(plain):
            sized = _with_filled_shapes(view, plain)
            if sized is None:
                return plain
            view, plain = sized, onnx.shape_inference.infer_shapes(sized)
            if not _propagation_is_bounded(plain):
                return plain
        return onnx.shape_inference.infer_shapes(view, data_prop=True)


def _with_filled_shapes(view: ModelProto, plain: ModelProto) -> ModelProto | None:
    """``view`` declaring the type of each ``ConstantOfShape(Shape(t))`` whose ``t`` has
    static dimensions after the plain pass (a tensor shaped like ``t``: PyTorch's
    ``repeat`` fills one so before an ``Expand``), which plain inference leaves unsized;
    ``None`` where there is none. Sizes come from declared or inferred dimensions, never
    from data, so the bound check that follows sees them."""
    graph = plain.graph
    infos = {i.name: i for i in [*graph.input, *graph.value_info, *graph.output]}
    producer = {o: n for n in graph.node for o in n.output}
    declared = {i.name for i in [*view.graph.input, *view.graph.output]}
    added = []
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or normalize_domain(node.domain):
            continue
        shape_node = producer.get(node.input[0]) if node.input else None
        if shape_node is None or shape_node.op_type != "Shape" or node.output[0] in declared:
            continue
        dims = _static_dims(infos.get(shape_node.input[0]))
        if dims is None or _static_dims(infos.get(node.output[0])) is not None:
            continue
        attrs = {a.name: a.i for a in shape_node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(dims))
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        elem = value.data_type if value is not None else onnx.TensorProto.FLOAT
        added.append(onnx.helper.make_tensor_value_info(node.output[0], elem, dims[start:end]))
    if not added:
        return None
    sized = ModelProto()
    sized.CopyFrom(view)
    names = {info.name for info in added}
    kept = [info for info in sized.graph.value_info if info.name not in names]
    del sized.graph.value_info[:]
    sized.graph.value_info.extend([*kept, *added])
    return sized


def _static_dims(info: ValueInfoProto | None) -> list[int] | None:
    if info is None or not info.type.HasField("tensor_type"):
        return None
    tensor = info.type.tensor_type
    if not tensor.HasField("shape") or not all(d.HasField("dim_value") for d in tensor.shape.dim):
        return None
    return [d.dim_value for d in tensor.shape.dim]


def _propagation_is_bounded(inferred: ModelProto) -> bool:
    """Whether data propagation creates at most :data:`MAX_PROPAGATED_VALUES` list elements
    for ``inferred`` (a model after plain inference, or a model whose declarations already
    rank every input of its propagating operators: plain inference merges what it finds
    into a declared type, never changing its rank or a declared dimension, so both give
    the same answer)."""
    local = {(normalize_domain(f.domain), f.name) for f in inferred.functions}
    read: list[str] = []
    typed = _typed_values(inferred.graph, local, read)
    for function in inferred.functions:  # their reads are looked up in the main graph's
        _typed_values(function, local, read)
    ranked: dict[str, tuple[int | None, int | None]] = {}
    total = 0
    for name in read:
        if name not in ranked:
            ranked[name] = _rank_and_length(typed.get(name, _UNTYPED))
        rank, length = ranked[name]
        if rank is None or (rank == 1 and length is None):
            return False
        if rank == 1:
            total += length
    return total <= MAX_PROPAGATED_VALUES


def _may_propagate(node: onnx.NodeProto, local: set[tuple[str, str]]) -> bool:
    """A propagating operator, or a call of a model-local function (whose body may hold
    one)."""
    domain = normalize_domain(node.domain)
    return (not domain and node.op_type in PROPAGATING_OPS) or (domain, node.op_type) in local


#: What :func:`_typed_values` gives a value with data, and a value it does not know.
_WITH_DATA, _UNTYPED = "data", "untyped"


def _typed_values(
    graph: GraphProto | onnx.FunctionProto, local: set[tuple[str, str]], read: list[str]
) -> dict[str, ValueInfoProto | str]:
    """``name -> its declaration`` for the values of ``graph`` (or a function's body) and
    its subgraphs, the graph's own read after its subgraphs'; :data:`_WITH_DATA` for values
    with data (initializers, Constant outputs, whose data is read rather than their
    declared length). Appends to ``read`` the inputs of every operator that may propagate
    data (:func:`_may_propagate`), each time one reads it: one walk of the nodes."""
    found: dict[str, ValueInfoProto | str] = {}
    with_data: list[str] = []
    for node in graph.node:
        for sub in subgraphs(node):
            found.update(_typed_values(sub, local, read))
        if _may_propagate(node, local):
            read.extend(filter(None, node.input))
        if node.op_type == "Constant" and not normalize_domain(node.domain):
            with_data.extend(node.output)
    if isinstance(graph, onnx.FunctionProto):
        return found
    for info in [*graph.input, *graph.value_info, *graph.output]:
        found[info.name] = info
    found.update(dict.fromkeys((init.name for init in graph.initializer), _WITH_DATA))
    found.update(dict.fromkeys(with_data, _WITH_DATA))
    return found


def _rank_and_length(value: ValueInfoProto | str) -> tuple[int | None, int | None]:
    """``(rank, length of a 1-D value)`` of a value :func:`_typed_values` gives (``None``
    where unknown); a value with data counts as rank 0."""
    if value is _WITH_DATA:
        return 0, None
    if value is _UNTYPED or not value.type.HasField("tensor_type"):
        return None, None
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None, None
    dims = tensor.shape.dim
    length = dims[0].dim_value if len(dims) == 1 and dims[0].HasField("dim_value") else None
    return len(dims), length
