r"""Forward mode by tangent propagation: one pass over the graph, in order.

For each node on a path from a source, a tangent rule (:mod:`.tangent_rules`) writes the
tangents of its outputs from the tangents of its inputs,
``\dot y = \sum_i \partial f / \partial x_i \cdot \dot x_i``. Symbolic zeros stand for the
tangents of values no source reaches, so a rule only builds the terms that exist.

A tangent is *exact* (the shape of its value) or *loose*: only broadcastable to it, as the
tangent ``\dot x`` of ``y = x + b`` is when ``b`` alone makes ``y`` larger. Broadcasting
operators take loose tangents as they come; the others (reductions, reshapes, products)
ask for the exact one, ``Expand(\dot x, Shape(x))``, which is built once per value.

An operator without a tangent rule but defined by an ONNX function (``Attention``,
``RMSNormalization``...) is followed through its body: the body is computed again under fresh
names beside the fused node (which keeps computing the outputs) and the tangents propagate
through the body's nodes, as the reverse mode's function fallback does. Any other node
without a tangent rule, or one holding a subgraph, stops the pass with
:class:`NoTangentRule`: the caller then transposes the reverse graph instead
(:mod:`onnxgrad.derivative.forward`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, NameScope, normalize_domain, np_dtype, subgraphs
from onnxgrad.derivative.autodiff.builder import GradBuilder, GraphEmitter, NodeView
from onnxgrad.derivative.autodiff.functions import FunctionExpansionError, expand_node
from onnxgrad.derivative.autodiff.registry import has_zero_gradient
from onnxgrad.derivative.autodiff.value_types import (
    UnknownTypeError,
    ValueType,
    infer_value_types,
    value_info,
)
from onnxgrad.graph._scopes import node_inputs


class NoTangentRule(NotImplementedError):
    """A node the tangent pass cannot handle (the message names it)."""


@dataclass(frozen=True)
class Tangent:
    """The tangent of a value: its name and whether it has the value's shape (``exact``)
    or is only broadcastable to it."""

    name: str
    exact: bool = True


class TangentContext:
    """What a tangent rule sees: the node, its inputs' tangents and a builder."""

    def __init__(self, engine: TangentEngine, node: NodeView, tangents: list[Tangent | None]):
        self._engine = engine
        self.node = node
        self.b = GradBuilder(engine.emitter, f"{node.name or node.op_type}_Tangent/")
        self._tangents = tangents

    def active(self, index: int) -> bool:
        """Whether input ``index`` has a tangent (is not a symbolic zero)."""
        return index < len(self._tangents) and self._tangents[index] is not None

    def loose(self, index: int) -> str | None:
        """The tangent of input ``index`` as it is (broadcastable to the input), or None."""
        tangent = self._tangents[index] if index < len(self._tangents) else None
        return None if tangent is None else tangent.name

    def is_exact(self, index: int) -> bool:
        tangent = self._tangents[index] if index < len(self._tangents) else None
        return tangent is not None and tangent.exact

    def exact(self, index: int) -> str | None:
        """The tangent of input ``index`` with the input's shape, or None."""
        if not self.active(index):
            return None
        return self._engine.exact(self.node.inputs[index], self.b)

    def exact_or_zeros(self, index: int) -> str:
        """The exact tangent of input ``index``, zeros of its shape where it has none."""
        tangent = self.exact(index)
        if tangent is not None:
            return tangent
        return zeros_of(self.b, self.node.inputs[index], self.b.dtype(self.like))

    def shape(self, name: str) -> tuple | None:
        """The shape of a forward value (declared, else inferred), or None."""
        return self._engine.shape(name)

    def forward_output(self, index: int) -> str:
        """Output ``index`` of the forward node (an optional one it will now compute, as
        MaxPool's ``Indices``, added when the pass succeeds)."""
        return self._engine.expose(self.node.proto, index, self.b)

    @property
    def like(self) -> str:
        """The first input with a tangent: its element type is the tangents' (for
        ``b.const(value, like=ctx.like)``)."""
        return next(n for i, n in enumerate(self.node.inputs) if self.active(i))

    def only(self, *indices: int) -> None:
        """Refuse (:class:`NoTangentRule`) a tangent on any input but ``indices``."""
        others = [
            self.node.inputs[i]
            for i in range(len(self._tangents))
            if i not in indices and self.active(i)
        ]
        if others:
            raise NoTangentRule(
                f"{self.node.op_type} node {self.node.name!r}: no tangent rule for inputs {others}"
            )

    def copy(
        self, inputs: list[str | None], outputs: int | None = None, op_type: str | None = None
    ) -> list[str]:
        """The node again (or an ``op_type`` node), same attributes, on ``inputs``; its new
        outputs."""
        count = len(self.node.outputs) if outputs is None else outputs
        b, op_type = self.b, op_type or self.node.op_type
        names = [b.unique_name(f"{op_type}_out{i}") for i in range(count)]
        clean = ["" if i is None else i for i in inputs]
        while clean and clean[-1] == "":
            clean.pop()
        proto = helper.make_node(op_type, clean, names, name=b.unique_node_name(op_type))
        proto.attribute.extend(self.node.proto.attribute)
        b.emit_nodes([proto])
        return names

    def sum(self, terms: list[Tangent | None]) -> Tangent | None:
        """The sum of the terms that exist (exact if one of them is)."""
        terms = [t for t in terms if t is not None]
        if not terms:
            return None
        name = terms[0].name
        for term in terms[1:]:
            name = self.b.add(name, term.name)
        return Tangent(name, any(t.exact for t in terms))


