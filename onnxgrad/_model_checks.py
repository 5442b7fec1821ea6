"""Structural checks of input models, run by the first passes of :mod:`onnxgrad.normalize`.

Nodes are put in topological order (onnxruntime runs unsorted graphs, so they are sorted,
never differentiated as they are) and onnx's checker must accept the model. A broken model
is a ``ValueError`` naming the node or value at fault: a node in a domain the model does
not import, a value read but never produced (a missing initializer), a value produced
twice, a cycle, a negative initializer dimension. The checker runs on a weightless view
(:func:`onnxgrad._onnx_utils.weightless_view`): no weight is copied.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto

from onnxgrad._external_data import packed_count
from onnxgrad._model_bounds import check_bounds
from onnxgrad._onnx_utils import (
    normalize_domain,
    np_dtype,
    replace_repeated,
    subgraphs,
    weightless_view,
)


def check_structure(model: ModelProto) -> None:
    """Raise ``ValueError`` naming what is wrong; sort the nodes of every graph in place."""
    imported = {normalize_domain(op.domain) for op in model.opset_import}
    imported |= {normalize_domain(f.domain) for f in model.functions}
    _check_graph(model.graph, imported, outer=set())
    check_bounds(model)


def check_with_onnx(model: ModelProto) -> None:
    """onnx's checker (without shape inference) on a weightless view of ``model``;
    ``ValueError`` with its message."""
    view = weightless_view(model)
    for info in [*view.graph.input, *view.graph.output]:
        tensor = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if tensor is not None and not tensor.HasField("shape"):
            tensor.shape.SetInParent()  # the checker wants one; onnxruntime takes unknown ranks
    try:
        onnx.checker.check_model(view)
    except onnx.checker.ValidationError as exc:
        message = " ".join(str(exc).split())
        raise ValueError(f"the model is not a valid ONNX model: {message}") from None


def describe_node(node: NodeProto, index: int) -> str:
    """``node 'name' (Op)``, or ``node #index (Op)`` for an unnamed node."""
    label = repr(node.name) if node.name else f"#{index}"
    return f"node {label} ({node.op_type})"


def _check_graph(graph: GraphProto, imported: set[str], outer: set[str]) -> None:
    _check_dims(graph)
    for index, node in enumerate(graph.node):
        domain = normalize_domain(node.domain)
        if not domain:
            _check_branch_outputs(node, index)
        if domain not in imported:
            raise ValueError(
                f"{describe_node(node, index)} is in domain "
                f"{node.domain or 'ai.onnx (the default)'!r}, which the model does not "
                "import (add it to opset_import)"
            )
    _check_initializer_names(graph)
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    order = topological_order(graph, defined, outer)
    if order != list(range(len(graph.node))):
        replace_repeated(graph.node, [graph.node[i] for i in order])
    known = outer | defined | {o for node in graph.node for o in node.output if o}
    for output in graph.output:
        if output.name not in known:
            raise ValueError(
                f"graph output {output.name!r} is not produced by any node, input or initializer"
            )
    for node in graph.node:
        for sub in subgraphs(node):
            _check_graph(sub, imported, known)


def _check_branch_outputs(node: NodeProto, index: int) -> None:
    """``ValueError`` naming an ``If`` whose branches do not give one output per output of
    the node, or a ``Loop`` whose body does not give the condition and one per output."""
    graphs = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    if node.op_type == "If":
        expected = {"then_branch": len(node.output), "else_branch": len(node.output)}
    elif node.op_type == "Loop":
        expected = {"body": 1 + len(node.output)}
    else:
        return
    for name, count in expected.items():
        if name in graphs and len(graphs[name].output) != count:
            raise ValueError(
                f"{describe_node(node, index)}: its {name} has {len(graphs[name].output)} "
                f"outputs, the node needs {count}"
            )


def _check_initializer_names(graph: GraphProto) -> None:
    """``ValueError`` naming an initializer given twice, or a sparse initializer (onnxgrad
    trains and rewrites dense weights: store it dense, e.g. with
    ``onnx.numpy_helper.from_array(dense, name)``)."""
    for sparse in graph.sparse_initializer:
        raise ValueError(
            f"sparse initializer {sparse.values.name!r} (dims {list(sparse.dims)}) is not "
            "supported: store it as a dense initializer"
        )
    seen = set()
    for init in graph.initializer:
        if init.name in seen:
            raise ValueError(f"initializer {init.name!r} is given twice")
        seen.add(init.name)


def _check_dims(graph: GraphProto) -> None:
    """A negative initializer dimension is an error; a value's declared ``-1`` is a dynamic
    dimension, as onnx's checker and onnxruntime read it
    (:func:`onnxgrad.normalize.dims.dynamic_dims` clears it)."""
    for init in graph.initializer:
        if any(d < 0 for d in init.dims):
            raise ValueError(f"initializer {init.name!r} has a negative dimension: {init.dims}")
        check_tensor_data(init, "initializer")


