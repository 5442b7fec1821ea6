r"""Attention in tiles of query rows, forward and backward: flash attention written with
standard ONNX operators.

An attention core :math:`O = \mathrm{softmax}(f(Q K_t, M_1, \dots)) V` (``f`` elementwise
score ops: a scale, an additive or ``Where`` mask, a soft cap; the softmax over the last
axis) keeps its probabilities :math:`P` (``lead x Sq x Sk``) for the backward
(:math:`dV = P^T dO`, :math:`dS = P (dP - \mathrm{rowsum}(dP\,P))`), and the backward adds
:math:`dP` and :math:`dS` of the same size: at sequence 256 they dominate a train step's
memory. Row ``r`` of ``O`` reads row ``r`` of ``Q`` and of the masks only, so the core runs
in tiles of ``R`` query rows, each a ``Loop`` iteration:

* forward: :math:`O_r = \mathrm{softmax}(f(Q_r K_t, M_r)) V`, written into rows ``r`` of
  the loop's state ``O`` (``Concat`` of the rows before, the tile, the rows after, so the
  state keeps its shape and the loop can be differentiated again);
* backward: the tile's core is run again from :math:`Q_r` and differentiated by the
  engine's own rules with the seed :math:`dO_r`, giving :math:`dQ_r` (written into rows
  ``r`` of ``dQ`` the same way) and contributions to :math:`dK_t` and :math:`dV` (summed
  over the tiles).

Only one tile's scores, probabilities and their gradients are alive at a time, for one
more :math:`Q_r K_t` product and softmax per tile in the backward. The tile height is
chosen at run time from the shapes, :math:`R = \max(R_0, \lfloor B / (|lead|\,S_k) \rfloor)`
for a budget of ``B`` score elements a tile (:data:`TILE_ELEMENTS`) and at least
:math:`R_0` rows (:data:`MIN_TILE_ROWS`), and the loop runs :math:`\lceil S_q / R \rceil`
times (the last tile may be shorter).

Before differentiation, :func:`fuse_attention` replaces each core by one
``TiledAttention`` node of an internal domain (inputs ``Q, Kt, V`` and the masks, the core's
nodes as its ``body``), whose gradient rule builds the backward loop; after it,
:func:`expand_tiled_attention` turns the remaining nodes into their forward loops, so the
result holds standard operators only. A core is left alone when a mask needs a gradient
(a trained position bias), when ranks are unknown or differ, when a value inside it is
read elsewhere, or when one head's scores are known to be small (:data:`MIN_SCORES`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, NameScope, is_default_op, np_dtype, subgraphs
from onnxgrad.derivative.autodiff.activity import active_values
from onnxgrad.derivative.autodiff.builder import NodeView
from onnxgrad.derivative.autodiff.value_types import ValueType
from onnxgrad.graph._scopes import free_names

#: domain of the ``TiledAttention`` node that lives between fusion and expansion only
DOMAIN = "onnxgrad.internal"
OP_TYPE = "TiledAttention"
#: default budget of score elements per tile (1 MiB of float32 scores): on the transformer
#: classifier at sequence 256 (batch 32, 2 heads of 16), 1 << 16, 18, 20 and 22 elements
#: (4, 16, 64 and 256 rows a tile) took 1.43, 0.99, 0.93 and 1.13 times the untiled step's
#: CPU time, for a peak of 43, 44, 58 MiB (and 135 untiled)
TILE_ELEMENTS = 1 << 18
#: fewest rows of a tile, whatever the budget (each iteration costs ~20 small kernels)
MIN_TILE_ROWS = 16
#: smallest score matrix of one head (query rows x keys, when both are static) worth tiling:
#: at sequence 16 a loop made the transformer classifier's step 9 % slower for no memory
MIN_SCORES = 128 * 128
#: elementwise ops allowed between the score product and the softmax
SCORE_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Where", "Cast", "Tanh", "Neg"})


@dataclass
class _Core:
    """One attention core of a graph: its nodes (product, score ops, softmax, product) and
    the values it reads."""

    nodes: list[NodeProto]
    q: str
    kt: str
    v: str
    masks: list[str]
    output: str

    @property
    def inputs(self) -> list[str]:
        return [self.q, self.kt, self.v, *self.masks]


# -- fusion ---------------------------------------------------------------------------------
def fuse_attention(
    graph: GraphProto,
    types: Mapping[str, ValueType],
    sources: Sequence[str],
    opset: int,
    tile_elements: int | None = None,
) -> int:
    """Replace every attention core of ``graph`` (not its subgraphs) by a ``TiledAttention``
    node of ``tile_elements`` (:data:`TILE_ELEMENTS`) score elements a tile; returns how
    many. ``types`` must know the ranks of ``Q``, ``Kt`` and ``V``."""
    tile_elements = TILE_ELEMENTS if tile_elements is None else tile_elements
    if opset < 13:
        return 0

    def is_float(name: str) -> bool:
        value = types.get(name)
        return value is None or value.elem_type in FLOAT_TYPES

    active = active_values(graph.node, sources, is_float)
    cores = _find_cores(graph, types, active)
    if not cores:
        return 0
    fused = {id(node): core for core in cores for node in core.nodes}
    kept = []
    for node in graph.node:
        core = fused.get(id(node))
        if core is None:
            kept.append(node)
        elif node is core.nodes[-1]:
            kept.append(_fused_node(core, tile_elements))
    del graph.node[:]
    graph.node.extend(kept)
    return len(cores)


def _find_cores(graph: GraphProto, types: Mapping[str, ValueType], active: set[str]):
    readers: dict[str, list[NodeProto]] = {}
    for node in graph.node:
        for name in {i for i in node.input if i}:
            readers.setdefault(name, []).append(node)
    for sub_reader in _subgraph_reads(graph):
        readers.setdefault(sub_reader, []).append(None)
    outputs = {o.name for o in graph.output}
    producer = {o: node for node in graph.node for o in node.output if o}

    def private(name: str, reader: NodeProto) -> bool:
        return name not in outputs and readers.get(name, []) == [reader]

    cores = []
    for softmax in graph.node:
        if not is_default_op(softmax, "Softmax") or len(softmax.output) != 1:
            continue
        core = _core_at(softmax, types, active, readers, producer, private)
        if core is not None:
            cores.append(core)
    return cores


def _core_at(softmax, types, active, readers, producer, private) -> _Core | None:
    """The core around ``softmax``: ``MatMul -> score ops -> Softmax -> MatMul``, each
    value read by the next node only, or ``None``."""
    p = softmax.output[0]
    after = readers.get(p, [])
    if len(after) != 1 or after[0] is None or not private(p, after[0]):
        return None
    out = after[0]
    if not is_default_op(out, "MatMul") or out.input[0] != p:
        return None
    leads = _ScoreChains(producer)
    chain, masks, value, reader = [], [], softmax.input[0], softmax
    while True:
        node = producer.get(value)
        if node is None or not private(value, reader):
            return None
        if is_default_op(node, "MatMul"):
            break
        if not is_default_op(node, *SCORE_OPS) or len(node.output) != 1:
            return None
        inputs = [i for i in node.input if i]
        upstream = [i for i in inputs if leads(i)]
        if len(upstream) != 1 or inputs.count(upstream[0]) != 1:
            return None
        masks.extend(i for i in inputs if i != upstream[0] and i not in masks)
        chain.append(node)
        value, reader = upstream[0], node
    q, kt, v = node.input[0], node.input[1], out.input[1]
    if not _rank_checked(types, q, kt, v, out.output[0], softmax, masks):
        return None
    if _small_scores(types, q, kt):
        return None
    if any(m in active for m in masks) or len({q, kt, v, *masks}) != 3 + len(masks):
        return None
    return _Core([node, *reversed(chain), softmax, out], q, kt, v, masks, out.output[0])


class _ScoreChains:
    """Whether a value comes from a ``MatMul`` through score ops only (memoised)."""

    def __init__(self, producer):
        self.producer = producer
        self.known: dict[str, bool] = {}

    def __call__(self, name: str, depth: int = 0) -> bool:
        if name not in self.known:
            node = self.producer.get(name)
            if node is None or depth > 32:
                result = False
            elif is_default_op(node, "MatMul"):
                result = True
            else:
                result = is_default_op(node, *SCORE_OPS) and any(
                    self(i, depth + 1) for i in node.input if i
                )
            self.known[name] = result
        return self.known[name]


def _rank_checked(types, q, kt, v, o, softmax, masks) -> bool:
    ranks = [_rank(types, n) for n in (q, kt, v, o)]
    if None in ranks or len(set(ranks)) != 1 or ranks[0] < 2:
        return False
    rank = ranks[0]
    axis = NodeView(softmax, 0).attr("axis", -1)
    if axis not in (-1, rank - 1):
        return False
    return all((r := _rank(types, m)) is not None and r <= rank for m in masks)


def _small_scores(types, q: str, kt: str) -> bool:
    """Whether one head's scores are known to hold fewer than :data:`MIN_SCORES` elements."""
    rows, keys = types[q].shape[-2], types[kt].shape[-1]
    return isinstance(rows, int) and isinstance(keys, int) and rows * keys < MIN_SCORES