class TangentEngine:
    """Tangents of every value a source reaches, in one pass over ``graph``'s nodes."""

    def __init__(self, graph: GraphProto, emitter: GraphEmitter, rules: Mapping, infer=None):
        self.graph = graph
        self.emitter = emitter
        #: ``op_type -> rule`` (:data:`.tangent_rules.TANGENT_RULES`)
        self.rules = rules
        #: ``() -> {name: ValueType}``, shape inference run on the first shape not declared
        self._infer = infer
        self._inferred: Mapping[str, ValueType] | None = None
        #: the forward nodes, each followed by the tangent nodes it gave
        self.ordered: list[NodeProto] = []
        #: optional outputs of forward nodes the tangents read: ``(node, index, name)``
        self._exposed: list[tuple[NodeProto, int, str]] = []
        self.tangents: dict[str, Tangent] = {}
        self._exact: dict[str, str] = {}

    @classmethod
    def for_graph(
        cls,
        graph: GraphProto,
        opset: int,
        scope: NameScope,
        sources: set[str],
        rules: Mapping,
        infer=None,
    ) -> TangentEngine:
        """An engine over ``graph``, whose ``sources`` are variables (never constants);
        ``infer``: shape inference, run once if a rule needs a shape the graph does not
        declare."""
        constants = {k: v for k, v in _constants(graph).items() if k not in sources}
        emitter = GraphEmitter(scope, declared_types(graph), opset, constants=constants)
        return cls(graph, emitter, rules, infer)

    def shape(self, name: str) -> tuple | None:
        """The shape of a forward value: declared, else inferred, else None."""
        known = self.emitter.types.get(name)
        if known is not None and known.shape is not None:
            return known.shape
        if self._inferred is None:
            self._inferred = self._infer() if self._infer is not None else {}
        inferred = self._inferred.get(name)
        return None if inferred is None else inferred.shape

    @property
    def emitted_nodes(self) -> list[NodeProto]:
        return self.emitter.nodes

    def run(self, seeds: Mapping[str, str]) -> dict[str, Tangent]:
        """Propagate the tangents ``{source: tangent input}``; returns every value's tangent."""
        self.tangents.update({source: Tangent(seed) for source, seed in seeds.items()})
        for proto in self.graph.node:
            self.ordered.append(proto)
            tangents = [self.tangents.get(name) if name else None for name in proto.input]
            if any(t is not None for t in tangents):
                emitted = len(self.emitter.nodes)
                try:
                    self._propagate(proto, tangents)
                except (UnknownTypeError, KeyError) as exc:  # a type inference did not give
                    raise NoTangentRule(
                        f"{proto.op_type} node {proto.name!r}: a type is unknown ({exc})"
                    ) from exc
                self.ordered.extend(self.emitter.nodes[emitted:])
            elif subgraphs(proto) and not self.tangents.keys().isdisjoint(node_inputs(proto)):
                raise NoTangentRule(f"{proto.op_type} node {proto.name!r} holds a subgraph")
        return self.tangents

    def all_nodes(self) -> list[NodeProto]:
        """The forward nodes, each followed by its tangent nodes (onnxruntime runs them in
        this order: a tangent is computed while its inputs are fresh), then the nodes
        emitted after :meth:`run`."""
        done = {id(node) for node in self.ordered}
        return [*self.ordered, *(n for n in self.emitter.nodes if id(n) not in done)]

    def expose(self, proto: NodeProto, index: int, b: GradBuilder) -> str:
        """The name of ``proto``'s output ``index``, given one if it has none yet."""
        if index < len(proto.output) and proto.output[index]:
            return proto.output[index]
        name = b.unique_name(f"{proto.op_type}_output{index}")
        self._exposed.append((proto, index, name))
        return name

    def write_exposed_outputs(self) -> None:
        """Give the forward nodes the outputs :meth:`expose` named (once the pass is done:
        a refused pass leaves the graph as it was)."""
        for proto, index, name in self._exposed:
            while len(proto.output) <= index:
                proto.output.append("")
            proto.output[index] = name

    def exact(self, value: str, b: GradBuilder) -> str:
        """The tangent of ``value`` with its shape: ``Expand`` of a loose one, built once."""
        tangent = self.tangents[value]
        if tangent.exact:
            return tangent.name
        if value not in self._exact:
            self._exact[value] = b.op("Expand", tangent.name, b.shape_of(value))
        return self._exact[value]

    def _propagate(self, proto: NodeProto, tangents: list[Tangent | None]) -> None:
        domain = normalize_domain(proto.domain)
        if not domain and has_zero_gradient(domain, proto.op_type):
            return
        if subgraphs(proto):
            raise NoTangentRule(f"{proto.op_type} node {proto.name!r} holds a subgraph")
        rule = self.rules.get(proto.op_type) if not domain else None
        if rule is None:
            self._through_body(proto, tangents)
            return
        node = NodeView(proto, self.emitter.opset)
        results = rule(TangentContext(self, node, tangents))
        first = next(i for i, t in zip(proto.input, tangents) if t is not None)
        for output, tangent in zip(proto.output, results):
            if tangent is None or not output:
                continue
            elem = self._output_type(proto, output, first)
            if elem not in FLOAT_TYPES:
                continue
            self.tangents[output] = tangent

    def _through_body(self, proto: NodeProto, tangents: list[Tangent | None]) -> None:
        """The tangents of a node without a rule through its function body: the body's
        nodes, bound to the node's inputs and renamed apart, are emitted (the forward value
        computed again for the tangent rules to read) and the tangents propagate through
        them; the node's outputs take the tangents of the body's. ``NoTangentRule`` names
        the node where it has no function, or the body cannot be built or typed."""
        missing = f"no tangent rule for {normalize_domain(proto.domain) or 'ai.onnx'}::"
        missing += f"{proto.op_type} (node {proto.name!r})"
        types = self.emitter.types
        try:
            body = expand_node(proto, types, self.emitter.opsets, self.emitter.functions)
        except FunctionExpansionError as exc:
            raise NoTangentRule(f"{missing}: {exc}") from exc
        if not body:
            raise NoTangentRule(missing)
        renames = {
            name: self.emitter.scope.unique(f"{proto.name or proto.op_type}_body/{name}")
            for inner in body
            for name in inner.output
            if name
        }
        body = [_renamed(inner, renames, self.emitter.node_names) for inner in body]
        types.update(_body_types(body, proto, types, self.emitter.opsets))
        for inner in body:
            self.emitter.nodes.append(inner)
            inner_tangents = [self.tangents.get(n) if n else None for n in inner.input]
            if any(t is not None for t in inner_tangents):
                self._propagate(inner, inner_tangents)
        for output in proto.output:
            tangent = self.tangents.get(renames.get(output, ""))
            if output and tangent is not None:
                self.tangents[output] = tangent

    def _output_type(self, proto: NodeProto, output: str, first_input: str) -> int:
        """The element type of ``output``: declared, else ``Cast``'s or ``CastLike``'s
        target, else that of the node's first input with a tangent (every other rule's op
        keeps its input's type)."""
        types = self.emitter.types
        if output in types:
            return types[output].elem_type
        if proto.op_type == "Cast":
            elem = next(a.i for a in proto.attribute if a.name == "to")
        elif proto.op_type == "CastLike" and proto.input[1] in types:
            elem = types[proto.input[1]].elem_type
        else:
            elem = types[first_input].elem_type
        types[output] = ValueType(elem, None)
        return elem


