"""Which outputs of a train step may be written into the buffer of the input they update.

The runner binds a step's new weights and optimizer state to buffers of its own. Writing a
new value over its input (one buffer instead of two) is safe when nothing can read the
input after the output is written: every node reading the input must be the output's
producer or one of its ancestors (onnxruntime runs those first, whatever order it picks),
and when the producer itself reads the input it must do so element by element at the
output's position (an elementwise operator whose input has the output's shape: reading
``x[i]`` before writing ``y[i]`` is what onnxruntime's own in-place reuse relies on for these
kernels). A view of the input (``Reshape``, ``Squeeze``... onnxruntime makes them without a
copy) is the input: its readers count as the input's. Anything else (a reader outside the
producer's ancestry, as the backward of a ``MatMul`` reading its weight to pass the gradient
on when nothing orders it before the update, a producer that reshapes or broadcasts) keeps
two buffers; :mod:`~onnxgrad.training.step.update_gates` orders the backward's reads of the
weights before their updates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from onnx import ModelProto, NodeProto

from onnxgrad.derivative.late_backward import ALIASES

#: operators whose output ``i`` depends on input ``i`` only (same shape, no broadcasting)
ELEMENTWISE = frozenset(
    {
        "Abs", "Add", "And", "Ceil", "Clip", "Cos", "Div", "Equal", "Exp", "Floor", "Greater",
        "Identity", "Less", "Log", "Max", "Min", "Mul", "Neg", "Not", "Or", "Pow",
        "Reciprocal", "Relu", "Sigmoid", "Sign", "Sin", "Sqrt", "Sub", "Sum", "Tanh", "Where",
    }
)  # fmt: skip


def in_place_inputs(model: ModelProto, updates: Mapping[str, str]) -> set[str]:
    """The inputs of ``updates`` (input -> the output holding its new value, bound to a
    buffer of the input's shape) whose output can be written over the input."""
    flow = BufferFlow(model.graph.node, updates)
    return {name for name, output in updates.items() if flow.writable(name, output)}


class BufferFlow:
    """The nodes of a topologically sorted graph reading the buffers of some of its inputs,
    and which of them run before a given node: one pass keeps, for every node, the set of
    those readers among its ancestors (a bit each), instead of a walk per question."""

    def __init__(self, nodes: Iterable[NodeProto], inputs: Iterable[str]):
        self.nodes = list(nodes)
        self.producer = {o: node for node in self.nodes for o in node.output if o}
        self.readers: dict[str, list[NodeProto]] = {}
        for node in self.nodes:
            for name in set(node_reads(node)):
                self.readers.setdefault(name, []).append(node)
        self.buffers = {name: buffer_readers(name, self.readers) for name in inputs}
        watched = {id(n): n for found, _ in self.buffers.values() for n in found}
        self._bit = {key: 1 << k for k, key in enumerate(watched)}
        self._before: dict[int, int] = {}
        for node in self.nodes:
            mask = 0
            for name in set(node_reads(node)):
                parent = self.producer.get(name)
                if parent is not None:
                    key = id(parent)
                    mask |= self._before.get(key, 0) | self._bit.get(key, 0)
            self._before[id(node)] = mask

    def late_readers(self, name: str, writer: NodeProto) -> list[NodeProto]:
        """The nodes reading ``name``'s buffer, other than ``writer``, that ``writer`` does
        not depend on (a graph out of order makes more of them, never fewer)."""
        before = self._before.get(id(writer), 0)
        found, _ = self.buffers[name]
        return [r for r in found if r is not writer and not before & self._bit[id(r)]]

    def writable(self, name: str, output: str) -> bool:
        """Whether ``output`` can be written over the input ``name``'s buffer."""
        writer = self.producer.get(output)
        if writer is None or not reads_elementwise(writer, name, self.buffers[name][1]):
            return False
        return not self.late_readers(name, writer)


def buffer_readers(
    name: str, readers: Mapping[str, Sequence[NodeProto]]
) -> tuple[list[NodeProto], set[str]]:
    """The nodes reading the buffer of ``name`` (``readers``: value -> the nodes reading
    it): its readers and those of its views, the outputs of :data:`ALIASES` nodes reading
    it as their data (transitively), which onnxruntime makes without a copy; and the names
    of ``name`` and its views."""
    views, found, seen, stack = {name}, [], set(), [name]
    while stack:
        value = stack.pop()
        for node in readers.get(value, ()):
            if id(node) not in seen:
                seen.add(id(node))
                found.append(node)
            aliased = node.op_type in ALIASES and node.domain in ("", "ai.onnx")
            if aliased and node.input[0] == value:
                fresh = [o for o in node.output if o and o not in views]
                views.update(fresh)
                stack.extend(fresh)
    return found, views


def reads_elementwise(node, name: str, views: Iterable[str] = ()) -> bool:
    """Whether ``node`` may write its output over ``name``: it reads neither ``name`` nor
    one of its ``views``, or reads ``name`` itself elementwise (its output has the shape of
    ``name``'s buffer, so ``name`` is read at the positions written)."""
    reads = set(node_reads(node))
    if reads.intersection(views) - {name}:
        return False
    if name not in reads:
        return True
    return node.domain in ("", "ai.onnx") and node.op_type in ELEMENTWISE


def node_reads(node) -> Iterable[str]:
    """The node's inputs and the outer values its subgraphs read."""
    yield from (n for n in node.input if n)
    for attribute in node.attribute:
        for graph in [attribute.g, *attribute.graphs]:
            for inner in graph.node:
                yield from (n for n in inner.input if n)


__all__ = [
    "ELEMENTWISE",
    "BufferFlow",
    "buffer_readers",
    "in_place_inputs",
    "node_reads",
    "reads_elementwise",
]
