"""Backward work that only reads forward values, made to wait for the backward.

Gradient rules compute some of their terms from forward values alone: a normalised input
``(x - mean) * rstd`` recomputed for LayerNormalization's gradient, a transposed weight, the
zeros a loop accumulates into. onnxruntime runs such a node as soon as its inputs exist, so
during the forward, and holds the result until the backward reads it: on a 2-layer
transformer classifier at sequence 256, 11 MiB of such tensors were alive at the step's peak.

:func:`delay_early_backward` finds them and moves them to just before their first reader
that depends on the output gradients, reading one input through a gate
(:mod:`~onnxgrad.derivative.gating`) on the gradient that has reached that reader. Values
are unchanged; only small shape computations (from ``Shape``, ``Size`` and constants) still
run early.

A backward node is *early* when it does not depend on an output-gradient seed; an early node
is *tainted* when it reads a tensor of the forward (not through ``Shape``/``Size``), builds a
tensor from a shape (``ConstantOfShape``, ``Expand``...), or reads a tainted value; a view
(``Reshape``, ``Flatten``...) of forward values is neither. (Sparing the gates of values
known to be small, under 16K elements, took the transformer classifier's step from 39 to 44
MiB: a gate also decides when onnxruntime's depth-first order reaches the nodes around it.)
Tainted nodes without a tainted input are the *frontier*: gating them
delays the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

from onnx import GraphProto, NodeProto

from onnxgrad._onnx_utils import replace_repeated
from onnxgrad.derivative.gating import Gates, backward_depths, deepest_before
from onnxgrad.graph._scopes import node_inputs

#: ops whose output is a view of their input in onnxruntime (no memory to save)
ALIASES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: ops whose outputs are shapes or sizes, small whatever their input
_SHAPE_OF = frozenset({"Shape", "Size"})
#: ops building a tensor whose size comes from their (small) inputs
_BUILDERS = frozenset(
    {"ConstantOfShape", "Expand", "Tile", "Range", "EyeLike", "RandomNormal", "RandomUniform"}
)


def delay_early_backward(graph: GraphProto, forward_names: set[str], seeds: Iterable[str]) -> int:
    """Reorder the backward of ``graph`` (nodes not named in ``forward_names``) so that its
    tainted nodes run just before their first reader depending on a seed of ``seeds``;
    returns how many nodes were gated."""
    nodes = list(graph.node)
    forward = [n for n in nodes if n.name in forward_names]
    backward = [n for n in nodes if n.name not in forward_names]
    late, tainted = _classify(backward, forward, set(seeds))
    if not tainted:
        return 0
    first_late = _first_late_readers(backward, late, tainted)
    depth = backward_depths(backward, skip=[i for i in range(len(backward)) if i not in late])
    gate_before = deepest_before(backward, depth)
    gates = _SharedGates(Gates(graph), backward)
    produced_tainted = {o for i in tainted for o in backward[i].output}
    inserted: dict[int, list[NodeProto]] = {}
    gated = 0
    for index in sorted(tainted):
        node = backward[index]
        first = first_late[index]
        if not produced_tainted.intersection(node.input):
            gated += gates.gate(node, gate_before[first], inserted, first)
        inserted.setdefault(first, []).append(node)
    ordered = []
    for index, node in enumerate(backward):
        ordered += gates.tokens.get(index, []) + inserted.get(index, [])
        if index not in tainted:
            ordered.append(node)
    ordered += gates.tokens.get(len(backward), []) + inserted.get(len(backward), [])
    replace_repeated(graph.node, forward + ordered)
    return gated


def _classify(
    backward: list[NodeProto], forward: list[NodeProto], seeds: set[str]
) -> tuple[set[int], set[int]]:
    """The indices of the late nodes (depending on a seed) and of the tainted early ones."""
    late_values = set(seeds)
    small = {o for n in forward if n.op_type == "Constant" for o in n.output}
    tainted_values: set[str] = set()
    late, tainted = set(), set()
    for index, node in enumerate(backward):
        reads = node_inputs(node)
        outputs = {o for o in node.output if o}
        if reads & late_values:
            late.add(index)
            late_values |= outputs
        elif _is_small(node, reads, small, tainted_values):
            small |= outputs
        elif node.op_type in ALIASES and not reads & tainted_values:
            continue  # a view of forward values: nothing to delay, its readers are gated
        else:
            tainted.add(index)
            tainted_values |= outputs
    return late, tainted


def _is_small(node: NodeProto, reads: set[str], small: set[str], tainted: set[str]) -> bool:
    """Whether an early node only computes shapes (its result is small and cheap)."""
    if reads & tainted or node.op_type in _BUILDERS:
        return False
    if node.op_type in _SHAPE_OF or node.op_type == "Constant":
        return True
    return reads <= small


def _first_late_readers(
    backward: list[NodeProto], late: set[int], tainted: set[int]
) -> dict[int, int]:
    """Tainted node -> index of the first late node reading its result, directly or through
    other tainted nodes (``len(backward)`` when none does)."""
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(backward):
        for name in node_inputs(node):
            readers.setdefault(name, []).append(index)
    first: dict[int, int] = {}
    for index in sorted(tainted, reverse=True):
        candidates = [len(backward)]
        for output in backward[index].output:
            for reader in readers.get(output, []):
                if reader in late:
                    candidates.append(reader)
                elif reader in first:
                    candidates.append(first[reader])
        first[index] = min(candidates)
    return first


class _SharedGates:
    """Gated reads whose tokens are shared: one per gate value, computed right after it
    (the constants they need once, before the backward)."""

    def __init__(self, gates: Gates, backward: list[NodeProto]):
        self.gates = gates
        self.position = {o: i for i, node in enumerate(backward) for o in node.output if o}
        #: backward position -> token nodes to run before the node there
        self.tokens: dict[int, list[NodeProto]] = {}
        self._made: dict[str, str] = {}
        self._bounds: tuple[str, str] | None = None

    def gate(
        self,
        node: NodeProto,
        gate: str | None,
        inserted: dict[int, list[NodeProto]],
        first: int,
    ) -> int:
        """Read the first input of ``node`` through a gate on ``gate``; 1 if it was gated."""
        position = next((i for i, name in enumerate(node.input) if name), None)
        if gate is None or position is None:
            return 0
        prefix = f"{node.name or node.op_type}_late/"
        read_nodes, alias = self.gates.gated(node.input[position], self._token(gate), prefix)
        inserted.setdefault(first, []).extend(read_nodes)
        node.input[position] = alias
        return 1

    def _token(self, gate: str) -> str:
        if gate not in self._made:
            if self._bounds is None:
                nodes, self._bounds = self.gates.bounds("late/")
                self.tokens.setdefault(0, []).extend(nodes)
            nodes, self._made[gate] = self.gates.token(gate, f"{gate}_late/", self._bounds)
            self.tokens.setdefault(self.position[gate] + 1, []).extend(nodes)
        return self._made[gate]