def _rank(types, name: str) -> int | None:
    value = types.get(name)
    return None if value is None or value.shape is None else len(value.shape)


def _subgraph_reads(graph: GraphProto) -> set[str]:
    return {name for node in graph.node for sub in subgraphs(node) for name in free_names(sub)}


def _fused_node(core: _Core, tile_elements: int) -> NodeProto:
    body = helper.make_graph(
        core.nodes,
        f"{core.nodes[-2].name or 'softmax'}_core",
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in core.inputs],
        [helper.make_tensor_value_info(core.output, TensorProto.UNDEFINED, None)],
    )
    softmax = core.nodes[-2]
    node = helper.make_node(
        OP_TYPE,
        core.inputs,
        [core.output],
        name=softmax.name,
        domain=DOMAIN,
        body=body,
        tile_elements=int(tile_elements),
        min_rows=int(MIN_TILE_ROWS),
    )
    node.metadata_props.extend(softmax.metadata_props)
    return node


# -- loops ----------------------------------------------------------------------------------
class Nodes:
    """Nodes under construction with fresh value and node names."""

    def __init__(self, scope: NameScope, node_names: NameScope, prefix: str):
        self.scope = scope
        self.node_names = node_names
        self.prefix = prefix
        self.nodes: list[NodeProto] = []

    def fresh(self, base: str) -> str:
        return self.scope.unique(f"{self.prefix}{base}")

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        output = self.fresh(f"{op_type}_out")
        node_name = self.node_names.unique(f"{self.prefix}{op_type}")
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=node_name, **attrs))
        return output

    def const(self, value, dtype=np.int64) -> str:
        tensor = numpy_helper.from_array(np.asarray(value, dtype=dtype))
        return self.op("Constant", value=tensor)

    def child(self) -> Nodes:
        return Nodes(self.scope, self.node_names, self.prefix)