def _renamed(node: NodeProto, renames: Mapping[str, str], node_names: NameScope) -> NodeProto:
    """A copy of a body node with its values renamed and a unique node name."""
    copy = NodeProto()
    copy.CopyFrom(node)
    copy.name = node_names.unique(node.name or node.op_type)
    copy.input[:] = [renames.get(i, i) for i in copy.input]
    copy.output[:] = [renames.get(o, o) for o in copy.output]
    if subgraphs(copy):
        raise NoTangentRule(f"the function body's node {copy.op_type} holds a subgraph")
    return copy


def _body_types(
    body: list[NodeProto], proto: NodeProto, types: Mapping[str, ValueType], opsets
) -> dict[str, ValueType]:
    """The types shape inference gives the body's values, from the node's inputs' types."""
    inputs = [value_info(n, types[n]) for n in dict.fromkeys(proto.input) if n and n in types]
    graph = helper.make_graph(body, "body", inputs, [])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()]
    )
    try:
        inferred = infer_value_types(model)
    except Exception as exc:  # onnx's inference raises several types
        raise NoTangentRule(f"the function body of {proto.op_type} cannot be typed: {exc}") from exc
    produced = {o for inner in body for o in inner.output if o}
    return {n: t for n, t in inferred.items() if n in produced}


