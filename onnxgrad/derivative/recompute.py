"""Recomputation in the backward: forward values the gradient needs, rebuilt late instead of
kept from the forward (activation checkpointing, and a cheap-value rule after PyTorch's
min-cut partitioner).

A gradient graph reads forward values ("saved" values): each lives from its forward producer
to its last backward reader, so all of them are alive at the turn from forward to backward,
which is where a train step peaks. Recomputing a group of them replaces every backward read
of a value ``v`` by a copy ``v'`` of its producing nodes, fed by *anchors*: values the
backward keeps anyway (or graph inputs, weights, constants). ``v`` then dies in the forward;
``v'`` lives only while the backward of its group runs.

Ordering. onnxruntime runs nodes in a topological order of its own, not the graph's (its
profiler shows the weight transposes of the backward run first), so a copy whose inputs
are all forward values runs as soon as they exist, during the forward, and brings the peak
back; with graph optimisations on, its common-subexpression elimination even merges the
copy into the forward node (docs/benchmarks.md measures both). Each group is
therefore *gated* (:mod:`~onnxgrad.derivative.gating`): every anchor a copy reads is read
through an alias whose shape depends on the gradient that reached the group's first
backward reader.

Choices (``recompute=``):

* a list of regular expressions, *blocks* (activation checkpointing): a forward node whose
  name, or ``namespace`` metadata (the module path the PyTorch exporter records), contains
  a match belongs to the block named by the matched text (``r"layers\\.\\d+"`` makes one
  block per Llama layer). A block's values read outside the block (its outputs) stay saved;
  every other value of the block that the backward reads is recomputed from the block's
  inputs, one block at a time. A node that cannot be copied (a random op, one holding a
  subgraph, another domain's) keeps its outputs saved, and so does a value a backward
  subgraph reads implicitly;
* ``"attention"``: no value of this module; attention cores are computed in tiles
  (:mod:`~onnxgrad.derivative.autodiff.attention_tiles`) and backward work that reads
  forward values only waits for the gradient (:mod:`~onnxgrad.derivative.late_backward`);
* ``"auto"``: the same, and cheap values, chosen greedily by size (below): the attention
  probabilities of a core left untiled, elementwise chains.

The ``"auto"`` cost model. For a saved value ``v`` of ``n_v`` elements, its recompute chain
``C(v)`` is found walking back from ``v`` through producers until every input is an anchor:
a value still saved, a graph input, a weight or a constant. The chain may only use the ops of
:data:`FLOPS_PER_ELEMENT` (elementwise, shape and layout ops, Softmax, MatMul) and at most
:data:`MAX_CHAIN` nodes. Its cost is ``F(C) = sum_{u in C} f(u) n_u`` operations, ``f`` the
table's cost per output element (``2K`` for a MatMul of inner size ``K``). ``v`` is recomputed
when ``F(C(v)) <= kappa * n_v`` (``kappa`` = :data:`MAX_FLOPS_PER_ELEMENT`): the memory
saved at the peak is ``n_v`` elements (the anchors stay saved either way, the chain's
intermediates are transient), bought with ``F`` operations. Candidates are taken by
decreasing ``n_v`` (ties in graph order), and the anchors of an accepted chain stay saved
(so a later choice never lengthens an earlier chain). ``kappa = 160`` admits the attention
probabilities ``softmax(Q K^T / sqrt(d) + M)`` of heads up to 64 wide (``2d + 6``
operations per element, ``Q``, ``K`` and ``M`` saved for the score gradient) and any
elementwise chain (SiLU of a saved projection), never a projection of width above 80
(``2 * 80`` operations per element). Unknown (symbolic) dimensions count as 1: a value and
its chain share the batch axis, so the ratio stays right.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, NodeProto, helper

from onnxgrad._onnx_utils import (
    NameScope,
    normalize_domain,
    replace_repeated,
    subgraphs,
)
from onnxgrad.derivative.autodiff.cleanup import NONDETERMINISTIC
from onnxgrad.derivative.autodiff.value_types import ValueType
from onnxgrad.derivative.gating import Gates, backward_depths, deepest_before
from onnxgrad.graph._scopes import node_inputs

#: the named choices of ``recompute=`` (besides block patterns)
CHOICES = ("auto", "attention")
#: the choice of the training entries (``make_train_step``, ``generate_artifacts``, the
#: estimators) when they are given none: at the same step time (0.96x), the transformer
#: classifier at sequence 256 peaks at 40 MiB instead of 110 (docs/benchmarks.md)
TRAINING_RECOMPUTE = "attention"
#: largest recompute chain ``"auto"`` builds, in nodes
MAX_CHAIN = 8
#: ``kappa``: operations of recomputation ``"auto"`` pays for one element freed
MAX_FLOPS_PER_ELEMENT = 160
_ELEMENTWISE = [
    "Abs", "Add", "And", "Cast", "Ceil", "Clip", "Cos", "Div", "Equal", "Erf", "Exp", "Floor",
    "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "Less", "LessOrEqual", "Log",
    "Max", "Min", "Mul", "Neg", "Not", "Or", "Pow", "Reciprocal", "Relu", "Round", "Sigmoid",
    "Sign", "Sin", "Sqrt", "Sub", "Tanh", "Where", "Xor",
]  # fmt: skip
_LAYOUT = [
    "Concat", "Expand", "Flatten", "Gather", "Reshape", "Shape", "Size", "Slice", "Split",
    "Squeeze", "Transpose", "Unsqueeze",
]  # fmt: skip
#: op -> operations per output element when recomputed by ``"auto"`` (MatMul: per unit of K)
FLOPS_PER_ELEMENT: dict[str, int] = {
    **dict.fromkeys(_ELEMENTWISE, 1),
    **dict.fromkeys(_LAYOUT, 1),
    "Softmax": 5,
    "LogSoftmax": 5,
    "MatMul": 2,
}


@dataclass(frozen=True)
class Group:
    """Forward values recomputed together: ``targets`` (read by the backward) from the
    forward ``nodes`` (in graph order) whose other inputs are anchors."""

    name: str
    targets: tuple[str, ...]
    nodes: tuple[NodeProto, ...]


def check_recompute(recompute) -> str | tuple[re.Pattern, ...] | None:
    """``None``, ``"auto"``, ``"attention"`` or block patterns (compiled), else a
    ``ValueError``/``TypeError``."""
    if recompute is None or recompute in CHOICES:
        return recompute
    if isinstance(recompute, str) or not isinstance(recompute, Sequence):
        raise TypeError(
            "recompute must be None, 'auto', 'attention' or a list of block patterns, "
            f"got {recompute!r}"
        )
    patterns = []
    for pattern in recompute:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"recompute: block patterns are non-empty strings, got {pattern!r}")
        try:
            patterns.append(re.compile(pattern))
        except re.error as exc:
            raise ValueError(f"recompute: {pattern!r} is not a regular expression: {exc}") from exc
    if not patterns:
        raise ValueError("recompute=[]: no block to recompute (use None)")
    return tuple(patterns)


def tiles_attention(recompute) -> bool:
    """Whether ``recompute`` computes attention in tiles (``"attention"`` and ``"auto"``)."""
    return recompute in CHOICES


def name_forward_nodes(graph: GraphProto, names: NameScope) -> set[str]:
    """The names of ``graph``'s nodes (the forward), naming the unnamed ones first with
    names free in ``names``."""
    for node in graph.node:
        if not node.name:
            node.name = names.unique(f"{node.op_type}_fwd")
    return {n.name for n in graph.node}


def recompute_in_backward(
    graph: GraphProto,
    forward_names: set[str],
    types: Mapping[str, ValueType],
    recompute,
) -> list[Group]:
    """Rewrite the gradient ``graph`` (forward nodes named in ``forward_names``, then the
    backward, in topological order) so that the backward recomputes the chosen values
    (see the module docstring); returns the groups recomputed."""
    recompute = check_recompute(recompute)
    if recompute is None or recompute == "attention":
        return []
    nodes = list(graph.node)
    forward = [n for n in nodes if n.name in forward_names]
    backward = [n for n in nodes if n.name not in forward_names]
    reads = _backward_reads(forward, backward)
    if recompute == "auto":
        groups = _auto_groups(graph, forward, reads, types)
    else:
        groups = _block_groups(graph, forward, backward, reads, recompute)
    rewritten = _Rewriter(graph, backward).apply(groups)
    replace_repeated(graph.node, forward + rewritten)
    return groups


def _backward_reads(forward: list[NodeProto], backward: list[NodeProto]) -> dict[str, bool]:
    """Forward values the backward reads -> whether every read is an explicit input (a
    subgraph's implicit read cannot be redirected)."""
    produced = {o for n in forward for o in n.output if o}
    reads: dict[str, bool] = {}
    for node in backward:
        explicit = set(node.input)
        for name in sorted(node_inputs(node) & produced):
            reads[name] = reads.get(name, True) and name in explicit
    return reads


def _recomputable(node: NodeProto) -> bool:
    return (
        not normalize_domain(node.domain)
        and node.op_type not in NONDETERMINISTIC
        and not subgraphs(node)
    )


# -- blocks --------------------------------------------------------------------------------
def _block_of(node: NodeProto, patterns: tuple[re.Pattern, ...]) -> str | None:
    namespace = next((p.value for p in node.metadata_props if p.key == "namespace"), "")
    for pattern in patterns:
        for text in (node.name, namespace):
            match = pattern.search(text)
            if match:
                return match.group(0)
    return None


def _block_groups(graph, forward, backward, reads, patterns) -> list[Group]:
    blocks: dict[str, list[NodeProto]] = {}
    for node in forward:
        key = _block_of(node, patterns)
        if key is not None:
            blocks.setdefault(key, []).append(node)
    if not blocks:
        raise ValueError(
            f"recompute: no forward node's name or namespace matches "
            f"{[p.pattern for p in patterns]}"
        )
    groups = []
    for key, members in blocks.items():
        group = _block_group(graph, key, members, forward, reads)
        if group is not None:
            groups.append(group)
    return groups


def _block_group(graph, key, members, forward, reads) -> Group | None:
    inside = {id(n) for n in members}
    read_outside = {o.name for o in graph.output}
    for node in forward:
        if id(node) not in inside:
            read_outside |= node_inputs(node)
    internal = {o for n in members for o in n.output if o and o not in read_outside}
    internal -= {name for name, explicit in reads.items() if not explicit}
    for node in members:
        if internal.intersection(node.output) and not _recomputable(node):
            internal -= set(node.output)
    targets = [o for n in members for o in n.output if o in internal and o in reads]
    if not targets:
        return None
    chain = _closure(targets, {o: n for n in members for o in n.output}, internal)
    return Group(key, tuple(targets), tuple(n for n in members if id(n) in chain))


def _closure(targets, producers, internal) -> set[int]:
    """``id`` of the nodes computing ``targets`` from values outside ``internal``."""
    chain, stack = set(), list(targets)
    while stack:
        node = producers[stack.pop()]
        if id(node) in chain:
            continue
        chain.add(id(node))
        stack += [i for i in node.input if i in internal]
    return chain


# -- auto ----------------------------------------------------------------------------------
def _auto_groups(graph, forward, reads, types) -> list[Group]:
    producers = {o: n for n in forward for o in n.output if o}
    saved = set(reads)
    pinned = {name for name, explicit in reads.items() if not explicit}
    order = {name: i for i, name in enumerate(producers)}
    candidates = sorted(
        (v for v in saved if v not in pinned and _recomputable(producers[v])),
        key=lambda v: (-_elements(types, v), order[v]),
    )
    groups = []
    for value in candidates:
        if value in pinned:
            continue
        found = _chain(value, producers, saved - {value}, types)
        if found is None:
            continue
        chain, anchors, flops = found
        if flops > MAX_FLOPS_PER_ELEMENT * _elements(types, value):
            continue
        saved.discard(value)
        pinned |= anchors
        ordered = tuple(n for n in forward if id(n) in chain)
        groups.append(Group(value, (value,), ordered))
    return groups


def _chain(value, producers, saved, types):
    """``(node ids, anchors, operations)`` computing ``value`` from saved values, graph
    inputs and constants with cheap ops, or ``None``."""
    chain, anchors, flops, stack = set(), set(), 0, [value]
    while stack:
        name = stack.pop()
        node = producers[name]
        if id(node) in chain:
            continue
        if len(chain) == MAX_CHAIN or not _cheap(node):
            return None
        chain.add(id(node))
        flops += _flops(node, types)
        for i in node.input:
            if not i:
                continue
            if i in saved or i not in producers or producers[i].op_type == "Constant":
                anchors.add(i)
            else:
                stack.append(i)
    return chain, anchors, flops


def _cheap(node: NodeProto) -> bool:
    return _recomputable(node) and node.op_type in FLOPS_PER_ELEMENT


def _flops(node: NodeProto, types) -> int:
    per_element = FLOPS_PER_ELEMENT[node.op_type]
    if node.op_type == "MatMul":
        shape = types[node.input[0]].shape if node.input[0] in types else None
        inner = shape[-1] if shape else None
        per_element *= inner if isinstance(inner, int) else 1
    return per_element * sum(_elements(types, o) for o in node.output if o)


def _elements(types, name: str) -> int:
    value = types.get(name)
    if value is None or value.shape is None:
        return 1
    return int(np.prod([d if isinstance(d, int) else 1 for d in value.shape]))


# -- rewriting -----------------------------------------------------------------------------
class _Rewriter:
    """Inserts each group's gated copy before its first backward reader."""

    def __init__(self, graph: GraphProto, backward: list[NodeProto]):
        self.backward = backward
        self.gates = Gates(graph)
        self.gate_before = deepest_before(backward, backward_depths(backward))

    def apply(self, groups: list[Group]) -> list[NodeProto]:
        inserted: dict[int, list[NodeProto]] = {}
        for group in groups:
            first = self._first_reader(group)
            gate = self.gate_before[first]
            if gate is None:
                continue
            inserted.setdefault(first, []).extend(self._copy(group, gate))
        result = []
        for index, node in enumerate(self.backward):
            result += inserted.get(index, [])
            result.append(node)
        return result

    def _first_reader(self, group: Group) -> int:
        targets = set(group.targets)
        return next(i for i, n in enumerate(self.backward) if targets.intersection(n.input))

    def _copy(self, group: Group, gate: str) -> list[NodeProto]:
        prefix = f"recompute/{group.name}/"
        new, token = self.gates.token(gate, prefix)
        renamed: dict[str, str] = {}
        gated: dict[str, str] = {}
        produced = {o for n in group.nodes for o in n.output}
        for node in group.nodes:
            inputs = []
            for name in node.input:
                if not name or name in produced:
                    inputs.append(renamed.get(name, name))
                    continue
                if name not in gated:
                    nodes, gated[name] = self.gates.gated(name, token, prefix)
                    new.extend(nodes)
                inputs.append(gated[name])
            outputs = [
                self.gates.values.unique(f"{o}_recomputed") if o else "" for o in node.output
            ]
            renamed.update(zip(node.output, outputs))
            copy = helper.make_node(
                node.op_type,
                inputs,
                outputs,
                name=self.gates.node_names.unique(prefix + node.name),
            )
            copy.attribute.extend(node.attribute)
            new.append(copy)
        for node in self.backward:
            for i, name in enumerate(node.input):
                if name in group.targets:
                    node.input[i] = renamed[name]
        return new
