"""Which values of a graph a gradient can flow through."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from onnx import NodeProto

from onnxgrad.derivative.autodiff.registry import has_zero_gradient
from onnxgrad.graph._scopes import node_inputs


def active_values(
    nodes: Sequence[NodeProto],
    sources: Iterable[str],
    is_float: Callable[[str], bool],
    through_zero: bool = False,
    reads: Sequence[set[str]] | None = None,
) -> set[str]:
    """The values depending differentiably on a source: ``sources``, then every float output
    of a node that reads an active value, unless the node passes no gradient (Shape,
    comparisons, Floor...; ``through_zero``: those too, where their output is float).
    ``nodes`` are in topological order; ``reads``: each node's :func:`node_inputs`, when
    the caller has them."""
    active = set(sources)
    for index, node in enumerate(nodes):
        if not through_zero and has_zero_gradient(node.domain, node.op_type):
            continue
        read = node_inputs(node) if reads is None else reads[index]
        if not active.isdisjoint(read):
            active.update(o for o in node.output if o and is_float(o))
    return active
