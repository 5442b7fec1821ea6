"""Replacing operators of the main graph by standard ONNX computing the same outputs.

:func:`lower_nodes` walks the main graph in topological order, typing every value as it
goes (onnx's per-node inference on standard operators, the lowered nodes included), and
replaces each node a table names by the nodes its lowering emits, in its place, writing the
same output names. A lowering receives a :class:`Lowerer`: the node, the element types and
ranks known so far, and a builder of new nodes and constants. Nodes inside subgraphs are
left as they are (the gradient then names them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, TypeProto, helper

from onnxgrad._onnx_utils import default_opset, normalize_domain, np_dtype
from onnxgrad.graph._builder import GraphBuilder
from onnxgrad.graph._scopes import iter_graphs

LoweringFn = Callable[["Lowerer"], None]

#: The element types computed in float32 by onnxruntime's CPU kernels of the fused operators.
HALF_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})


class Lowerer:
    """What a lowering needs: the node, the types known so far, and a node builder."""

    def __init__(self, builder: GraphBuilder, types: dict[str, TypeProto], node: NodeProto):
        self.builder = builder
        self.types = types
        self.node = node
        self.opset = builder.opset
        #: the model's nodes as they were, by output name, and how often each value is read
        self.producers: dict[str, NodeProto] = {}
        self.uses: Counter = Counter()
        #: the names of the main graph's initializers
        self.initializers: set[str] = set()
        #: ids of nodes this lowering made useless: removed once nothing reads them
        self.superseded: set[int] = set()
        #: types a lowering states for its outputs from the operator's specification, for
        #: the values onnx's per-node inference leaves untyped or without a rank
        self.declared: dict[str, TypeProto] = {}
        self._readers: dict[str, list[NodeProto]] | None = None

    def readers(self, name: str) -> list[NodeProto]:
        """The model's nodes (as they were) that read ``name``."""
        if self._readers is None:
            self._readers = {}
            nodes = {id(node): node for node in self.producers.values()}
            for node in nodes.values():
                for used in dict.fromkeys(node.input):
                    self._readers.setdefault(used, []).append(node)
        return self._readers.get(name, [])

    def input(self, index: int) -> str:
        """The name of input ``index``, ``''`` when absent."""
        return self.node.input[index] if index < len(self.node.input) else ""

    def output(self, index: int) -> str:
        """The name of output ``index``, ``''`` when not requested."""
        return self.node.output[index] if index < len(self.node.output) else ""

    def attr(self, name: str, default=None):
        for attribute in self.node.attribute:
            if attribute.name == name:
                return helper.get_attribute_value(attribute)
        return default

    def elem(self, name: str) -> int:
        """The element type of ``name`` (``ValueError`` naming the node when unknown)."""
        found = self.types.get(name)
        if found is None or not found.tensor_type.elem_type:
            raise self.error(f"the element type of its input {name!r} is unknown")
        return found.tensor_type.elem_type

    def rank(self, name: str) -> int:
        """The rank of ``name`` (``ValueError`` naming the node when unknown)."""
        found = self.types.get(name)
        if found is None or not found.tensor_type.HasField("shape"):
            raise self.error(f"the rank of its input {name!r} is unknown")
        return len(found.tensor_type.shape.dim)

    def dims(self, name: str) -> list[int | None] | None:
        """The static dimensions of ``name`` (``None`` for unknown ones), or ``None``."""
        found = self.types.get(name)
        if found is None or not found.tensor_type.HasField("shape"):
            return None
        return [
            d.dim_value if d.HasField("dim_value") else None for d in found.tensor_type.shape.dim
        ]

    def declare(self, name: str, elem_type: int, dims: list[int | str | None]) -> None:
        """State the type of ``name`` as the operator's specification gives it (``dims``:
        sizes, symbolic names or ``None``), kept where onnx's inference knows less."""
        self.declared[name] = helper.make_tensor_type_proto(elem_type, dims)

    def error(self, reason: str) -> ValueError:
        node = self.node
        label = f"{node.op_type!r} ({node.domain or 'ai.onnx'})"
        return ValueError(f"cannot lower node {node.name!r} {label}: {reason}")

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attributes) -> str:
        return self.builder.op(op_type, *inputs, out=out, **attributes)

    def ops(self, op_type: str, inputs: list[str], count: int, **attributes) -> list[str]:
        """A node with ``count`` fresh outputs."""
        outs = [self.builder.fresh(op_type.lower()) for _ in range(count)]
        name = self.builder._nodes.unique(f"{self.builder.prefix}_{op_type}")
        self.builder.graph.node.append(
            helper.make_node(op_type, inputs, outs, name=name, **attributes)
        )
        return outs

    def const(self, value, elem_type: int) -> str:
        """A structural constant of ``elem_type`` holding ``value``."""
        return self.builder.const(np.asarray(value, dtype=np_dtype(elem_type)), "c")

    def ints(self, values) -> str:
        return self.builder.const(np.asarray(values, dtype=np.int64), "ints")

    def cast(self, x: str, to: int, out: str | None = None) -> str:
        return self.op("Cast", x, out=out, to=int(to))

    def reduce_mean(self, x: str, axes: list[int]) -> str:
        return self.builder.reduce("ReduceMean", x, axes, keepdims=1)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        return self.op("Unsqueeze", x, self.ints(axes))

    def split_last(self, x: str, parts: int) -> list[str]:
        """``x`` cut into ``parts`` equal pieces along its last axis."""
        if self.opset >= 18:
            return self.ops("Split", [x], parts, axis=-1, num_outputs=parts)
        return self.ops("Split", [x], parts, axis=-1)

    def slice_last(self, x: str, start: int, end: int, step: int = 1) -> str:
        return self.op(
            "Slice", x, self.ints([start]), self.ints([end]), self.ints([-1]), self.ints([step])
        )

    def compute_type(self, elem_type: int) -> int:
        """float32 for float16 and bfloat16 (onnxruntime's kernels compute in float), else
        ``elem_type``."""
        return TensorProto.FLOAT if elem_type in HALF_TYPES else elem_type

    def to_compute(self, x: str, elem_type: int) -> str:
        """``x`` cast to :meth:`compute_type` when that differs from ``elem_type``."""
        target = self.compute_type(elem_type)
        return x if target == elem_type else self.cast(x, target)

    def finish(self, y: str, elem_type: int, index: int = 0) -> None:
        """Write ``y`` (in the compute type) to output ``index`` as ``elem_type``."""
        out = self.output(index)
        if not out:
            return
        if self.compute_type(elem_type) != elem_type:
            self.cast(y, elem_type, out=out)
        else:
            self.op("Identity", y, out=out)


