"""The order of a gradient graph's last nodes, for onnxruntime's execution order.

onnxruntime's default execution order is a depth-first walk back from the *leaves* (nodes no
other node reads), the leaf of highest position first, each node's producers also by
decreasing position, nodes emitted when all they read is computed. The leaves of a gradient
graph are mostly the nodes computing weight gradients, which the engine emits as it walks
back from the loss: the last layer's first. The walk then starts from the first layer's
gradient, which needs the whole backward chain, and every other layer's weight gradient
waits until the end with its inputs (the layer's incoming gradient and saved activation)
alive: on the 2-layer transformer classifier at sequence 256, the LayerNorm and linear
weight gradients of all layers ran after the first layer's backward, and a liveness replay
in onnxruntime's order peaked at 26.0 MiB of tensors instead of 19.1 with the order below.

:func:`readiest_leaves_last` moves the leaves to the end of the graph, the one that can run
earliest (the shortest chain of nodes behind it) last, so the walk computes each weight's
gradient as soon as the backward reaches it. Only positions change. Applied to gradient graphs
run as they are (``onnx_derivative``, the command, the data-parallel step's gradient).

A fused train step keeps the gradient's nodes where the engine put them (weight gradients
moved to the end would only lengthen onnxruntime 1.19's topological sorts) and emits its
update in :func:`readiness_order` instead: the walk reaches the weight gradients through the
update's nodes, by their positions. The flat update's ``Concat`` of every gradient was the
same trap: its ``Reshape`` pieces, in weight order, had the walk start from the embedding's
gradient, so the transformer classifier's norm and head gradients ran after the whole
backward with their 1 MiB inputs alive; in readiness order its step peaks at 33.7 MiB
instead of 38.9 (``benchmarks/bench_memory.py``, sequence 256, glibc returning large blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx import GraphProto, NodeProto

from onnxgrad._onnx_utils import replace_repeated
from onnxgrad.graph._scopes import node_inputs


def readiest_leaves_last(graph: GraphProto) -> None:
    """Reorder ``graph`` (topologically sorted) in place: the leaves after every other node,
    by decreasing depth (longest chain of producers), ties in their order."""
    nodes = list(graph.node)
    read: set[str] = set()
    for node in nodes:  # not ``set().union(*sets)``: that holds every node's set at once
        read.update(node_inputs(node))
    leaves = [i for i, node in enumerate(nodes) if read.isdisjoint(node.output)]
    if len(leaves) < 2:
        return
    depth = node_depths(nodes)
    moved = set(leaves)
    leaves.sort(key=lambda i: -depth[i])
    order = [node for i, node in enumerate(nodes) if i not in moved] + [nodes[i] for i in leaves]
    replace_repeated(graph.node, order)


def readiness_order(graph: GraphProto, values: Sequence[str]) -> list[str]:
    """``values`` by decreasing depth of their producers, the readiest last (ties and graph
    inputs in their order): the order in which to emit nodes reading one value each, so that
    onnxruntime's walk, highest position first, reaches the readiest value first."""
    nodes = list(graph.node)
    depth = node_depths(nodes)
    made_by = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    ranked = sorted(
        range(len(values)), key=lambda k: -depth[made_by[values[k]]] if values[k] in made_by else 0
    )
    return [values[k] for k in ranked]


def node_depths(nodes: Sequence[NodeProto]) -> list[int]:
    """Each node's longest chain of producers, itself included (``nodes`` topologically
    sorted; values read from outer scopes count as inputs)."""
    made_by = {name: i for i, node in enumerate(nodes) for name in node.output}
    depth = [0] * len(nodes)
    for i, node in enumerate(nodes):  # one node's read set alive at a time
        producers = [made_by[r] for r in node_inputs(node) if r in made_by]
        depth[i] = 1 + max((depth[p] for p in producers if p < i), default=0)
    return depth
