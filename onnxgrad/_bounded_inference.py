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
from onnx import GraphProto, ModelProto

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
            return plain
        return onnx.shape_inference.infer_shapes(view, data_prop=True)


def _propagation_is_bounded(inferred: ModelProto) -> bool:
    """Whether data propagation creates at most :data:`MAX_PROPAGATED_VALUES` list elements
    for ``inferred`` (a model after plain inference, or a model whose declarations already
    rank every input of its propagating operators: plain inference merges what it finds
    into a declared type, never changing its rank or a declared dimension, so both give
    the same answer)."""
    ranks = _ranks_and_lengths(inferred.graph)
    local = {(normalize_domain(f.domain), f.name) for f in inferred.functions}
    total = 0
    for graph in [inferred.graph, *(_function_graph(f) for f in inferred.functions)]:
        for node in _all_nodes(graph):
            if not _may_propagate(node, local):
                continue
            for name in filter(None, node.input):
                rank, length = ranks.get(name, (None, None))
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


def _ranks_and_lengths(graph: GraphProto) -> dict[str, tuple[int | None, int | None]]:
    """``name -> (rank, length of a 1-D value)`` of the typed values of ``graph`` and its
    subgraphs (``None`` where unknown); values with data (initializers, Constant outputs,
    whose data is read rather than their declared length) count as rank 0."""
    found: dict[str, tuple[int | None, int | None]] = {}
    for node in graph.node:
        for sub in subgraphs(node):
            found.update(_ranks_and_lengths(sub))
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if tensor is None or not tensor.HasField("shape"):
            found[info.name] = (None, None)
            continue
        dims = tensor.shape.dim
        length = dims[0].dim_value if len(dims) == 1 and dims[0].HasField("dim_value") else None
        found[info.name] = (len(dims), length)
    for init in graph.initializer:
        found[init.name] = (0, None)
    for node in graph.node:
        if node.op_type == "Constant" and not normalize_domain(node.domain):
            found.update({name: (0, None) for name in node.output})
    return found


def _function_graph(function: onnx.FunctionProto) -> GraphProto:
    graph = GraphProto()
    graph.node.extend(function.node)
    return graph


def _all_nodes(graph: GraphProto):
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from _all_nodes(sub)