def reading_only(
    lowering: LoweringFn, known: frozenset[str] | set[str], neutral: Mapping | None = None
) -> LoweringFn:
    """``lowering``, refusing a node that sets an attribute outside ``known`` (those the
    lowering reads) to anything but its ``neutral`` value (the one that changes nothing):
    an attribute a newer onnxruntime added is an error naming node and attribute, never a
    silently different computation."""
    neutral = dict(neutral or {})

    def checked(lw: Lowerer) -> None:
        for attribute in lw.node.attribute:
            if attribute.name in known:
                continue
            value = helper.get_attribute_value(attribute)
            value = value.decode() if isinstance(value, bytes) else value
            if attribute.name not in neutral or value != neutral[attribute.name]:
                raise lw.error(f"attribute {attribute.name}={value!r} is not supported")
        lowering(lw)

    checked.__doc__ = lowering.__doc__
    checked.__name__ = getattr(lowering, "__name__", "lowering")
    return checked


def lower_nodes(model: ModelProto, table: Mapping[tuple[str, str], LoweringFn]) -> ModelProto:
    """``model`` with every main-graph node whose ``(domain, op_type)`` is in ``table``
    replaced by what its lowering emits (see the module docstring)."""
    graph = model.graph
    if not any(_key(node) in table for node in graph.node):
        return model
    opset = default_opset(model)
    imports = list(model.opset_import)
    types = _declared_types(graph)
    builder = GraphBuilder(graph, opset, "lowered")
    context = Lowerer(builder, types, NodeProto())
    context.producers = {out: node for node in graph.node for out in node.output if out}
    context.initializers = {init.name for init in graph.initializer}
    context.uses = Counter(name for node in graph.node for name in node.input if name)
    context.uses.update(o.name for o in graph.output)
    constants = _integer_initializers(graph)
    nodes: list[NodeProto] = []
    for node in list(graph.node):
        lowering = table.get(_key(node))
        if lowering is None:
            emitted = [node]
        else:
            emitted = _lower_one(builder, context, node, lowering)
            graph.initializer.extend(builder.graph.initializer)
        for new in emitted:
            _infer_into(new, types, imports, constants)
        _keep_declared(context.declared, types)
        nodes.extend(emitted)
    builder.graph = graph
    del graph.node[:]
    graph.node.extend(_without_superseded(nodes, context.superseded, graph))
    _drop_unused_imports(model, {domain for domain, _ in table if domain})
    return model


