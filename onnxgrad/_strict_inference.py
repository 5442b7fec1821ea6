"""onnx's checker and strict shape inference with type checks, run on a big graph piece by
piece.

onnx checks a graph node after node (each input produced before, each value produced once,
each node against its schema) and infers it the same way: the types of a node's outputs
follow from the types of its inputs and from the values of the constants it reads
(initializers, ``Constant`` outputs), and are checked against what the graph declares for
them (outputs, value infos). Run on a whole graph, the checker holds the parsed graph (2.7
KB a node of a chain's gradient graph, three gradient nodes per forward node) and the
inference that and the type of every value (4.8 KB), more than the graph itself.

:func:`check_in_pieces` runs both on consecutive pieces of :data:`PIECE_NODES` nodes, each
a model of its own holding the piece's nodes and, for what they read from before the piece,
the graph inputs and small initializers, the ``Constant`` nodes of earlier pieces (their
values size what a node computes), and the values earlier pieces computed, declared as
inputs of the type onnx inferred for them there; the piece's outputs and value infos are
those the graph declares. The first piece also holds every graph input and initializer
(onnx checks an initializer against the input of the same name). Each node is thus checked
and inferred from the same definitions, input types and constants, and against the same
declarations, as in the whole graph, and a value written again by a later piece is refused
in onnx's words, as is a node writing a graph input or initializer, and a graph output no
node writes: an error on the whole graph is one on a piece, naming the same node (onnx
reports the errors of one piece, the first of the whole graph's among them). A graph with an
operator onnx has no schema for is checked whole (onnx's inference then skips the graph).
Between pieces only the names written, and the types and constants a later piece reads, are
kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import onnx
from onnx import AttributeProto, GraphProto, ModelProto, NodeProto

#: The nodes of one piece (about 12 MB of onnx's inference for a gradient graph's nodes).
PIECE_NODES = 8192


def check_in_pieces(
    shell: ModelProto, nodes: Sequence[NodeProto], piece_nodes: int = PIECE_NODES
) -> bool:
    """onnx's checker, then its strict inference with type checks, of the model made of
    ``shell`` (everything but the nodes) and ``nodes``, ``piece_nodes`` nodes at a time (see
    the module docstring); raises what onnx raises. ``False`` (nothing judged wrong) when a
    value read across pieces has no inferred type an input can declare: the caller checks
    the whole graph."""
    if not all(_has_schema(node) for node in nodes):
        return False  # onnx's inference of a whole graph skips on such an op: so must we
    header = ModelProto()
    header.CopyFrom(shell)
    header.ClearField("graph")
    header.graph.name = shell.graph.name
    last_read = _last_reading_piece(nodes, piece_nodes)
    sources = _Sources(shell.graph)
    given = sources.inputs.keys() | sources.initializers.keys()
    produced: set[str] = set()  # by the nodes of earlier pieces
    types: dict[str, bytes] = {}  # value -> its ValueInfoProto, serialised
    constants: dict[str, bytes] = {}  # value -> the Constant node making it, serialised
    expiring: dict[int, list[str]] = {}
    for index, start in enumerate(range(0, len(nodes), piece_nodes)):
        piece_nodes_ = nodes[start : start + piece_nodes]
        written = _written_once(piece_nodes_, produced, given)
        piece = ModelProto()
        piece.CopyFrom(header)
        unranked: list[onnx.ValueInfoProto] = []  # inputs of an unknown rank
        if index == 0:
            sources.add_all(piece.graph)
        for name in _reads(piece_nodes_) - written:
            if name in constants:
                piece.graph.node.add().MergeFromString(constants[name])
            elif name in types:
                piece.graph.input.add().MergeFromString(types[name])
                if not piece.graph.input[-1].type.tensor_type.HasField("shape"):
                    unranked.append(piece.graph.input[-1])
            elif name in produced:
                return False
            elif index:
                sources.add(piece.graph, name)
        piece.graph.node.extend(piece_nodes_)
        sources.add_declarations(piece.graph, written)
        serialized = piece.SerializeToString()
        onnx.checker.check_model(_with_shapes(piece, unranked) if unranked else serialized)
        del piece, unranked
        inferred = onnx.shape_inference.infer_shapes(serialized, check_type=True, strict_mode=True)
        del serialized
        produced |= written
        later = {name for name in written if last_read.get(name, -1) > index}
        for info in [*inferred.graph.value_info, *inferred.graph.output]:
            if info.name in later and _declarable(info.type):
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
    _check_outputs_written(sources, produced | given)
    return True


def _has_schema(node: NodeProto) -> bool:
    return onnx.defs.has(node.op_type, node.domain)


def _check_outputs_written(sources: _Sources, defined: set[str]) -> None:
    """``ValidationError`` (onnx's words) for a graph output nothing defines: a piece
    declares only the outputs its nodes write."""
    missing = sorted(name for name in sources.outputs if name not in defined)
    if missing:
        raise onnx.checker.ValidationError(
            f"Graph output '{missing[0]}' is not an output of any node in graph."
        )


def _declarable(value_type: onnx.TypeProto) -> bool:
    """Whether an input can declare this inferred type: a tensor type with its element type
    (the rank may be unknown: see :func:`_with_shapes`)."""
    return value_type.WhichOneof("value") == "tensor_type" and value_type.tensor_type.elem_type != 0


def _with_shapes(piece: ModelProto, unranked: list[onnx.ValueInfoProto]) -> bytes:
    """``piece`` serialised for onnx's checker, which wants a shape on every input: the
    ``unranked`` inputs (values of an unknown rank, which the whole graph reads as such and
    the piece's inference too) get an empty one, which the checker does not read further."""
    for info in unranked:
        info.type.tensor_type.shape.SetInParent()
    return piece.SerializeToString()


def _written_once(nodes: Sequence[NodeProto], produced: set[str], given) -> set[str]:
    """The values ``nodes`` write; ``ValidationError`` (onnx's words) for one an earlier
    piece wrote or the graph ``given`` as an input or initializer (within a piece, onnx's
    checker sees it)."""
    written = {name for node in nodes for name in node.output[:] if name}
    again = written & produced | written & given
    if again:
        raise onnx.checker.ValidationError(
            "Graph must be in single static assignment (SSA) form, however "
            f"'{min(again)}' has been used as output names multiple times."
        )
    return written


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
    yield from filter(None, node.input[:])  # a slice: a third of the time of iterating
    attributes = node.attribute
    if not attributes:
        return
    for attribute in attributes:
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