@dataclass
class TilePlan:
    """Outer values of a tiled loop: rows per tile and the trip count (int64 scalars)."""

    rows: str
    trips: str


def tile_plan(nodes: Nodes, q: str, kt: str, tile_elements: int, min_rows: int) -> TilePlan:
    """``R = max(min_rows, budget // max(1, |lead(Q)| * Sk))`` rows a tile, and
    ``ceil(Sq / R)`` trips."""
    shape_q = nodes.op("Shape", q)
    sq = nodes.op("Gather", shape_q, nodes.const(-2))
    lead = nodes.op("Slice", shape_q, nodes.const([0]), nodes.const([-2]))
    batch = nodes.op("ReduceProd", lead, keepdims=0)
    sk = nodes.op("Gather", nodes.op("Shape", kt), nodes.const(-1))
    one = nodes.const(1)
    per_row = nodes.op("Max", nodes.op("Mul", batch, sk), one)
    rows = nodes.op("Div", nodes.const(tile_elements), per_row)
    rows = nodes.op("Max", rows, nodes.const(max(1, min_rows)))
    trips = nodes.op("Div", nodes.op("Add", sq, nodes.op("Sub", rows, one)), rows)
    return TilePlan(rows, trips)


@dataclass
class TileRows:
    """The row range of one iteration inside a loop body."""

    start: str
    end: str
    axes: str

    def rows_of(self, nodes: Nodes, x: str) -> str:
        return nodes.op("Slice", x, self.start, self.end, self.axes)

    def written(self, nodes: Nodes, full: str, rows: str) -> str:
        """``full`` with the tile's rows replaced by ``rows``: the same shape every
        iteration (a loop state that a later differentiation can stack)."""
        before = nodes.op("Slice", full, nodes.const([0]), self.start, self.axes)
        after = nodes.op("Slice", full, self.end, nodes.const([2**62]), self.axes)
        return nodes.op("Concat", before, rows, after, axis=-2)

    def rows_of_mask(self, nodes: Nodes, mask: str, mask_type: ValueType | None) -> str:
        """The tile's rows of a mask broadcast against the scores (its axis -2 is the
        query rows', sliced when it has more than one row)."""
        shape = None if mask_type is None else mask_type.shape
        if shape is not None and (len(shape) < 2 or shape[-2] == 1):
            return mask
        dim = nodes.op("Gather", nodes.op("Shape", mask), nodes.const([-2]))
        single = nodes.op("Equal", dim, nodes.const([1]))
        start = nodes.op("Where", single, nodes.const([0]), self.start)
        end = nodes.op("Where", single, nodes.const([1]), self.end)
        return nodes.op("Slice", mask, start, end, self.axes)


