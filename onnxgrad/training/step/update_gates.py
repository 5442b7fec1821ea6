"""Updates that wait for the other readers of their input, so they can be written over it.

The runner writes a new weight over the old one (one buffer instead of two) only when every
other node reading the weight runs before the node writing the new value
(:mod:`~onnxgrad.training.step._in_place`). The backward reads most weights after the forward:
``dX = dY W^T`` for a ``MatMul`` or ``Gemm``, a transposed convolution for a ``Conv``; nothing
ordered those reads before the weight's update, so such weights kept two buffers, the whole
model twice (resnet18: 45 MiB more than one set).

:func:`gate_updates` makes the update's last node read its other inputs through a *gate*
(:mod:`onnxgrad.derivative.gating`) on the values computed from the weight's late readers:
the readers, their consumers and, through operators that only pass a tensor on
(:data:`PASS_ON`), the first consumers that compute; the gate takes a token from the last
of those (for a layer's weight, the gradient the backward passes to the layer below). A
token from the readers alone would not do: onnxruntime's fusions move a read of the weight
into a reader's consumer (a ``Transpose`` of the weight and the ``MatMul`` after it become
one ``FusedMatMul`` reading the weight where the ``MatMul`` was, the ``Transpose`` kept for
the token), and a fused node computes its parts' outputs, so the update waits for it.
onnxruntime 1.32 fuses a gate placed before a ``Reshape`` (a rank-0 weight's update ends in
one) with it, dropping the dependency (a 0-d weight trained wrong): the node computing the
viewed data is gated instead. And since a token empty by its static shape would let an
optimizer fold the gate's shape into a constant, these tokens are empty only by their values
(:meth:`~onnxgrad.derivative.gating.Gates.data_token`; a precaution: no onnxruntime tried
does it alone). The update runs when the backward passes the layer, as before; the values
are the same.
Measured: all 42 weights of resnet18 and 75 of the 8-layer Llama-like LM in place (22 and
1 before), steps 322 -> 279 and 344 -> 327 MiB (``benchmarks/bench_memory.py``, glibc
returning large blocks), the same losses, the same step time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from onnx import GraphProto, NodeProto

from onnxgrad._onnx_utils import replace_repeated
from onnxgrad.derivative.gating import Gates
from onnxgrad.derivative.late_backward import ALIASES
from onnxgrad.training.step._in_place import BufferFlow, reads_elementwise

PREFIX = "update_gate/"
#: operators passing a tensor on without computing with it, which optimizers fold into
#: their consumers (a transposed weight read by a ``MatMul``, a view, a cast)
PASS_ON = frozenset({"Transpose", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: prefixes of the operators whose outputs may be sequences or optionals, not tensors
NOT_TENSORS = ("Sequence", "SplitToSequence", "Optional")


def gate_updates(graph: GraphProto, updates: Mapping[str, str]) -> list[str]:
    """Gate, in place, the producer of each output of ``updates`` (input -> output holding
    its new value) on the readers of the input that do not already run before it (module
    docstring); returns the inputs gated. Left as they are: a producer that cannot write
    over the input anyway (it reads it other than element by element), and one whose
    gate's values come after it in the graph's order or depend on it (a cycle)."""
    flow = _Flow(graph.node, updates)
    gates, gated = Gates(graph), []
    constants, bounds = gates.bounds(PREFIX)
    tokens: dict[str, str] = {}  # value -> its token, shared by the updates waiting for it
    before: dict[int, list[NodeProto]] = {}  # node -> the gates to insert before it
    after: dict[int, list[NodeProto]] = {}  # node -> the tokens to insert after it
    for name, output in updates.items():
        writer = flow.producer.get(output)
        if writer is None or not reads_elementwise(writer, name, flow.buffers[name][1]):
            continue
        late = flow.late_readers(name, writer)
        if not late:
            continue
        waits = flow.last_of(flow.with_consumers(late))
        target = flow.computing(writer)
        if not flow.can_wait(target, waits):
            continue
        chosen = []
        for node in waits:
            value = next(o for o in node.output if o)
            if value not in tokens:
                made, tokens[value] = gates.data_token(value, PREFIX, bounds)
                after.setdefault(id(node), []).extend(made)
            chosen.append(tokens[value])
        before.setdefault(id(target), []).extend(_gate_inputs(gates, target, name, chosen))
        gated.append(name)
    if gated:
        order = constants
        for node in graph.node:
            order.extend(before.get(id(node), ()))
            order.append(node)
            order.extend(after.get(id(node), ()))
        replace_repeated(graph.node, order)
    return gated


class _Flow(BufferFlow):
    """:class:`~onnxgrad.training.step._in_place.BufferFlow` with the nodes' consumers and
    positions."""

    def __init__(self, nodes: Iterable[NodeProto], inputs: Iterable[str]):
        super().__init__(nodes, inputs)
        self.position = {id(node): i for i, node in enumerate(self.nodes)}

    def computing(self, writer: NodeProto) -> NodeProto:
        """``writer``, or the node computing what it views when it is a view
        (:data:`~onnxgrad.derivative.late_backward.ALIASES`, a rank-0 weight's update ends
        in a ``Reshape``): a gate on a view's data would be a ``Reshape`` before a
        ``Reshape``, which onnxruntime 1.32 fuses into one, dropping the gate; the node
        computing the data runs before the view anyway."""
        node = writer
        while node.op_type in ALIASES and node.domain in ("", "ai.onnx"):
            source = self.producer.get(node.input[0])
            if source is None:
                break
            node = source
        return node

    def consumers(self, node: NodeProto) -> list[NodeProto]:
        return [r for o in node.output if o for r in self.readers.get(o, ())]

    def with_consumers(self, nodes: Sequence[NodeProto]) -> list[NodeProto]:
        """``nodes``, their consumers, and those of consumers in :data:`PASS_ON` (to the
        first that computes): the nodes an optimizer may fuse with them. A fused node
        computes what its parts did, so a value downstream of all of them is downstream
        of it."""
        found, stack = {id(n): n for n in nodes}, list(nodes)
        while stack:
            for consumer in self.consumers(stack.pop()):
                if id(consumer) not in found:
                    found[id(consumer)] = consumer
                    if consumer.op_type in PASS_ON:
                        stack.append(consumer)
        return list(found.values())

    def last_of(self, nodes: Sequence[NodeProto]) -> list[NodeProto]:
        """The nodes of ``nodes`` none of the others reads."""
        inside = {id(n) for n in nodes}
        return [n for n in nodes if not any(id(c) in inside for c in self.consumers(n))]

    def can_wait(self, writer: NodeProto, waits: Sequence[NodeProto]) -> bool:
        """Whether ``writer`` may read values of ``waits``: they come before it in the graph,
        give tensors (a token is a slice of one) and none of them depends on it (no cycle)."""
        if any(self.position[id(n)] > self.position[id(writer)] for n in waits):
            return False
        if any(n.op_type.startswith(NOT_TENSORS) for n in waits):
            return False
        later, stack = set(), [writer]
        while stack:
            for consumer in self.consumers(stack.pop()):
                if id(consumer) not in later:
                    later.add(id(consumer))
                    stack.append(consumer)
        return not any(id(n) in later for n in waits)


def _gate_inputs(gates: Gates, writer: NodeProto, name: str, tokens: Sequence[str]) -> list:
    """The nodes making ``writer`` read its inputs other than ``name`` after the values
    behind ``tokens`` (:meth:`~onnxgrad.derivative.gating.Gates.data_token`)."""
    nodes = []
    for index, value in enumerate(writer.input):
        if value and value != name:
            made, alias = gates.gated(value, tokens, PREFIX)
            nodes += made
            writer.input[index] = alias
    return nodes


__all__ = ["gate_updates"]
