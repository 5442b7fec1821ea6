"""onnx's strict shape inference with type checks, run on a big graph piece by piece.

onnx infers a graph node after node: the types of a node's outputs follow from the types of
its inputs and from the values of the constants it reads (initializers, ``Constant``
outputs), and are checked against what the graph declares for them (outputs, value
infos). Run on a whole graph, it holds the parsed graph and the type of every value at
once: 4.8 KB a node of a chain's gradient graph (three gradient nodes per forward node),
more than the graph itself.

:func:`infer_in_pieces` runs it on consecutive pieces of :data:`PIECE_NODES` nodes, each a
model of its own holding the piece's nodes and, for what they read from before the piece,
the graph inputs and small initializers, the ``Constant`` nodes of earlier pieces (their
values size what a node computes), and the values earlier pieces computed declared as
inputs of the type onnx inferred for them there; the piece's outputs and value infos are
those the graph declares. The first piece also holds every graph input and initializer
(onnx checks an initializer against the input of the same name). Each node is thus
inferred from the same input types and constants, and checked against the same
declarations, as in the whole graph: an error on the whole graph is one on a piece, naming the same
node (onnx reports the errors of one piece, the first of the whole graph's among them).
Between pieces only the types and constants a later piece reads are kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto

#: The nodes of one piece (about 12 MB of onnx's inference for a gradient graph's nodes).
PIECE_NODES = 8192


def infer_strictly(shell: ModelProto, nodes: Sequence[NodeProto], view: bytes | None) -> None:
    """``onnx.shape_inference.infer_shapes(check_type=True, strict_mode=True)`` of the model
    made of ``shell`` (everything but the nodes) and ``nodes``: on ``view`` (that model
    serialised) in one go, in pieces of :data:`PIECE_NODES` nodes when ``view`` is
    ``None``; raises what onnx raises."""
    if view is not None:
        onnx.shape_inference.infer_shapes(view, check_type=True, strict_mode=True)
    else:
        infer_in_pieces(shell, nodes)


def infer_in_pieces(
    shell: ModelProto, nodes: Sequence[NodeProto], piece_nodes: int = PIECE_NODES
) -> None:
    """onnx's strict inference of ``shell`` with ``nodes``, ``piece_nodes`` nodes at a time
    (see the module docstring)."""
    graph = shell.graph
    header = ModelProto()
    header.CopyFrom(shell)
    header.ClearField("graph")
    last_read = _last_reading_piece(nodes, piece_nodes)
    sources = _Sources(graph)
    types: dict[str, bytes] = {}  # value -> its ValueInfoProto, serialised
    constants: dict[str, bytes] = {}  # value -> the Constant node making it, serialised
    expiring: dict[int, list[str]] = {}
    for index, start in enumerate(range(0, len(nodes), piece_nodes)):
        piece_nodes_ = [nodes[i] for i in range(start, min(start + piece_nodes, len(nodes)))]
        written = {name for node in piece_nodes_ for name in node.output if name}
        piece = ModelProto()
        piece.CopyFrom(header)
        if index == 0:
            sources.add_all(piece.graph)
        for name in _reads(piece_nodes_) - written:
            if name in constants:
                piece.graph.node.add().MergeFromString(constants[name])
            elif name in types:
                piece.graph.input.add().MergeFromString(types[name])
            elif index:
                sources.add(piece.graph, name)
        piece.graph.node.extend(piece_nodes_)
        sources.add_declarations(piece.graph, written)
        inferred = onnx.shape_inference.infer_shapes(
            piece.SerializeToString(), check_type=True, strict_mode=True
        )
        del piece
        later = {name for name in written if last_read.get(name, -1) > index}
        for info in [*inferred.graph.value_info, *inferred.graph.output]:
            if info.name in later:
                types[info.name] = info.SerializeToString()
        for node in piece_nodes_:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for name in later.intersection(node.output):
                    constants[name] = node.SerializeToString()
        for name in later:
            expiring.setdefault(last_read[name], []).append(name)
        for name in expiring.pop(index, ()):
            types.pop(name, None)
            constants.pop(name, None)


class _Sources:
    """What the graph itself declares: inputs, initializers (small ones: the shell is a
    weightless view), outputs and value infos, by name."""

    def __init__(self, graph: GraphProto):
        self.inputs = {i.name: i for i in graph.input}
        self.initializers = {i.name: i for i in graph.initializer}
        self.outputs = {o.name: o for o in graph.output}
        self.infos = {v.name: v for v in graph.value_info}

    def add_all(self, piece: GraphProto) -> None:
        """Every input and initializer, and the outputs no node computes."""
        piece.input.extend(self.inputs.values())
        piece.initializer.extend(self.initializers.values())
        given = self.inputs.keys() | self.initializers.keys()
        piece.output.extend(o for name, o in self.outputs.items() if name in given)

    def add(self, piece: GraphProto, name: str) -> None:
        """The input and the initializer ``name``, where the graph has them."""
        if name in self.inputs:
            piece.input.append(self.inputs[name])
        if name in self.initializers:
            piece.initializer.append(self.initializers[name])

    def add_declarations(self, piece: GraphProto, written: set[str]) -> None:
        """The declared outputs and value infos of the values ``written``."""
        piece.output.extend(self.outputs[name] for name in written if name in self.outputs)
        piece.value_info.extend(self.infos[name] for name in written if name in self.infos)


def _last_reading_piece(nodes: Sequence[NodeProto], piece_nodes: int) -> dict[str, int]:
    """``value -> the index of the last piece reading it``."""
    last: dict[str, int] = {}
    for position, node in enumerate(nodes):
        for name in _node_reads(node):
            last[name] = position // piece_nodes
    return last


def _reads(nodes: Sequence[NodeProto]) -> set[str]:
    return {name for node in nodes for name in _node_reads(node)}


def _node_reads(node: NodeProto) -> Iterator[str]:
    """The node's inputs, and every name its subgraphs mention: those the enclosing graph
    defines are the ones they read from it (a superset is harmless: a name the piece does
    not know is left undeclared, as it is in the whole graph)."""
    yield from filter(None, node.input)
    for attribute in node.attribute:
        if attribute.type == AttributeProto.GRAPH:
            yield from _mentioned(attribute.g)
        elif attribute.type == AttributeProto.GRAPHS:
            for sub in attribute.graphs:
                yield from _mentioned(sub)


def _mentioned(graph: GraphProto) -> Iterator[str]:
    for output in graph.output:
        yield output.name
    for node in graph.node:
        yield from _node_reads(node)
