"""The backward of an attention core computed in tiles of query rows
(:mod:`~onnxgrad.derivative.autodiff.attention_tiles`).

A ``Loop`` over the same tiles as the forward: tile ``r`` runs the core again on
:math:`Q_r` (and the masks' rows ``r``) and differentiates that copy with the engine's rules,
seeded with :math:`dO_r`; :math:`dQ_r` are written into their rows of :math:`dQ`, the
contributions to :math:`dK_t` and :math:`dV` summed.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.derivative.autodiff.attention_tiles import (
    DOMAIN,
    OP_TYPE,
    Nodes,
    core_copy,
    fused_parts,
    loop,
    tile_plan,
    tile_rows,
)
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.value_types import ValueType


@register(OP_TYPE, domain=DOMAIN)
def tiled_attention_grad(b, node, grads, needs):
    (d_out,) = grads
    q, kt, v, *masks = node.inputs
    if any(needs[3:]):
        raise NotImplementedError(
            f"{OP_TYPE} node {node.name!r}: a mask of the attention needs a gradient"
        )
    body, budget, min_rows = fused_parts(node)
    nodes = Nodes(b.names, b.node_names, b.prefix)
    plan = tile_plan(nodes, q, kt, budget, min_rows)
    wanted = [x for x, need in zip((q, kt, v), needs[:3]) if need]
    inits = [_initial_gradient(nodes, x, b.dtype(x)) for x in wanted]
    formal = [i.name for i in body.input]

    def fill(inner: Nodes, iteration: str, states: list[str]) -> list[str]:
        tile = tile_rows(inner, iteration, plan.rows)
        q_rows = _declared_rows(b, tile.rows_of(inner, q), q)
        d_rows = _declared_rows(b, tile.rows_of(inner, d_out), node.outputs[0])
        renames = {formal[0]: q_rows, formal[1]: kt, formal[2]: v}
        for name, mask in zip(formal[3:], masks):
            rows = tile.rows_of_mask(inner, mask, b.value_type(mask) if b.has_type(mask) else None)
            renames[name] = _declared_rows(b, rows, mask) if rows != mask else mask
        copies, out = core_copy(inner, body, renames)
        tile_graph = helper.make_graph(copies, f"{node.name}_tile", [], [])
        sources = [q_rows if x == q else x for x in wanted]
        backward, gradients = b.differentiate_subgraph(tile_graph, sources, {out: d_rows})
        inner.nodes.extend(copies)
        inner.nodes.extend(backward)
        return [
            _accumulate(inner, tile, state, gradients[source], x == q)
            for state, source, x in zip(states, sources, wanted)
        ]

    types = [b.value_type(x) for x in wanted]
    finals = loop(nodes, plan.trips, inits, fill, types, f"{b.prefix}Loop")
    b.emit_nodes(nodes.nodes)
    result = dict(zip(wanted, finals))
    return [result.get(q), result.get(kt), result.get(v)] + [None] * len(masks)


def _initial_gradient(nodes: Nodes, x: str, elem_type: int) -> str:
    zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(elem_type)))
    return nodes.op("ConstantOfShape", nodes.op("Shape", x), value=zero)


def _accumulate(nodes: Nodes, tile, state: str, gradient: str | None, is_query: bool) -> str:
    """``dQ`` takes the tile's rows, ``dKt`` and ``dV`` sum the tiles' contributions."""
    if gradient is None:  # no contribution (the state passes through the body)
        return nodes.op("Identity", state)
    if is_query:
        return tile.written(nodes, state, gradient)
    return nodes.op("Add", state, gradient)


def _declared_rows(b, rows: str, like: str) -> str:
    """Record the type of a tile of ``like``: the same, with an unknown number of rows."""
    value = b.value_type(like)
    shape = None if value.shape is None else (*value.shape[:-2], None, value.shape[-1])
    b.declare(rows, ValueType(value.elem_type, shape))
    return rows
