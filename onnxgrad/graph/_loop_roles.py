"""Weight roles inside ``Loop`` and ``Scan`` bodies (see :mod:`onnxgrad.graph.weight_roles`).

A body is walked as a part of the graph, once, its inputs bound to the values they stand for:

* a ``Scan``'s scan input ``x_t`` is a slice of the outer ``x``: ``x``'s role;
* a carried value ``s_t`` (a ``Scan`` state, a ``Loop``-carried value) is data when its
  initial value is, or when the data reaches the body output that becomes it (found by
  reachability through the body before the walk: ``s_{t+1} = f(s_t, x_t)``); otherwise it
  has its initial value's role (a constant carried along, a derived constant);
* a ``Loop``'s iteration number counts positions: a shape of the data (coordinates) when
  the trip count depends on the data, a constant otherwise.

The initial value of a state the data reaches is where the recurrence starts (PyTorch's
``h0 = 0``), not a weight: name it to train it. The node's outputs take the roles of the
body outputs they are: the final states those of the states' last values, the stacked scan
outputs those of their slices. A body's own weights (``Constant`` nodes, initializers) are
main-graph initializers by then: normalisation lifts them
(:mod:`onnxgrad.normalize.constants`), and the walk reads their role where the body uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from onnx import GraphProto, NodeProto, helper

from onnxgrad._onnx_utils import normalize_domain
from onnxgrad.graph._scopes import node_inputs

#: ops reading only the shape of their input: the data does not reach their output
_SHAPES = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class LoopBinding:
    """How a ``Loop``/``Scan`` node's body meets the graph around it."""

    body: GraphProto
    #: ``(body input, outer value)`` of each carried value
    states: list[tuple[str, str]]
    #: ``(body input, outer value)`` of each scan input (a slice of the outer value)
    slices: list[tuple[str, str]]
    #: the body output each carried value's next value is, in the order of ``states``
    next_states: list[str]
    #: ``(node output, body output)``: final states and stacked scan outputs
    results: list[tuple[str, str]]
    #: a ``Loop``'s iteration number and trip count (``None`` for a ``Scan``)
    counter: tuple[str, str] | None


def loop_binding(node: NodeProto, opset: int) -> LoopBinding | None:
    """The binding of a default-domain ``Loop`` or ``Scan`` (opset 9 and later), or
    ``None`` for another node."""
    if normalize_domain(node.domain) or node.op_type not in ("Loop", "Scan"):
        return None
    attributes = {a.name: a for a in node.attribute}
    body = attributes["body"].g if "body" in attributes else None
    if body is None:
        return None
    inputs = [i.name for i in body.input]
    outputs = [o.name for o in body.output]
    if node.op_type == "Scan":
        if opset < 9 or "num_scan_inputs" not in attributes:
            return None  # opset 8's Scan has a batch axis and sequence lengths first
        count = len(node.input) - helper.get_attribute_value(attributes["num_scan_inputs"])
        states = list(zip(inputs[:count], node.input[:count]))
        slices = list(zip(inputs[count:], node.input[count:]))
        return LoopBinding(body, states, slices, outputs[:count], _results(node, outputs), None)
    carried = len(node.input) - 2
    states = list(zip(inputs[1:], node.input[1:]))  # the condition, then the carried values
    nexts = outputs[: carried + 1]
    counter = (inputs[0], node.input[0]) if inputs else None
    return LoopBinding(body, states, [], nexts, _results(node, outputs[1:]), counter)


def _results(node: NodeProto, body_outputs: list[str]) -> list[tuple[str, str]]:
    return [(out, inner) for out, inner in zip(node.output, body_outputs) if out]


def reached_states(binding: LoopBinding, reached: Callable[[str], bool]) -> set[str]:
    """The body inputs the data reaches: scan inputs and states bound to data, and states
    whose next value the data reaches through the body (a fixed point over iterations)."""
    found = {
        inner for inner, outer in [*binding.states, *binding.slices] if outer and reached(outer)
    }
    free = {n for node in binding.body.node for n in node_inputs(node) if reached(n)}
    while True:
        values = _reach(binding.body.node, found | free)
        more = {
            inner
            for (inner, _), nxt in zip(binding.states, binding.next_states)
            if nxt in values and inner not in found
        }
        if not more:
            return found
        found |= more


def _reach(nodes: Iterable[NodeProto], start: set[str]) -> set[str]:
    """The values ``start`` reaches through ``nodes`` (in order), not through a shape."""
    values = set(start)
    for node in nodes:
        if node.op_type not in _SHAPES and node_inputs(node) & values:
            values.update(o for o in node.output if o)
    return values
