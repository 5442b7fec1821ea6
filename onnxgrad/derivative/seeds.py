r"""Many seeds in one run: a leading seed axis on the tangents or cotangents.

A JVP graph ``t -> J t`` (or a VJP graph ``g -> J^T g``, an HVP graph ``v -> H v``) is linear
in its seeds. Given ``k`` seeds stacked along a new leading axis, the graph computes
``[J t_1, ..., J t_k]`` in one run: the nodes reading no seed (the forward values, the
Jacobian's factors) run once; the others, the part linear in the seed, carry the seed axis
(:mod:`onnxgrad.derivative.seed_axis`: a table of rules, vectorised as a batch axis, and a
``Scan`` over the seed axis for a node without one).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, ValueInfoProto, numpy_helper

from onnxgrad._onnx_utils import (
    NameScope,
    all_names,
    default_opset,
    finalize_model,
    replace_repeated,
    subgraphs,
    weightless_bytes,
)
from onnxgrad.derivative.seed_axis import SeedAxis
from onnxgrad.graph._scopes import node_inputs
from onnxgrad.graph.names import rename_values


def check_seeds(seeds: int | None) -> int | None:
    """``seeds`` (a count of seeds, ``None`` for one unbatched seed), checked."""
    if seeds is None:
        return None
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be a positive integer or None, not {seeds!r}")
    return seeds


def batch_seeds(
    model: ModelProto, seed_inputs: Sequence[str], results: Sequence[str], seeds: int
) -> ModelProto:
    """``model`` (owned by the caller, rewritten in place, not checked yet) with a leading
    axis of ``seeds`` on the inputs ``seed_inputs`` and on the outputs ``results``, which
    must be linear in them; the other inputs and outputs keep their shapes.

    Checked once: onnx's strict shape inference with type checks on the one-seed graph
    (whose shapes the rules read), then onnx's checker on the batched one. No second
    inference: a batched value has its one-seed type with ``seeds`` in front, the others
    keep theirs, and each rule writes nodes valid for those types (the rule table's tests
    load and run them in onnxruntime)."""
    graph = model.graph
    linear, rest, touched, names = _split_nodes(graph, set(seed_inputs))
    scope = NameScope(names)
    shapes, types = _inferred(model, touched)
    constants = _int_constants(graph, touched)
    axis = SeedAxis(seeds, scope, shapes, constants, types, default_opset(model))
    axis.batched.update(seed_inputs)
    for node in linear:
        axis.rewrite(node)
    axis.flush()
    nodes = [*rest, *axis.nodes]
    nodes += _spread_results(axis, nodes, [r for r in results if r not in axis.batched])
    replace_repeated(graph.node, nodes)
    graph.initializer.extend(axis.initializers)
    _name_nodes(graph, scope)
    batched = axis.batched | set(results)
    replace_repeated(graph.value_info, [v for v in graph.value_info if v.name not in batched])
    for info in [*graph.input, *graph.output]:
        if info.name in batched:
            _prepend_axis(info, seeds)
    return finalize_model(model, infer=False)


def _spread_results(axis: SeedAxis, nodes: list, results: list[str]) -> list:
    """Nodes repeating, for every seed, the ``results`` computed once (renamed in ``nodes``
    to make room)."""
    if not results:
        return []
    once = {r: axis.scope.unique(f"{r}_once") for r in results}
    scratch = GraphProto()
    scratch.node.extend(nodes)
    rename_values(scratch, once)
    replace_repeated(nodes, list(scratch.node))
    axis.nodes = []
    for result, computed in once.items():
        axis.op("Identity", axis.spread(computed), out=result)
    return axis.nodes


def _inferred(model: ModelProto, wanted: set[str]) -> tuple[dict, dict]:
    """``({value: dims}, {value: element type})`` of the values ``wanted``, by onnx's strict
    shape inference with type checks of the whole graph (``InferenceError`` where it is
    inconsistent)."""
    view = weightless_bytes(model)
    inferred = onnx.shape_inference.infer_shapes(view, check_type=True, strict_mode=True).graph
    shapes, types = {}, {}
    read: dict[bytes, tuple | None] = {}  # values share few types: each read once
    for infos in (inferred.input, inferred.output, inferred.value_info):
        for info in infos:
            name = info.name
            if name not in wanted:
                continue
            value_type = info.type
            key = value_type.SerializeToString()
            found = read.get(key, False)
            if found is False:
                found = read[key] = _elem_and_dims(value_type)
            if found is not None:
                types[name], dims = found
                if dims is not None:
                    shapes[name] = list(dims)
    for init in inferred.initializer:
        types[init.name] = init.data_type
        shapes[init.name] = list(init.dims)
    return shapes, types


def _elem_and_dims(value_type) -> tuple[int, tuple | None] | None:
    """``(element type, dims or None)`` of a tensor type (``None`` for an unknown dim),
    ``None`` for another type."""
    if not value_type.HasField("tensor_type"):
        return None
    tensor = value_type.tensor_type
    if not tensor.HasField("shape"):
        return tensor.elem_type, None
    dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
    return tensor.elem_type, dims


def _int_constants(graph: GraphProto, wanted: set[str]) -> dict[str, np.ndarray]:
    """The values of the small integer initializers and ``Constant`` nodes named in
    ``wanted``."""
    found = {}
    tensors = [(t.name, t) for t in graph.initializer if t.name in wanted]
    for node in graph.node:
        constant = node.op_type == "Constant" and not node.domain and node.attribute
        if constant and node.output[0] in wanted:
            attr = node.attribute[0]
            if attr.name == "value":
                tensors.append((node.output[0], attr.t))
            elif attr.name in ("value_int", "value_ints"):
                found[node.output[0]] = np.array(attr.i if attr.name == "value_int" else attr.ints)
    for name, tensor in tensors:
        small = int(np.prod(tensor.dims)) <= 64
        if small and tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            found[name] = numpy_helper.to_array(tensor)
    return found


def _name_nodes(graph: GraphProto, scope: NameScope) -> None:
    """A unique name for every unnamed node, in subgraphs too: onnxruntime names the nodes
    its fusions make after the nodes they replace, and refuses two equal names."""
    for node in graph.node:
        if not node.name:
            node.name = scope.unique(f"{node.op_type}_seeded")
        if node.attribute:  # most nodes have none, and no subgraph
            for sub in subgraphs(node):
                _name_nodes(sub, scope)


def _split_nodes(graph: GraphProto, seeds: set[str]) -> tuple[list, list, set[str], set[str]]:
    """``(nodes reading a seed directly or not, the others, the values the first read or
    write, every value name of the graph and its subgraphs)``, nodes in graph order: one
    pass over the nodes for both."""
    reached = set(seeds)
    linear, rest, touched = [], [], set()
    names = {v.name for v in [*graph.input, *graph.initializer, *graph.output]}
    names.update(t.values.name for t in graph.sparse_initializer)
    for node in graph.node:
        reads, writes = node.input, node.output
        names.update(reads)
        names.update(writes)
        inner = subgraphs(node)  # most nodes have none: their reads are their inputs
        if inner:
            reads = node_inputs(node)
            for sub in inner:
                names |= all_names(sub)
        if reached.isdisjoint(reads):
            rest.append(node)
        else:
            linear.append(node)
            reached.update(writes)
            touched.update(reads)
    names.discard("")
    return linear, rest, touched | reached, names


def _renamed(info: ValueInfoProto, name: str) -> ValueInfoProto:
    copy = ValueInfoProto()
    copy.CopyFrom(info)
    copy.name = name
    return copy


def _prepend_axis(info: ValueInfoProto, seeds: int) -> None:
    tensor = info.type.tensor_type
    dims = list(tensor.shape.dim) if tensor.HasField("shape") else None
    if dims is None:
        return
    tensor.shape.ClearField("dim")
    tensor.shape.dim.add().dim_value = seeds
    for dim in dims:
        tensor.shape.dim.add().CopyFrom(dim)