def tile_rows(nodes: Nodes, iteration: str, rows: str) -> TileRows:
    first = nodes.op("Mul", iteration, rows)
    start = nodes.op("Unsqueeze", first, nodes.const([0]))
    end = nodes.op("Unsqueeze", nodes.op("Add", first, rows), nodes.const([0]))
    return TileRows(start, end, nodes.const([-2]))


def core_copy(
    nodes: Nodes, body: GraphProto, renames: Mapping[str, str]
) -> tuple[list[NodeProto], str]:
    """The core's nodes with its inputs renamed by ``renames`` and every value it computes
    given a fresh name; returns the nodes and the name of the copy's output."""
    names = dict(renames)
    copies = []
    for node in body.node:
        copy = NodeProto()
        copy.CopyFrom(node)
        copy.name = nodes.node_names.unique(f"{nodes.prefix}{node.op_type}")
        del copy.metadata_props[:]
        for i, name in enumerate(copy.input):
            copy.input[i] = names.get(name, name)
        for i, name in enumerate(copy.output):
            if name:
                names[name] = copy.output[i] = nodes.fresh(name)
        copies.append(copy)
    return copies, names[body.output[0].name]


def _state_info(name: str, value: ValueType):
    """A loop state's type: the element type and rank of ``value``, no sizes (symbols of
    the outer graph mean nothing in the body)."""
    shape = None if value.shape is None else [None] * len(value.shape)
    return helper.make_tensor_value_info(name, value.elem_type, shape)


def _scalar_info(name: str, elem_type: int):
    return helper.make_tensor_value_info(name, elem_type, [])


def loop(
    nodes: Nodes,
    trips: str,
    state_inits: Sequence[str],
    fill_body: Callable[[Nodes, str, list[str]], list[str]],
    state_types: Sequence[ValueType],
    name: str,
    outputs: Sequence[str] | None = None,
) -> list[str]:
    """``Loop(trips, true, *state_inits)``: ``fill_body(body, iteration, states)`` appends
    the body's nodes and returns the next states; returns the final states (named
    ``outputs`` when given)."""
    body = nodes.child()
    iteration, condition = body.fresh("iteration"), body.fresh("condition")
    states = [body.fresh("state") for _ in state_inits]
    updated = fill_body(body, iteration, states)
    condition_out = body.op("Identity", condition)
    graph = helper.make_graph(
        body.nodes,
        f"{name}_body",
        [
            _scalar_info(iteration, TensorProto.INT64),
            _scalar_info(condition, TensorProto.BOOL),
            *[_state_info(s, t) for s, t in zip(states, state_types)],
        ],
        [
            _scalar_info(condition_out, TensorProto.BOOL),
            *[_state_info(s, t) for s, t in zip(updated, state_types)],
        ],
    )
    true = nodes.op("Constant", value=numpy_helper.from_array(np.array(True)))
    outputs = list(outputs) if outputs else [nodes.fresh("tiled") for _ in state_inits]
    nodes.nodes.append(
        helper.make_node(
            "Loop",
            [trips, true, *state_inits],
            outputs,
            name=nodes.node_names.unique(name),
            body=graph,
        )
    )
    return outputs


