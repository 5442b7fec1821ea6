r"""Rewrites of the forward graph that leave every value a user can see unchanged and make
the gradient cheaper.

* ``MaxPool(Relu(x))`` becomes ``Relu(MaxPool(x))``. ReLU is non-decreasing, so
  :math:`\max_i \mathrm{relu}(x_i) = \mathrm{relu}(\max_i x_i)` exactly, in floating point
  too (NaNs aside), whatever the pads or ``ceil_mode`` (every window holds at least one
  element of ``x``).
  The gradient is the same: where the window's maximum is positive both route ``g`` to its
  first occurrence; where it is not, both give 0 (the ReLU's derivative at a non-positive
  input). The ReLU and its gradient then run on the pooled tensor, ``k^2`` times smaller for
  a ``k x k`` pool (the conv, ReLU, pool blocks of LeNet- and VGG-like networks).
"""

from __future__ import annotations

from collections import Counter

from onnx import GraphProto, NodeProto

from onnxgrad._onnx_utils import NameScope, all_names, normalize_domain
from onnxgrad.graph._scopes import node_inputs


def pool_before_relu(graph: GraphProto) -> int:
    """Swap every ``Relu`` -> ``MaxPool`` pair of ``graph`` (not its subgraphs) whose ReLU
    output only that pool reads and whose pool has no ``Indices`` output; returns how many.
    The pool's output keeps its name, now given by the ReLU."""
    readers = Counter(name for node in graph.node for name in node_inputs(node))
    readers.update(output.name for output in graph.output)
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}
    scope = NameScope(all_names(graph))
    swapped = 0
    for index, pool in enumerate(graph.node):
        if not _is_default(pool, "MaxPool") or len([o for o in pool.output if o]) != 1:
            continue
        source = producer.get(pool.input[0])
        relu = graph.node[source] if source is not None else None
        if relu is None or not _is_default(relu, "Relu") or readers[relu.output[0]] != 1:
            continue
        pooled = scope.unique(f"{pool.output[0]}_before_relu")
        x, y = relu.input[0], pool.output[0]
        pool.input[0], pool.output[0] = x, pooled
        relu.input[0], relu.output[0] = pooled, y
        _swap(graph, source, index)
        producer[pooled], producer[y] = source, index
        swapped += 1
    return swapped


def _is_default(node: NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and not normalize_domain(node.domain)


def _swap(graph: GraphProto, first: int, second: int) -> None:
    """Exchange two nodes: the pool takes the ReLU's place, before its own readers."""
    a, b = NodeProto(), NodeProto()
    a.CopyFrom(graph.node[first])
    b.CopyFrom(graph.node[second])
    graph.node[first].CopyFrom(b)
    graph.node[second].CopyFrom(a)