def declared_types(graph: GraphProto) -> dict[str, ValueType]:
    """The types a graph declares (inputs, initializers, value_info, outputs): shapes as
    :class:`ValueType` has them, no inference."""
    types = {}
    for init in graph.initializer:
        types[init.name] = ValueType(init.data_type, tuple(init.dims))
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if not info.type.HasField("tensor_type") or not tensor.elem_type:
            continue
        shape = None
        if tensor.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tensor.shape.dim
            )
        types.setdefault(info.name, ValueType(tensor.elem_type, shape))
    return types


def _constants(graph: GraphProto) -> dict[str, TensorProto]:
    """The small constants rules may read by value (exponents, axes): the outputs of
    ``Constant`` nodes and initializers of at most 64 elements."""
    found = {i.name: i for i in graph.initializer if math.prod(i.dims) <= 64}
    for node in graph.node:
        if node.op_type == "Constant" and not node.domain and node.attribute:
            attribute = node.attribute[0]
            if attribute.name == "value":
                found[node.output[0]] = attribute.t
    return found


def zeros_of(b: GradBuilder, value: str, elem_type: int) -> str:
    """Zeros of ``value``'s shape and of element type ``elem_type``."""
    zero = numpy_helper.from_array(np.zeros([1], dtype=np_dtype(elem_type)))
    return b.op("ConstantOfShape", b.shape_of(value), value=zero)
