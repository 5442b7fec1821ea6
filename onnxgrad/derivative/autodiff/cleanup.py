"""Clean-up of emitted graphs: fewer nodes, the same values.

One pass in topological order, then the removal of dead nodes:

* ``Identity(x)`` is replaced by ``x``, and so is ``Cast(x, to=T)`` when ``x`` is known to
  be of type ``T`` already; an ``Identity`` that only renames a value to a graph output
  disappears too, its producer writing the output directly;
* ``Transpose(Transpose(x, p), q)`` becomes ``Transpose(x, p o q)`` (nothing when the
  composition is the identity), ``Reshape(Reshape(x, s), t)`` becomes ``Reshape(x, t)``
  when ``t`` is a constant without zeros (a 0 would copy a dimension of the inner result);
* ``op(Expand(s, Shape(x)), t)``, ``op`` an elementwise Add, Sub, Mul or Div and ``t`` of
  the shape of ``x`` (``x`` itself, or computed from it by elementwise ops and scalar
  constants), becomes ``op(s, t)``: broadcasting against ``t`` gives the same shape and
  values (the mean's gradient meeting the square's);
* common subexpressions: a deterministic node with the same type, inputs and attributes as
  an earlier one (``Constant`` nodes compared by value) reuses that node's outputs.

Graph inputs and outputs keep their names; nodes holding subgraphs, and the values their
subgraphs read, are left alone (the rewrites never look inside a subgraph).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import normalize_domain, replace_repeated, subgraphs
from onnxgrad.graph._scopes import free_names, node_inputs

#: elementwise ops whose output has the shape of their (only) input
UNARY_ELEMENTWISE = frozenset(
    [
        "Abs", "Cast", "Ceil", "Cos", "Erf", "Exp", "Floor", "Identity", "Log", "Neg",
        "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sin", "Sqrt", "Tanh",
    ]
)  # fmt: skip
#: broadcasting elementwise ops of two inputs
BINARY_ELEMENTWISE = frozenset(["Add", "Sub", "Mul", "Div", "Pow"])

#: ops whose outputs may differ between two calls with the same inputs
NONDETERMINISTIC = frozenset(
    [
        "Bernoulli",
        "Dropout",
        "Multinomial",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
    ]
)


def clean_graph(
    graph: GraphProto, nodes: list[NodeProto] | None = None, apart: Iterable[str] = ()
) -> GraphProto:
    """Simplify ``graph`` in place (see the module's docstring) and return it; ``nodes``:
    the nodes to give it, in order, when they are not its own yet (they are copied once).
    The nodes computing a value of ``apart`` are no common subexpression of another (a
    gradient seed of ones stays distinct from a rule's constant one: what reads the seed is
    backward work waiting for the gradient, :mod:`~onnxgrad.derivative.late_backward`)."""
    from onnxgrad.graph.select import prune_graph

    nodes = list(graph.node) if nodes is None else nodes
    # the nodes holding subgraphs (by the ids of the wrappers ``nodes`` holds), found in one
    # look at each node's attributes: each step below asks
    nested = {id(node) for node in nodes if node.attribute and subgraphs(node)}
    pinned = _pinned_names(nodes, graph, nested)
    nodes, producers = _simplified(graph, nodes, pinned, set(apart), nested)
    nodes = _write_outputs_directly(graph, nodes, pinned, producers)
    del producers  # the clean-up is a deep graph's memory peak: no table outlives its use
    needed = {o.name for o in graph.output}
    live = live_nodes(nodes, needed, nested)
    for node in live:
        for sub in subgraphs(node) if id(node) in nested else ():
            prune_graph(sub, keep_inputs=True)
    replace_repeated(graph.node, live)
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name not in needed:
            del graph.initializer[index]
    if graph.value_info:
        written = {o for node in live for o in node.output}
        replace_repeated(graph.value_info, [v for v in graph.value_info if v.name in written])
    return graph


def _simplified(
    graph, nodes, pinned, apart, nested
) -> tuple[list[NodeProto], dict[str, NodeProto]]:
    """The simplifier's nodes and producers; its other tables (common subexpressions) are
    freed on return."""
    simplifier = _Simplifier(graph, nodes, pinned, apart, nested)
    return simplifier.run(), simplifier.producer


def live_nodes(
    nodes: list[NodeProto], needed: set[str], nested: set[int] | None = None
) -> list[NodeProto]:
    """The nodes ``needed`` depends on, in order; ``needed`` grows to every value read.
    ``nested``: the ids of those of ``nodes`` that hold subgraphs, where the caller knows."""
    kept = []
    for node in reversed(nodes):
        if not needed.isdisjoint(node.output):
            kept.append(node)
            if not node.attribute:
                needed.update(node.input)
            elif nested is None or id(node) in nested:
                needed.update(node_inputs(node))
            else:  # node_inputs of a node without subgraphs
                needed.update(name for name in node.input[:] if name)
    return kept[::-1]


def _pinned_names(nodes: list[NodeProto], graph: GraphProto, nested: set[int]) -> set[str]:
    """Values that keep their name and producer: interface and subgraph reads."""
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    for node in nodes:
        for sub in subgraphs(node) if id(node) in nested else ():
            names |= free_names(sub)
    return names


class _Simplifier:
    def __init__(
        self,
        graph: GraphProto,
        nodes: list[NodeProto],
        pinned: set[str],
        apart: set[str],
        nested: set[int],
    ):
        self.graph = graph
        self.nodes = nodes
        #: the ids of the nodes holding subgraphs
        self.nested = nested
        self.pinned = pinned
        self.apart = apart
        self.alias: dict[str, str] = {}
        self.producer: dict[str, NodeProto] = {}
        self.constants = {i.name: i for i in graph.initializer}
        self.seen: dict[tuple, NodeProto] = {}
        #: (domain, type, inputs, output count) -> the first node of them, until a second
        #: one comes (``None`` then): only such nodes get their attributes read into a key
        self.first: dict[tuple, NodeProto | None] = {}
        #: value -> a value known to have the same shape (elementwise chains)
        self.shape_roots: dict[str, str] = {}
        self.elem_types = {i.name: i.data_type for i in graph.initializer}
        for info in [*graph.input, *graph.value_info]:
            if info.type.tensor_type.elem_type:
                self.elem_types[info.name] = info.type.tensor_type.elem_type

    def resolve(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def run(self) -> list[NodeProto]:
        """The simplified nodes (modified in place, not copied)."""
        kept = []
        alias = self.alias
        for node in self.nodes:
            if not alias.keys().isdisjoint(node.input):
                for i, name in enumerate(node.input):
                    if name in alias:  # a write leaves the old string in the arena
                        node.input[i] = self.resolve(name)
            if self._simplify(node):
                continue
            kept.append(node)
            for output in node.output:
                self.producer[output] = node
        return kept

    def _free(self, node: NodeProto) -> bool:
        """Whether every output of ``node`` may be replaced by another value."""
        return not self.pinned.intersection(node.output)

    def _simplify(self, node: NodeProto) -> bool:
        """Rewrite ``node`` in place; ``True`` when it is no longer needed."""
        if normalize_domain(node.domain):
            return self._common(node)
        op = node.op_type
        if op == "Identity" and self._free(node):
            self.alias[node.output[0]] = node.input[0]
            return True
        if op == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to is not None and self.elem_types.get(node.input[0]) == to and self._free(node):
                self.alias[node.output[0]] = node.input[0]
                return True
            self.elem_types[node.output[0]] = to
        elif op == "Transpose":
            return self._transpose(node)
        elif op == "Reshape":
            self._reshape(node)
        elif op in BINARY_ELEMENTWISE:
            self._skip_expand(node)
        self._track_shape(node, op)
        return self._common(node)

    def _shape_root(self, name: str) -> str:
        return self.shape_roots.get(name, name)

    def _is_scalar_constant(self, name: str) -> bool:
        tensor = self._constant_tensor(name)
        return tensor is not None and not tensor.dims

    def _track_shape(self, node: NodeProto, op: str) -> None:
        """Record the outputs of elementwise nodes that keep the shape of an input."""
        if op in UNARY_ELEMENTWISE and len(node.input) == 1:
            self.shape_roots[node.output[0]] = self._shape_root(node.input[0])
        elif op in BINARY_ELEMENTWISE and len(node.input) == 2:
            a, b = node.input
            if self._shape_root(a) == self._shape_root(b) or self._is_scalar_constant(b):
                self.shape_roots[node.output[0]] = self._shape_root(a)
            elif self._is_scalar_constant(a):
                self.shape_roots[node.output[0]] = self._shape_root(b)

    def _skip_expand(self, node: NodeProto) -> None:
        """``op(Expand(s, Shape(x)), t)`` -> ``op(s, t)`` when ``t`` has the shape of ``x``."""
        if node.op_type not in BINARY_ELEMENTWISE or node.op_type == "Pow":
            return
        if len(node.input) != 2:
            return
        for i, name in enumerate(node.input):
            source = self._expanded_like(name)
            if source is not None and self._shape_root(node.input[1 - i]) == source[1]:
                node.input[i] = source[0]

    def _expanded_like(self, name: str) -> tuple[str, str] | None:
        """``(s, root of x)`` when ``name = Expand(s, Shape(x))``."""
        expand = self.producer.get(name)
        if expand is None or expand.op_type != "Expand" or normalize_domain(expand.domain):
            return None
        shape = self.producer.get(expand.input[1])
        if shape is None or shape.op_type != "Shape" or normalize_domain(shape.domain):
            return None
        if shape.attribute:
            return None
        return expand.input[0], self._shape_root(shape.input[0])

    def _transpose(self, node: NodeProto) -> bool:
        inner = self.producer.get(node.input[0])
        if inner is None or inner.op_type != "Transpose" or normalize_domain(inner.domain):
            return self._common(node)
        first, second = _perm(inner), _perm(node)
        if first is None or second is None or len(first) != len(second):
            return self._common(node)
        composed = [first[p] for p in second]
        node.input[0] = inner.input[0]
        _set_ints(node, "perm", composed)
        if composed == sorted(composed) and self._free(node):
            self.alias[node.output[0]] = node.input[0]
            return True
        return self._common(node)

    def _reshape(self, node: NodeProto) -> None:
        inner = self.producer.get(node.input[0])
        if inner is None or inner.op_type != "Reshape" or normalize_domain(inner.domain):
            return
        shape = self._constant(node.input[1]) if len(node.input) > 1 else None
        if shape is not None and shape.size and (shape != 0).all():
            node.input[0] = inner.input[0]

    def _constant(self, name: str) -> np.ndarray | None:
        tensor = self._constant_tensor(name)
        if tensor is not None:
            return numpy_helper.to_array(tensor)
        node = self.producer.get(name)
        if node is None or node.op_type != "Constant" or normalize_domain(node.domain):
            return None
        for attr in node.attribute:
            if attr.name == "value_ints":
                return np.array(attr.ints, dtype=np.int64)
        return None

    def _constant_tensor(self, name: str) -> TensorProto | None:
        """The tensor of an initializer or of a ``Constant``'s ``value``, else ``None``."""
        if name in self.constants:
            return self.constants[name]
        node = self.producer.get(name)
        if node is None or node.op_type != "Constant" or normalize_domain(node.domain):
            return None
        for attr in node.attribute:
            if attr.name == "value":
                return attr.t
        return None

    def _common(self, node: NodeProto) -> bool:
        """Reuse the outputs of an identical earlier node."""
        if node.op_type in NONDETERMINISTIC or id(node) in self.nested:
            return False
        if self.apart and not self.apart.isdisjoint(node.output):
            return False
        base = (normalize_domain(node.domain), node.op_type, tuple(node.input), len(node.output))
        if base not in self.first:  # no earlier node has its type and inputs
            self.first[base] = node
            return False
        first = self.first[base]
        if first is not None:  # keyed once a second node shares its type and inputs
            self.seen.setdefault(_node_key(first, base), first)
            self.first[base] = None
        key = _node_key(node, base)
        earlier = self.seen.get(key)
        if earlier is None:
            self.seen[key] = node
            return False
        if not self._free(node) or len(earlier.output) != len(node.output):
            return False
        for mine, theirs in zip(node.output, earlier.output):
            if mine:
                if not theirs:
                    return False
                self.alias[mine] = theirs
        return True


def _node_key(node: NodeProto, key: tuple) -> tuple:
    """``key`` (the node's domain, type, inputs and output count) and its attributes'."""
    attributes = node.attribute
    if not attributes:
        return key
    if len(attributes) > 1:
        attributes = sorted(attributes, key=lambda a: a.name)
    return (*key, *(_attribute_key(a) for a in attributes))


def _attribute_key(attr: AttributeProto) -> bytes:
    """The attribute's bytes, a tensor's name left out (two constants of the same value are
    the same)."""
    if attr.type == AttributeProto.TENSOR and attr.t.name:
        copy = AttributeProto()
        copy.CopyFrom(attr)
        copy.t.name = ""
        attr = copy
    return attr.SerializeToString(deterministic=True)


def _perm(node: NodeProto) -> list[int] | None:
    for attr in node.attribute:
        if attr.name == "perm":
            return list(attr.ints)
    return None


def _set_ints(node: NodeProto, name: str, values: list[int]) -> None:
    for attr in node.attribute:
        if attr.name == name:
            del attr.ints[:]
            attr.ints.extend(values)
            return


def _write_outputs_directly(
    graph: GraphProto, nodes: list[NodeProto], pinned: set[str], producers: dict[str, NodeProto]
) -> list[NodeProto]:
    """``y = Identity(x)`` with ``y`` a graph output: the producer of ``x`` writes ``y``
    (when ``x`` is an intermediate value of this graph only, renamed everywhere);
    ``producers``: the node computing each value, for ``nodes`` at least."""
    renamed: dict[str, str] = {}
    dropped = set()
    for node in nodes:
        if node.op_type != "Identity" or normalize_domain(node.domain):
            continue
        source, target = node.input[0], node.output[0]
        if source in pinned or source in renamed or source not in producers:
            continue
        renamed[source] = target
        dropped.add(id(node))
    if not renamed:
        return nodes
    kept = [n for n in nodes if id(n) not in dropped]
    for node in kept:
        if not renamed.keys().isdisjoint(node.input):
            for i, name in enumerate(node.input):
                if name in renamed:
                    node.input[i] = renamed[name]
    for source, target in renamed.items():
        outputs = producers[source].output
        outputs[list(outputs).index(source)] = target
    outputs = {o.name for o in graph.output}
    infos = [v for v in graph.value_info if v.name not in outputs]
    for info in infos:
        if info.name in renamed:
            info.name = renamed[info.name]
    replace_repeated(graph.value_info, infos)
    return kept