# -- forward expansion ----------------------------------------------------------------------
def expand_tiled_attention(
    graph: GraphProto,
    types: Mapping[str, ValueType],
    scope: NameScope,
    node_names: NameScope,
) -> int:
    """Replace every ``TiledAttention`` node of ``graph`` by its forward loop; returns how
    many."""
    expanded, count = [], 0
    for node in graph.node:
        if node.op_type != OP_TYPE or node.domain != DOMAIN:
            expanded.append(node)
            continue
        nodes = Nodes(scope, node_names, f"{node.name or 'attention'}_tiles/")
        _forward_loop(nodes, node, types)
        nodes.nodes[-1].metadata_props.extend(node.metadata_props)
        expanded.extend(nodes.nodes)
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(expanded)
    return count


def fused_parts(node) -> tuple[GraphProto, int, int]:
    """The body, the tile budget and the fewest rows of a tile of a ``TiledAttention`` node
    (a NodeProto or a view)."""
    view = node if isinstance(node, NodeView) else NodeView(node, 0)
    return (
        view.attr("body"),
        view.attr("tile_elements", TILE_ELEMENTS),
        view.attr("min_rows", MIN_TILE_ROWS),
    )


def _forward_loop(nodes: Nodes, node: NodeProto, types: Mapping[str, ValueType]) -> None:
    body, budget, min_rows = fused_parts(node)
    q, kt, v, *masks = node.input
    plan = tile_plan(nodes, q, kt, budget, min_rows)
    zeros = _zero_output(nodes, q, kt, v, types[node.output[0]].elem_type)
    formal = [i.name for i in body.input]

    def fill(inner: Nodes, iteration: str, states: list[str]) -> list[str]:
        tile = tile_rows(inner, iteration, plan.rows)
        renames = {formal[0]: tile.rows_of(inner, q), formal[1]: kt, formal[2]: v}
        for name, mask in zip(formal[3:], masks):
            renames[name] = tile.rows_of_mask(inner, mask, types.get(mask))
        copies, out = core_copy(inner, body, renames)
        inner.nodes.extend(copies)
        return [tile.written(inner, states[0], out)]

    output = node.output[0]
    loop(nodes, plan.trips, [zeros], fill, [types[output]], node.name or "tiles", [output])


def _zero_output(nodes: Nodes, q: str, kt: str, v: str, elem_type: int) -> str:
    """``lead x Sq x Dv`` zeros: the broadcast leading dims of ``Q``, ``Kt``, ``V`` (of
    equal ranks; a size 0 wins over 1), the query rows and the value width."""
    leads = [
        nodes.op("Slice", nodes.op("Shape", x), nodes.const([0]), nodes.const([-2]))
        for x in (q, kt, v)
    ]
    largest = nodes.op("Max", *leads)
    smallest = nodes.op("Min", nodes.op("Min", *leads), nodes.const([1]))
    lead = nodes.op("Mul", largest, smallest)
    width = nodes.op("Slice", nodes.op("Shape", v), nodes.const([-1]), nodes.const([2**62]))
    rows = nodes.op("Slice", nodes.op("Shape", q), nodes.const([-2]), nodes.const([-1]))
    shape = nodes.op("Concat", lead, rows, width, axis=0)
    zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(elem_type)))
    return nodes.op("ConstantOfShape", shape, value=zero)
