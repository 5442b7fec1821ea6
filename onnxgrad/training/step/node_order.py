"""Node order for onnxruntime 1.19's session creation: each node soon after its inputs.

onnxruntime (1.19 at least) sorts the graph again every time it builds a ``GraphViewer``,
about 95 times while creating a session (once per graph transformer and pass): Kahn's
algorithm emitting the ready node of lowest index (its position in ``graph.node``) first, the
ready nodes kept in a sorted ``std::list`` that each insertion walks from end to end. With
the nodes in a topological order, node ``j`` waits in that list from the emission of its last
producer ``p(j)`` to its own, so one sort walks about

    W = sum over nodes j of (j - p(j) - 1)    (p(j) = -1 for a node reading no node output)

list cells (:func:`waiting`). A gradient or train step written forward, backward, update keeps
many nodes waiting: those reading only weights, optimizer state or constants (the backward's
weight transposes, Adam's ``beta * m``) and those reading forward values only (the backward's
``1 - tanh^2``, shapes). On the Llama-like step of ``benchmarks/bench_session_creation.py``
(hidden 64; 16, 32, 64 layers, 3,207 to 12,423 nodes) ``W / nodes`` is 268, 524, 1,037: the
walks grow with depth squared.

:func:`ready_order` places each node as soon as its inputs are computed (Kahn's algorithm,
first ready first out, ties in the original order); onnxruntime's sort then emits the nodes in
this order and walks 4.7, 6.6, 10.7 cells per node on the same graphs: the 64-layer step's
session takes 2.8 s instead of 4.5, the flat-updated MLP's grows x2 per doubling of depth
instead of x3.4 (docs/benchmarks.md). The values computed are the same, but onnxruntime's
``DEFAULT`` execution order (a depth-first walk back from the outputs) breaks its ties by
position: the 32-layer Llama step runs 4-5% slower rearranged (50.2 against 48.3 ms, one
thread), resnet18 peaks 1.3% higher; onnxruntime 1.32 creates the sessions no faster. So the
runners load the graphs as built, and this module measures an order (:func:`waiting`) and
rearranges a graph (:func:`put_in_ready_order`) where session creation on onnxruntime 1.19
matters more.

The per-weight train step takes the part that leaves the execution order alone
(:func:`place_after_producers`): the update's nodes other than its leaves come right after
what they read (Adam's ``(1 - beta) g`` after the gradient, ``beta m`` first), its leaves
stay last in the order of readiness that onnxruntime's walk starts from. Inside the backward
nothing moves, and onnxruntime runs the update's nodes when the walk from their leaf reaches
them, wherever they are. (Positions still break ties between the producers of one node: the
flat update's ``Concat`` of every gradient keeps its pieces in the order of readiness.)
A per-weight Adam step of a 128-layer MLP: W 2.7 -> 1.1 million cells, session 1.8 -> 1.1 s;
the 8-layer Llama-like step 1.12 -> 0.90 s, the same losses, step time and peak.

Training sessions now run in onnxruntime's ``PRIORITY_BASED`` order
(:mod:`~onnxgrad.training.running.session_options`): Kahn's algorithm, ready ``Shape``/``Size``
first, then the ready node of lowest position, so the positions set here are the execution
order itself, except where onnxruntime's fusions give the fused node a new, higher index (a
backward node reading forward values only may then run in the forward, unless
:mod:`~onnxgrad.derivative.late_backward` gated it). Sessions given ``DEFAULT`` walk back
from the leaves as described above.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

from onnx import AttributeProto, GraphProto, ModelProto, NodeProto


def producers(nodes: Sequence[NodeProto]) -> list[set[int]]:
    """For each node, the positions of the nodes computing what it reads (its inputs and
    the names read inside its subgraphs)."""
    nodes = list(nodes)
    made_by = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    sources = []
    for i, node in enumerate(nodes):
        reads = _reads(node) if len(node.attribute) else node.input
        found = {made_by[name] for name in reads if name in made_by}
        found.discard(i)
        sources.append(found)
    return sources


def waiting(sources: Sequence[set[int]]) -> int:
    """``W``: cells onnxruntime's sort walks on nodes in this order (``sources`` from
    :func:`producers`)."""
    return sum(j - 1 - max(found, default=-1) for j, found in enumerate(sources))


def ready_order(sources: Sequence[set[int]]) -> list[int]:
    """Positions of the nodes in first-ready-first-out topological order (``sources`` from
    :func:`producers`). Nodes left over by a cycle (an invalid graph) keep their order at the
    end."""
    remaining = [len(found) for found in sources]
    consumers: list[list[int]] = [[] for _ in range(len(sources))]
    for i, found in enumerate(sources):
        for source in found:
            consumers[source].append(i)
    queue = deque(i for i, count in enumerate(remaining) if count == 0)
    order = []
    while queue:
        i = queue.popleft()
        order.append(i)
        for j in sorted(consumers[i]):
            remaining[j] -= 1
            if remaining[j] == 0:
                queue.append(j)
    if len(order) < len(sources):
        placed = set(order)
        order += [i for i in range(len(sources)) if i not in placed]
    return order


def put_in_ready_order(model: ModelProto) -> ModelProto:
    """``model``, the nodes of its main graph sorted in place into :func:`ready_order`.

    The nodes are sorted, not removed and added again: protobuf (upb) would keep the storage
    of the removed nodes as long as the model lives (3.7 MiB on the 16-layer Llama step).
    """
    nodes = model.graph.node
    order = ready_order(producers(nodes))
    if order != list(range(len(order))):
        rank = {_identity(nodes[i]): position for position, i in enumerate(order)}
        nodes.sort(key=lambda node: rank[_identity(node)])
    return model


def after_producers(sources: Sequence[set[int]], movable: Iterable[int]) -> list[int]:
    """Positions in an order where each node of ``movable`` comes right after the last of
    its producers (those reading none first), the others keeping their order (``sources``
    from :func:`producers`, in a topological order)."""
    moving = set(movable)
    waits = {i: set(sources[i]) for i in moving}
    readers: dict[int, list[int]] = {}
    for i in sorted(moving):
        for source in waits[i]:
            readers.setdefault(source, []).append(i)
    order: list[int] = []
    placed: set[int] = set()
    for i in sorted(moving):
        if not waits[i]:
            _place(i, order, placed, waits, readers)
    for i in range(len(sources)):
        if i not in moving:
            _place(i, order, placed, waits, readers)
    return order


def _place(first, order, placed, waits, readers) -> None:
    """Append ``first`` to ``order``, then every node of ``readers`` it leaves with
    nothing to wait for, depth first."""
    if first in placed:
        return
    order.append(first)
    placed.add(first)
    stack = [first]
    while stack:
        done = stack.pop()
        for reader in readers.get(done, ()):
            waits[reader].discard(done)
            if not waits[reader] and reader not in placed:
                order.append(reader)
                placed.add(reader)
                stack.append(reader)


def place_after_producers(graph: GraphProto, movable: Callable[[NodeProto], bool]) -> None:
    """Sort ``graph``'s nodes in place: those ``movable`` says and that another node reads
    right after the last of their producers (:func:`after_producers`); the leaves where
    they are, since onnxruntime's default execution order starts from them by position."""
    nodes = graph.node
    sources = producers(nodes)
    read = {source for found in sources for source in found}
    chosen = [i for i, node in enumerate(nodes) if i in read and movable(node)]
    order = after_producers(sources, chosen)
    if order != list(range(len(order))):
        rank = {_identity(nodes[i]): position for position, i in enumerate(order)}
        nodes.sort(key=lambda node: rank[_identity(node)])


def _identity(node: NodeProto) -> tuple:
    """What tells nodes apart: their outputs (unique in a graph, unless all empty), else
    what they read and their type (nodes alike in all of it can trade places)."""
    return (tuple(node.output), tuple(node.input), node.name, node.domain, node.op_type)


def _reads(node: NodeProto) -> Iterator[str]:
    """Names ``node`` reads: its inputs and every input of the nodes of its subgraphs."""
    yield from node.input
    for attribute in node.attribute:
        graphs = list(attribute.graphs)
        if attribute.type == AttributeProto.GRAPH:
            graphs.append(attribute.g)
        for graph in graphs:
            for inner in graph.node:
                yield from _reads(inner)


__all__ = [
    "after_producers",
    "place_after_producers",
    "producers",
    "put_in_ready_order",
    "ready_order",
    "waiting",
]