#: The typed field holding a tensor's values when it has no raw_data, and values per element.
_VALUE_FIELDS = {
    TensorProto.FLOAT: ("float_data", 1),
    TensorProto.COMPLEX64: ("float_data", 2),
    TensorProto.DOUBLE: ("double_data", 1),
    TensorProto.COMPLEX128: ("double_data", 2),
    TensorProto.INT64: ("int64_data", 1),
    TensorProto.UINT64: ("uint64_data", 1),
    TensorProto.UINT32: ("uint64_data", 1),
    TensorProto.STRING: ("string_data", 1),
}


def check_tensor_data(tensor: TensorProto, what: str) -> None:
    """``ValueError`` naming ``tensor`` when its data does not hold ``prod(dims)`` elements
    (a declaration that lies about the data, or a damaged file). External data is checked
    where it is read."""
    if tensor.data_location == TensorProto.EXTERNAL or tensor.data_type == TensorProto.UNDEFINED:
        return
    elements = math.prod(tensor.dims)
    packed = packed_count(tensor.data_type, elements)
    if tensor.HasField("raw_data"):
        unit, count, itemsize = "bytes", len(tensor.raw_data), _itemsize(tensor)
        expected = packed if packed is not None else itemsize and elements * itemsize
    else:
        field, per_element = _VALUE_FIELDS.get(tensor.data_type, ("int32_data", 1))
        unit, count = "values", len(getattr(tensor, field))
        expected = packed if packed is not None else elements * per_element
    if expected is not None and count != expected:  # None: an element type onnx cannot size
        raise ValueError(
            f"{what} {tensor.name!r} declares dims {list(tensor.dims)} ({elements} elements) "
            f"but its data holds {count} {unit}, not {expected}"
        )


def _itemsize(tensor: TensorProto) -> int | None:
    try:
        return np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None


def topological_order(
    graph: GraphProto, defined: set[str], outer: set[str] = frozenset()
) -> list[int]:
    """Indices of ``graph.node`` in an order where every node comes after the producers of
    what it reads (the original order wherever it already is one).

    ``defined`` names the graph's inputs and initializers, ``outer`` what enclosing graphs
    define (a node output may shadow those). ``ValueError`` names a value produced twice, a
    value nobody produces, or the nodes of a cycle.
    """
    nodes = list(graph.node)
    producer: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node.output:
            if not name:
                continue
            if name in producer or name in defined:
                first = (
                    describe_node(nodes[producer[name]], producer[name])
                    if name in producer
                    else "an input or initializer"
                )
                raise ValueError(
                    f"value {name!r} is produced twice: by {first} and by "
                    f"{describe_node(node, index)}"
                )
            producer[name] = index
    waiting = [0] * len(nodes)
    readers: dict[int, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in _reads(node):
            if name in defined or (name in outer and name not in producer):
                continue
            if name not in producer:
                raise ValueError(
                    f"{describe_node(node, index)} reads {name!r}, which no node, graph input "
                    "or initializer produces (a missing initializer or input?)"
                )
            waiting[index] += 1
            readers.setdefault(producer[name], []).append(index)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for reader in readers.get(index, ()):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, reader)
    if len(order) < len(nodes):
        cycle = _cycle(nodes, producer, waiting)
        shown = " -> ".join(describe_node(nodes[i], i) for i in cycle[:_SHOWN_CYCLE])
        more = f" -> ... ({len(cycle)} nodes in all)" if len(cycle) > _SHOWN_CYCLE else ""
        raise ValueError(f"the graph has a cycle: {shown}{more} -> back to the first")
    return order


#: The nodes of a cycle an error shows.
_SHOWN_CYCLE = 12


def _cycle(nodes: list[NodeProto], producer: dict[str, int], waiting: list[int]) -> list[int]:
    """The nodes of one cycle among those still waiting, in data-flow order from the first
    in the graph."""
    current = next(i for i, count in enumerate(waiting) if count)
    path: list[int] = []
    position: dict[int, int] = {}  # node -> its place in path: linear, however long the cycle
    while current not in position:
        position[current] = len(path)
        path.append(current)
        current = next(
            producer[name]
            for name in sorted(_reads(nodes[current]))
            if name in producer and waiting[producer[name]]
        )
    cycle = path[position[current] :][::-1]
    start = cycle.index(min(cycle))
    return cycle[start:] + cycle[:start]


def _reads(node: NodeProto) -> Iterable[str]:
    """Each distinct name a node reads, once per name (inputs and subgraphs' free names)."""
    names = set(node.input[:])  # a slice: a third of the time of iterating the field
    names.discard("")
    if node.attribute:
        from onnxgrad.graph._scopes import free_names  # onnxgrad.graph imports this module

        for sub in subgraphs(node):
            names |= free_names(sub)
    return names
