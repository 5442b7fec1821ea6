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

import functools
from collections.abc import Iterable, Mapping, Sequence

from onnx import FunctionProto, GraphProto, NodeProto, TensorProto

from onnxgrad._onnx_utils import FLOAT_TYPES, NameScope, normalize_domain
from onnxgrad.derivative.autodiff.activity import active_values
from onnxgrad.derivative.autodiff.builder import GradBuilder, GraphEmitter, NodeView
from onnxgrad.derivative.autodiff.functions import FunctionExpansionError, function_rule
from onnxgrad.derivative.autodiff.registry import (
    Rule,
    find_rule,
    has_zero_gradient,
    not_differentiable_reason,
)
from onnxgrad.derivative.autodiff.value_types import ValueType
from onnxgrad.graph._scopes import iter_graphs, node_inputs
from onnxgrad.graph.ml_lowering import why_not_lowered


class Engine:
    """Differentiates the nodes of ``graph`` (the forward graph, topologically sorted)."""

    def __init__(self, graph: GraphProto, emitter: GraphEmitter):
        self.nodes = list(graph.node)
        emitter.subgraph_engine = Engine  # rules differentiate bodies and branches with it
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

    def reaches_through_floats(self, sources: Sequence[str], seeds: Mapping[str, str]) -> bool:
        """Whether a seeded output depends on a source through float values, counting the
        piecewise-constant operators (Hardmax, Floor, Sign...) whose derivative is 0."""
        reached = active_values(
            self.nodes, sources, self._is_float, through_zero=True, reads=self._reads
        )
        return not reached.isdisjoint(seeds)

    # -- analysis ---------------------------------------------------------------------------
    @functools.cached_property
    def _reads(self) -> list[set[str]]:
        """What each node reads (:func:`node_inputs`), in the order of :attr:`nodes`."""
        return [node_inputs(node) for node in self.nodes]

    def _is_float(self, name: str) -> bool:
        value = self.types.get(name)
        return value is None or value.elem_type in FLOAT_TYPES

    def _active_values(self, sources: Iterable[str]) -> set[str]:
        """Values depending differentiably on a source."""
        return active_values(self.nodes, sources, self._is_float, reads=self._reads)

    def _nodes_on_path(self, active: set[str], seeds: dict[str, str]) -> list[NodeProto]:
        """Nodes with an active output from which a seed is reachable (a node whose needed
        outputs are all inactive, as TopK's indices, passes no gradient and needs no rule)."""
        needed = set(seeds)
        path = []
        for node, read in zip(reversed(self.nodes), reversed(self._reads)):
            if not any(o in needed and o in active for o in node.output):
                continue
            needed.update(read)
            if not has_zero_gradient(node.domain, node.op_type):
                path.append(node)
        return path[::-1]

    def _rules_for(self, path: list[NodeProto]) -> list[Rule]:
        """The rule of every node, raising one error listing all the missing ones first."""
        blocked = [
            f"{node.op_type!r} (domain {node.domain or 'ai.onnx'!r}) at node "
            f"{node.name or '<unnamed>'!r} {reason}"
            for node in path
            if (reason := not_differentiable_reason(node.domain, node.op_type))
        ]
        if blocked:
            raise NotImplementedError("the model is not differentiable: " + "; ".join(blocked))
        rules, missing = [], []
        for node in path:
            rule, reason = find_rule(node.domain, node.op_type, self._domain_opset(node.domain)), ""
            if rule is None:
                try:
                    rule = function_rule(
                        node, self.types, self.emitter.opsets, self.emitter.functions
                    )
                except FunctionExpansionError as exc:
                    reason = f" ({exc})"
            if rule is None and (refusal := why_not_lowered(node)):
                reason = f" (lower_ml_operators left it: {refusal})"
            if rule is None:
                missing.append((node, reason))
            rules.append(rule)
        if missing:
            raise NotImplementedError(self._missing_rules_message(missing))
        return rules

    def _missing_rules_message(self, missing: list[tuple[NodeProto, str]]) -> str:
        """Each op with its own domain's opset; ``backend='ort'`` suggested only for
        default-domain ops (onnxruntime-training has no gradient for ``ai.onnx.ml``)."""
        described = [
            f"{node.op_type!r} (domain {node.domain or 'ai.onnx'!r}, opset "
            f"{self._domain_opset(node.domain)}) at node {node.name or '<unnamed>'!r}{reason}"
            for node, reason in missing
        ]
        default_domain = all(not normalize_domain(node.domain) for node, _ in missing)
        hint = ""
        if default_domain and self.opset < 13:
            hint = (
                "; most native rules start at opset 11 or 13: convert the model with "
                "onnx.version_converter.convert_version(model, 13), or try backend='ort'"
            )
        return "no gradient rule for " + "; ".join(described) + hint

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
