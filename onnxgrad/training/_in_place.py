"""Which outputs of a train step may be written into the buffer of the input they update.

The runner binds a step's new weights and optimizer state to buffers of its own. Writing a
new value over its input (one buffer instead of two) is safe when nothing can read the
input after the output is written: every node reading the input must be the output's
producer or one of its ancestors (onnxruntime runs those first, whatever order it picks),
and when the producer itself reads the input it must do so element by element at the
output's position (an elementwise operator whose input has the output's shape: reading
``x[i]`` before writing ``y[i]`` is what onnxruntime's own in-place reuse relies on for these
kernels). Anything else (a reader outside the producer's ancestry, as the backward of a
``MatMul`` reading its weight to pass the gradient on, a producer that reshapes or
broadcasts) keeps two buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from onnx import ModelProto

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
    graph = model.graph
    producer = {o: node for node in graph.node for o in node.output}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in set(_inputs(node)):
            readers.setdefault(name, []).append(node)
    safe = set()
    for name, output in updates.items():
        node = producer.get(output)
        if node is None or not _reads_elementwise(node, name):
            continue
        others = [r for r in readers.get(name, []) if r is not node]
        if not others or all(id(r) in _ancestors(node, producer) for r in others):
            safe.add(name)
    return safe


def _reads_elementwise(node, name: str) -> bool:
    """Whether ``node`` may write its output over ``name``: it does not read it, or reads
    it elementwise (its output has the shape of ``name``'s buffer, so ``name`` is read at
    the positions written)."""
    if name not in set(_inputs(node)):
        return True
    return node.domain in ("", "ai.onnx") and node.op_type in ELEMENTWISE


def _ancestors(node, producer: Mapping[str, object]) -> set[int]:
    """The ids of the nodes ``node`` depends on (through its inputs, transitively)."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        for name in _inputs(current):
            parent = producer.get(name)
            if parent is not None and id(parent) not in seen:
                seen.add(id(parent))
                stack.append(parent)
    return seen


def _inputs(node) -> Iterable[str]:
    """The node's inputs and the outer values its subgraphs read."""
    yield from (n for n in node.input if n)
    for attribute in node.attribute:
        for graph in [attribute.g, *attribute.graphs]:
            for inner in graph.node:
                yield from (n for n in inner.input if n)


__all__ = ["ELEMENTWISE", "in_place_inputs"]