def _lower_one(
    builder: GraphBuilder, context: Lowerer, node: NodeProto, lowering: LoweringFn
) -> list[NodeProto]:
    scratch = GraphProto()
    builder.graph = scratch
    context.node = node
    lowering(context)
    # a node kept as it is stays the model's own (appending copies it), so that a later
    # lowering that supersedes it finds it by identity
    return [node if new == node else new for new in scratch.node]


def _without_superseded(nodes: list[NodeProto], superseded: set[int], graph) -> list[NodeProto]:
    """``nodes`` less the superseded ones whose outputs nothing reads any more (a chain of
    them, once its last reader is gone)."""
    while True:
        read = {name for node in nodes for name in node.input} | {o.name for o in graph.output}
        kept = [n for n in nodes if id(n) not in superseded or any(o in read for o in n.output)]
        if len(kept) == len(nodes):
            return nodes
        nodes = kept


def _key(node: NodeProto) -> tuple[str, str]:
    return normalize_domain(node.domain), node.op_type


def _declared_types(graph: GraphProto) -> dict[str, TypeProto]:
    types: dict[str, TypeProto] = {}
    for info in [*graph.input, *graph.value_info]:
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type
    for init in graph.initializer:
        types[init.name] = helper.make_tensor_type_proto(init.data_type, list(init.dims))
    return types


#: the most elements of an integer constant handed to onnx's inference (axes, shapes, pads)
_SMALL = 64


def _integer_initializers(graph: GraphProto) -> dict[str, TensorProto]:
    """The small integer initializers of ``graph`` by name: what onnx's inference reads as
    axes, shapes or pads given as inputs."""
    return {init.name: init for init in graph.initializer if _is_small_integer(init)}


def _infer_into(
    node: NodeProto, types: dict[str, TypeProto], imports, constants: dict[str, TensorProto]
) -> None:
    """Add the types onnx infers for ``node``'s outputs (nothing when it cannot), reading the
    values of the small integer constants among its inputs (a ``ReduceSum``'s or an
    ``Unsqueeze``'s axes, a ``Reshape``'s shape), and record ``node``'s value if it is one."""
    _record_constant(node, constants)
    domain = normalize_domain(node.domain)
    version = next((o.version for o in imports if normalize_domain(o.domain) == domain), None)
    if version is None:
        return
    try:
        schema = onnx.defs.get_schema(node.op_type, version, domain)
        known = {name: types[name] for name in node.input if name in types}
        data = {name: constants[name] for name in node.input if name in constants}
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, node, known, data, opset_imports=imports
        )
    except Exception:  # an untyped value only matters to a later lowering, which says so
        return
    for name, found in inferred.items():
        if found.HasField("tensor_type") and found.tensor_type.elem_type:
            types[name] = found


def _record_constant(node: NodeProto, constants: dict[str, TensorProto]) -> None:
    if node.op_type != "Constant" or normalize_domain(node.domain) or len(node.attribute) != 1:
        return
    attribute = node.attribute[0]
    if attribute.name != "value" or not _is_small_integer(attribute.t):
        return
    value = TensorProto()
    value.CopyFrom(attribute.t)
    value.name = node.output[0]
    constants[node.output[0]] = value


def _is_small_integer(tensor: TensorProto) -> bool:
    return (
        tensor.data_type in (TensorProto.INT64, TensorProto.INT32)
        and int(np.prod(tensor.dims)) <= _SMALL
    )


def _keep_declared(declared: dict[str, TypeProto], types: dict[str, TypeProto]) -> None:
    """Declared types of values whose inferred type has no shape (moved into ``types``)."""
    for name, found in list(declared.items()):
        known = types.get(name)
        if known is None or not known.tensor_type.HasField("shape"):
            types[name] = found
        del declared[name]


def _drop_unused_imports(model: ModelProto, domains: set[str]) -> None:
    """Remove the imports of ``domains`` (the lowered ones) that no node uses any more."""
    used = {normalize_domain(n.domain) for g in iter_graphs(model.graph) for n in g.node}
    used |= {normalize_domain(f.domain) for f in model.functions}
    used |= {normalize_domain(n.domain) for f in model.functions for n in f.node}
    kept = [
        o
        for o in model.opset_import
        if normalize_domain(o.domain) in used or normalize_domain(o.domain) not in domains
    ]
    if len(kept) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(kept)
