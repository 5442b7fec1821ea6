"""Reverse-mode differentiation of an ONNX graph into standard ONNX nodes.

Given seeds ``g_y`` for some values ``y`` and a set of sources ``x``, the engine emits
nodes computing ``x_bar = sum_y g_y . dy/dx`` by walking, in reverse topological order,
only the nodes on a path from a source to a seeded value. It owns what rules never do:
pruning, summing the contributions of values used several times, undoing broadcasting,
symbolic zeros (``None``) and naming (``<node>_Grad/...``). An operator with no rule but
a function body (schema, context-dependent or model-local) is differentiated through that
body (:mod:`~onnxgrad.derivative.autodiff.functions`) before it is declared missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from onnx import FunctionProto, GraphProto, NodeProto, TensorProto

from onnxgrad._onnx_utils import FLOAT_TYPES, NameScope, normalize_domain
from onnxgrad.derivative.autodiff.builder import GradBuilder, GraphEmitter, NodeView
from onnxgrad.derivative.autodiff.functions import function_rule
from onnxgrad.derivative.autodiff.registry import Rule, find_rule, has_zero_gradient
from onnxgrad.derivative.autodiff.value_types import ValueType
from onnxgrad.graph._scopes import iter_graphs, node_inputs


class Engine:
    """Differentiates the nodes of ``graph`` (the forward graph, topologically sorted)."""

    def __init__(self, graph: GraphProto, emitter: GraphEmitter):
        self.nodes = list(graph.node)
        self.emitter = emitter
        self.opset = emitter.opset
        self.types = emitter.types

    @classmethod
    def for_graph(
        cls,
        graph: GraphProto,
        types: dict[str, ValueType],
        opset: int,
        scope: NameScope,
        constants: Mapping[str, TensorProto] | None = None,
        opsets: Mapping[str, int] | None = None,
        functions: Sequence[FunctionProto] = (),
    ) -> Engine:
        """An engine for a model's main graph: value names from ``scope``, node names free
        in the graph and its subgraphs, values rules may read from ``constants``; ``opsets``
        and the model-local ``functions`` serve the function fallback."""
        node_names = NameScope(n.name for g in iter_graphs(graph) for n in g.node if n.name)
        emitter = GraphEmitter(scope, types, opset, constants, node_names, opsets, functions)
        return cls(graph, emitter)

    @classmethod
    def nested(cls, graph: GraphProto, outer: GraphEmitter) -> Engine:
        """An engine for a subgraph, sharing the names, types and constants of ``outer``."""
        return cls(graph, outer.child())

    @property
    def emitted_nodes(self) -> list[NodeProto]:
        return self.emitter.nodes

    def gradients(self, sources: Sequence[str], seeds: dict[str, str]) -> dict[str, str | None]:
        """``{source: gradient name or None (a structural zero)}`` for the given seeds."""
        active = self._active_values(sources)
        path = self._nodes_on_path(active, seeds)
        rules = self._rules_for(path)
        for node, rule in zip(path, rules):
            if rule.forward is not None:
                rule.forward(node, self.emitter.scope)
        contributions: dict[str, list[str]] = {y: [g] for y, g in seeds.items()}
        for node, rule in zip(reversed(path), reversed(rules)):
            self._backward(node, rule, active, contributions)
        return {x: self._accumulate(x, contributions.get(x, [])) for x in sources}

    # -- analysis ---------------------------------------------------------------------------
    def _is_float(self, name: str) -> bool:
        value = self.types.get(name)
        return value is None or value.elem_type in FLOAT_TYPES

    def _active_values(self, sources: Iterable[str]) -> set[str]:
        """Values depending differentiably on a source."""
        active = set(sources)
        for node in self.nodes:
            if has_zero_gradient(node.domain, node.op_type):
                continue
            if any(name in active for name in node_inputs(node)):
                active.update(o for o in node.output if o and self._is_float(o))
        return active

    def _nodes_on_path(self, active: set[str], seeds: dict[str, str]) -> list[NodeProto]:
        """Nodes with an active input and an output from which a seed is reachable."""
        needed = set(seeds)
        path = []
        for node in reversed(self.nodes):
            if not any(o in needed for o in node.output):
                continue
            needed.update(node_inputs(node))
            if any(o in active for o in node.output) and not has_zero_gradient(
                node.domain, node.op_type
            ):
                path.append(node)
        return path[::-1]

    def _rules_for(self, path: list[NodeProto]) -> list[Rule]:
        """The rule of every node, raising one error listing all the missing ones first."""
        rules, missing = [], []
        for node in path:
            rule = find_rule(node.domain, node.op_type, self._domain_opset(node.domain))
            if rule is None:
                rule = function_rule(node, self.types, self.emitter.opsets, self.emitter.functions)
            if rule is None:
                missing.append(
                    f"{node.op_type!r} (domain {node.domain or 'ai.onnx'!r}, opset {self.opset}) "
                    f"at node {node.name or '<unnamed>'!r}"
                )
            rules.append(rule)
        if missing:
            hint = (
                "; most native rules start at opset 11 or 13, try backend='ort'"
                if self.opset < 13
                else ""
            )
            raise NotImplementedError("no gradient rule for " + "; ".join(missing) + hint)
        return rules

    def _domain_opset(self, domain: str) -> int:
        return self.emitter.opsets.get(normalize_domain(domain), self.opset)

    # -- backward pass ----------------------------------------------------------------------
    def _backward(
        self, node: NodeProto, rule: Rule, active: set[str], contributions: dict[str, list[str]]
    ) -> None:
        grads = [self._accumulate(o, contributions.get(o, [])) for o in node.output]
        if all(g is None for g in grads):
            return
        view = NodeView(node, self.opset)
        inputs = [*node.input, *view.captured]
        needs = [bool(name) and name in active for name in inputs]
        builder = GradBuilder(self.emitter, self._prefix(node))
        results = list(rule.function(builder, view, grads, needs))
        if len(results) < len(inputs):
            results += [None] * (len(inputs) - len(results))
        for name, need, grad in zip(inputs, needs, results):
            if not need or grad is None:
                continue
            if rule.broadcast:
                grad = builder.unbroadcast(grad, name, self._shape(node.output[0]))
            if name in self.types:
                self.types.setdefault(grad, self.types[name])
            contributions.setdefault(name, []).append(grad)

    def _accumulate(self, name: str, grads: list[str]) -> str | None:
        """Sum of the gradient contributions of ``name`` (``None`` when there are none)."""
        if not grads:
            return None
        if len(grads) == 1:
            total = grads[0]
        else:
            total = GradBuilder(self.emitter, f"{name}_Grad/").op("Sum", *grads)
            grads[:] = [total]
        if name in self.types:
            self.types.setdefault(total, self.types[name])
        return total

    def _shape(self, name: str) -> tuple | None:
        value = self.types.get(name)
        return None if value is None else value.shape

    def _prefix(self, node: NodeProto) -> str:
        base = node.name or f"{node.op_type}_{node.output[0]}"
        return f"{base}_Grad/"
