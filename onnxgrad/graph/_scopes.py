"""Name scopes of a graph and its subgraphs.

A subgraph (If branch, Loop or Scan body) may read any name of the graphs enclosing it;
a name it defines itself (input, initializer, node output) shadows the outer one.
"""

from __future__ import annotations

from collections.abc import Iterator

from onnx import GraphProto, NodeProto

from onnxgrad._onnx_utils import subgraphs


def defined_names(graph: GraphProto) -> set[str]:
    """Names a graph defines itself: its inputs, initializers and node outputs."""
    names = {i.name for i in graph.input}
    names |= {i.name for i in graph.initializer}
    names |= {i.values.name for i in graph.sparse_initializer}
    names |= {o for node in graph.node for o in node.output if o}
    return names


def free_names(graph: GraphProto) -> set[str]:
    """Names a graph reads from its enclosing scopes (through its nodes or subgraphs)."""
    reads = {o.name for o in graph.output}
    for node in graph.node:
        reads |= node_inputs(node)
    return reads - defined_names(graph)


def node_inputs(node: NodeProto) -> set[str]:
    """The names a node reads: its inputs and the free names of its subgraphs."""
    names = set(node.input[:])  # a slice reads the strings at once
    names.discard("")
    if node.attribute:  # most nodes have none, and no subgraph to look for
        for sub in subgraphs(node):
            names |= free_names(sub)
    return names


def iter_graphs(graph: GraphProto) -> Iterator[GraphProto]:
    """The graph then every subgraph it holds, depth first."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from iter_graphs(sub)
