"""Gates: nodes that make a value wait for another one in onnxruntime's execution order.

onnxruntime runs a node as soon as its own order reaches it, not where the graph puts it:
a backward node whose inputs are all forward values may run during the forward and hold its
result until the backward reads it. A *gated* read of ``a``,
``Reshape(a, Concat(Shape(a), Cast(Slice(Flatten(g), 0, 0))))``, is the same tensor (an alias
in onnxruntime, no copy) whose shape input depends on the value ``g``: the reader cannot run
before ``g`` exists, and no constant folding removes the dependency (the empty tensor is
taken from ``g``).

``g`` is chosen as the backward value of greatest *depth* (the longest chain of backward
nodes behind it) computed before the node that needs the gated value: the gradient that has
reached that point of the backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from onnx import GraphProto, NodeProto, helper

from onnxgrad._onnx_utils import NameScope, all_names


def backward_depths(backward: Sequence[NodeProto], skip: Iterable[int] = ()) -> dict[str, int]:
    """Backward value -> length of the longest chain of backward nodes computing it (the
    nodes at the indices of ``skip`` count for nothing)."""
    skipped = set(skip)
    depth: dict[str, int] = {}
    for index, node in enumerate(backward):
        inner = max((depth.get(i, 0) for i in node.input), default=0)
        d = inner if index in skipped else 1 + inner
        for output in node.output:
            depth[output] = d
    return depth


def deepest_before(backward: Sequence[NodeProto], depth: dict[str, int]) -> list[str | None]:
    """For each position ``first`` (0 to ``len(backward)``), the deepest backward value
    computed before node ``first`` (the latest on ties), if some chain of at least 2
    backward nodes leads to it (a shallower one may be a constant, which onnxruntime would
    fold, gate and all); one pass for all positions."""
    best, best_depth, answers = None, 1, [None]
    for node in backward:
        for output in node.output:
            if output and depth.get(output, 0) >= max(best_depth, 2):
                best, best_depth = output, depth[output]
        answers.append(best)
    return answers


class Gates:
    """Builds gated reads with names free in a graph."""

    def __init__(self, graph: GraphProto):
        self.values = NameScope(all_names(graph))
        self.node_names = NameScope(n.name for n in graph.node)

    def token(
        self, gate: str, prefix: str, bounds: tuple[str, str] | None = None
    ) -> tuple[list[NodeProto], str]:
        """An empty int64 tensor computed from ``gate`` (``bounds``: the int64 constants
        ``[-1]`` and ``[0]`` it needs, made by :meth:`bounds` when not given)."""
        nodes = []
        if bounds is None:
            nodes, bounds = self.bounds(prefix)
        minus_one, zero = bounds
        flat, empty, token = (self.values.unique(f"{prefix}{s}") for s in ("flat", "empty", "tok"))
        nodes += [
            self.node("Reshape", [gate, minus_one], flat, prefix),
            self.node("Slice", [flat, zero, zero], empty, prefix),
            self.node("Cast", [empty], token, prefix, to=7),
        ]
        return nodes, token

    def data_token(
        self, gate: str, prefix: str, bounds: tuple[str, str] | None = None
    ) -> tuple[list[NodeProto], str]:
        """An empty int64 tensor computed from ``gate`` whose length only its values tell
        (``Less(x, x)`` counted, 0 for every ``x``), so that no optimizer can prove it empty
        and fold the gated shape, dependency and all, into a constant. For gates whose
        removal would be wrong, not only slower (a weight written in place)."""
        nodes = []
        if bounds is None:
            nodes, bounds = self.bounds(prefix)
        minus_one, zero = bounds
        one = self.values.unique(f"{prefix}one")
        names = ("flat", "first", "real", "same", "count", "counted", "tok")
        flat, first, real, same, count, counted, token = (
            self.values.unique(f"{prefix}{s}") for s in names
        )
        nodes += [
            self.constant(one, [1], prefix),
            self.node("Reshape", [gate, minus_one], flat, prefix),
            self.node("Slice", [flat, zero, one], first, prefix),
            self.node("Cast", [first], real, prefix, to=1),
            self.node("Less", [real, real], same, prefix),
            self.node("Cast", [same], count, prefix, to=7),
            self.node("ReduceSum", [count], counted, prefix, keepdims=1),
            self.node("Slice", [counted, zero, counted], token, prefix),
        ]
        return nodes, token

    def bounds(self, prefix: str) -> tuple[list[NodeProto], tuple[str, str]]:
        """The constants ``[-1]`` and ``[0]`` of :meth:`token`, and their nodes."""
        minus_one, zero = (self.values.unique(f"{prefix}{s}") for s in ("minus_one", "zero"))
        nodes = [self.constant(minus_one, [-1], prefix), self.constant(zero, [0], prefix)]
        return nodes, (minus_one, zero)

    def gated(
        self, name: str, token: str | Sequence[str], prefix: str
    ) -> tuple[list[NodeProto], str]:
        """``name`` read after the values behind ``token`` (one or several): the nodes, and
        the alias."""
        tokens = [token] if isinstance(token, str) else list(token)
        shape, target, gated = (
            self.values.unique(f"{name}_{s}") for s in ("shape", "tshape", "gated")
        )
        nodes = [
            self.node("Shape", [name], shape, prefix),
            self.node("Concat", [shape, *tokens], target, prefix, axis=0),
            self.node("Reshape", [name, target], gated, prefix),
        ]
        return nodes, gated

    def node(self, op_type: str, inputs, output: str, prefix: str, **attrs) -> NodeProto:
        name = self.node_names.unique(f"{prefix}{op_type}")
        return helper.make_node(op_type, inputs, [output], name=name, **attrs)

    def constant(self, name: str, values, prefix: str) -> NodeProto:
        tensor = helper.make_tensor(name, 7, [len(values)], values)
        return helper.make_node(
            "Constant", [], [name], name=self.node_names.unique(f"{prefix}Constant"), value=tensor
        )
