"""Input models checked up front, and weightless views of big models.

Every public entry point (``onnx_derivative``, ``add_loss_output``, ``get_train_initializer``,
the command) works on :func:`checked_model`: a private copy whose nodes are in topological
order (onnxruntime runs unsorted graphs, so they are sorted, never differentiated as they
are) and which onnx's checker accepts. A broken model is a ``ValueError`` naming the node or
value at fault: a node in a domain the model does not import, a value read but never
produced (a missing initializer), a value produced twice, a cycle, a negative dimension.

Shape inference and the checker serialise the model, which protobuf refuses past 2 GiB and
which copies every weight: :func:`weightless_view` gives them the graph with its big
initializers declared as inputs instead (same names, types and shapes, no data).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto

from onnxgrad._onnx_utils import (
    ModelLike,
    load_model,
    normalize_domain,
    np_dtype,
    subgraphs,
    supported_ir_version,
)

#: Initializers larger than this (in bytes) are left out of weightless views.
WEIGHTLESS_THRESHOLD = 4096
#: protobuf refuses to serialise a message of 2 GiB or more.
PROTOBUF_LIMIT = 2**31


def checked_model(model: ModelLike) -> ModelProto:
    """A private copy of ``model``, checked and with its nodes in topological order."""
    model = load_model(model)
    try:
        check_in_place(model)
    except UnicodeDecodeError as exc:  # protobuf decodes strings when they are read
        raise ValueError(f"the model holds a name that is not UTF-8 text ({exc})") from None
    return model


def check_in_place(model: ModelProto) -> None:
    """:func:`checked_model` on a model already private: sorted in place."""
    check_structure(model)
    check_with_onnx(model)


def check_structure(model: ModelProto) -> None:
    """Raise ``ValueError`` naming what is wrong; sort the nodes of every graph in place."""
    imported = {normalize_domain(op.domain) for op in model.opset_import}
    imported |= {normalize_domain(f.domain) for f in model.functions}
    _check_graph(model.graph, imported, outer=set())


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


def weightless_view(model: ModelProto) -> ModelProto:
    """A copy of ``model`` whose big initializers are graph inputs of the same type and
    shape: shape inference and the checker give the same answers at a fraction of the
    cost, past protobuf's 2 GiB limit too. Small ones (shapes, axes) stay: inference reads
    their values."""
    view = ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(view, field, value)
    graph = model.graph
    for field, value in graph.ListFields():
        if field.name != "initializer":
            _copy_field(view.graph, field, value)
    declared = {i.name for i in graph.input}
    for init in graph.initializer:
        if tensor_nbytes(init) <= WEIGHTLESS_THRESHOLD and not _is_external(init):
            view.graph.initializer.add().CopyFrom(init)
        elif init.name not in declared:
            view.graph.input.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    view.ir_version = supported_ir_version(model)
    return view


def _copy_field(target, field, value) -> None:
    if hasattr(value, "extend"):
        getattr(target, field.name).extend(value)
    elif hasattr(value, "CopyFrom"):
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def tensor_nbytes(tensor: TensorProto) -> int:
    """The size of a tensor's data (0 for strings and unknown types)."""
    if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return 0
    try:
        itemsize = np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 0
    return math.prod(tensor.dims) * itemsize


def _is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def weights_nbytes(model: ModelProto) -> int:
    """Bytes held by the initializers of the main graph."""
    return sum(tensor_nbytes(init) for init in model.graph.initializer)


def describe_node(node: NodeProto, index: int) -> str:
    """``node 'name' (Op)``, or ``node #index (Op)`` for an unnamed node."""
    label = repr(node.name) if node.name else f"#{index}"
    return f"node {label} ({node.op_type})"


def _check_graph(graph: GraphProto, imported: set[str], outer: set[str]) -> None:
    _check_dims(graph)
    for index, node in enumerate(graph.node):
        domain = normalize_domain(node.domain)
        if domain not in imported:
            raise ValueError(
                f"{describe_node(node, index)} is in domain "
                f"{node.domain or 'ai.onnx (the default)'!r}, which the model does not "
                "import (add it to opset_import)"
            )
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined |= {i.values.name for i in graph.sparse_initializer}
    order = topological_order(graph, defined, outer)
    if order != list(range(len(graph.node))):
        nodes = [graph.node[i] for i in order]
        copies = [NodeProto() for _ in nodes]
        for copy, node in zip(copies, nodes, strict=True):
            copy.CopyFrom(node)
        del graph.node[:]
        graph.node.extend(copies)
    known = outer | defined | {o for node in graph.node for o in node.output if o}
    for output in graph.output:
        if output.name not in known:
            raise ValueError(
                f"graph output {output.name!r} is not produced by any node, input or initializer"
            )
    for node in graph.node:
        for sub in subgraphs(node):
            _check_graph(sub, imported, known)


def _check_dims(graph: GraphProto) -> None:
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            dims = [d.dim_value for d in info.type.tensor_type.shape.dim]
            if any(d < 0 for d in dims):
                raise ValueError(f"value {info.name!r} declares a negative dimension: {dims}")
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
#: Element types packed two to a byte (and two to an int32_data value).
HALF_BYTE_TYPES = {
    getattr(TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1")
    if hasattr(TensorProto, name)
}


def check_tensor_data(tensor: TensorProto, what: str) -> None:
    """``ValueError`` naming ``tensor`` when its data does not hold ``prod(dims)`` elements
    (a declaration that lies about the data, or a damaged file). External data is checked
    where it is read."""
    if tensor.data_location == TensorProto.EXTERNAL or tensor.data_type == TensorProto.UNDEFINED:
        return
    elements = math.prod(tensor.dims)
    packed = tensor.data_type in HALF_BYTE_TYPES
    if tensor.HasField("raw_data"):
        unit, count, itemsize = "bytes", len(tensor.raw_data), _itemsize(tensor)
        expected = -(-elements // 2) if packed else itemsize and elements * itemsize
    else:
        field, per_element = _VALUE_FIELDS.get(tensor.data_type, ("int32_data", 1))
        unit, count = "values", len(getattr(tensor, field))
        expected = -(-elements // 2) if packed else elements * per_element
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
        shown = " -> ".join(describe_node(nodes[i], i) for i in cycle)
        raise ValueError(f"the graph has a cycle: {shown} -> back to the first")
    return order


def _cycle(nodes: list[NodeProto], producer: dict[str, int], waiting: list[int]) -> list[int]:
    """The nodes of one cycle among those still waiting, in data-flow order from the first
    in the graph."""
    current = next(i for i, count in enumerate(waiting) if count)
    path: list[int] = []
    while current not in path:
        path.append(current)
        current = next(
            producer[name]
            for name in sorted(_reads(nodes[current]))
            if name in producer and waiting[producer[name]]
        )
    cycle = path[path.index(current) :][::-1]
    start = cycle.index(min(cycle))
    return cycle[start:] + cycle[:start]


def _reads(node: NodeProto) -> Iterable[str]:
    """Each distinct name a node reads, once per name (inputs and subgraphs' free names)."""
    from onnxgrad.graph._scopes import free_names  # onnxgrad.graph imports this module

    names = {name for name in node.input if name}
    for sub in subgraphs(node):
        names |= free_names(sub)
    return names
