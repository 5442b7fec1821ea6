r"""Many seeds in one run: a leading seed axis on the tangents or cotangents.

A JVP graph ``t -> J t`` (or a VJP graph ``g -> J^T g``, an HVP graph ``v -> H v``) is linear
in its seeds. Given ``k`` seeds stacked along a new leading axis, the graph computes
``[J t_1, ..., J t_k]`` in one run: the nodes reading no seed (the forward values, the
Jacobian's factors) run once; the others, the part linear in the seed, carry the seed axis
(:mod:`onnxgrad.derivative.seed_axis`: a table of rules, vectorised as a batch axis, and a
``Scan`` over the seed axis for a node without one).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorShapeProto, TypeProto, numpy_helper

from onnxgrad._onnx_utils import (
    WEIGHTLESS_THRESHOLD,
    NameScope,
    all_names,
    check_declared_shapes,
    check_strictly,
    default_opset,
    finalize_model,
    model_bytes,
    replace_repeated,
    subgraphs,
    tensor_nbytes,
    value_info_bytes,
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

    Each node is checked once, by onnx's checker and strict shape inference with type
    checks: the one-seed graph whole (the rules read its types; the nodes reading no seed
    stay as they are), then the seeded nodes alone (:func:`_check_seeded`), every value
    they write declared with its one-seed type, ``seeds`` in front where it carries the
    seed axis: a rule writing an ill-typed node is refused here, not by onnxruntime."""
    graph = model.graph
    split = _split_nodes(graph, set(seed_inputs))
    linear, rest, names = split.linear, split.rest, split.names
    scope = NameScope(names)
    known = _inferred(model, split.touched)
    constants = _int_constants(graph, split.touched, split.constants)
    axis = SeedAxis(seeds, scope, known.shapes, constants, known.elem_types, default_opset(model))
    axis.batched.update(seed_inputs)
    for node in linear:
        axis.rewrite(node)
    axis.flush()
    nodes = [*rest, *axis.nodes]
    computed_once = [r for r in results if r not in axis.batched]
    spread, once = _spread_results(axis, nodes, computed_once, known)
    nodes += spread
    seeded = nodes[len(rest) :]
    rewritten = [o for node in linear for o in node.output[:] if o]
    defined = names.difference(rewritten, once).union(once.values())
    local = _seeded_model(
        model, seeded, split.constants, axis, known, [*rewritten, *results], defined
    )
    replace_repeated(graph.node, nodes)
    graph.initializer.extend(axis.initializers)
    _name_nodes(graph, scope)
    batched = axis.batched | set(results)
    replace_repeated(graph.value_info, [v for v in graph.value_info if v.name not in batched])
    for info in [*graph.input, *graph.output]:
        if info.name in batched:
            _prepend_axis(info.type, seeds)
    if local.unknown:  # onnx's checker of the whole batched graph names them
        return finalize_model(model)
    _check_seeded(local)
    return finalize_model(model, check=False)


def _spread_results(
    axis: SeedAxis, nodes: list, results: list[str], known: _Known
) -> tuple[list, dict[str, str]]:
    """Nodes repeating, for every seed, the ``results`` computed once, and the new names of
    those (renamed in ``nodes`` to make room, their types in ``known`` too)."""
    if not results:
        return [], {}
    once = {r: axis.scope.unique(f"{r}_once") for r in results}
    for result, computed in once.items():
        if result in known.types:
            known.types[computed] = known.types[result]
    scratch = GraphProto()
    scratch.node.extend(nodes)
    rename_values(scratch, once)
    replace_repeated(nodes, list(scratch.node))
    axis.nodes = []
    for result, computed in once.items():
        axis.op("Identity", axis.spread(computed), out=result)
    return axis.nodes, once


@dataclass
class _Known:
    """What onnx's strict inference of the one-seed graph says of the values the seeded
    nodes read or write: per-seed dimensions (``None`` where unknown) of those of known
    rank, element types, and the inferred types themselves (serialised)."""

    shapes: dict[str, list] = field(default_factory=dict)
    elem_types: dict[str, int] = field(default_factory=dict)
    types: dict[str, bytes] = field(default_factory=dict)


def _inferred(model: ModelProto, wanted: set[str]) -> _Known:
    """The types of the values ``wanted`` by onnx's strict shape inference with type checks
    of the whole graph, after onnx's checker (``InferenceError``, ``ValidationError`` where
    the graph is invalid)."""
    check_declared_shapes(model.graph)
    view = weightless_bytes(model)
    onnx.checker.check_model(view)
    inferred = onnx.shape_inference.infer_shapes(view, check_type=True, strict_mode=True).graph
    known = _Known()
    types, elem_types, shapes = known.types, known.elem_types, known.shapes
    read: dict[bytes, tuple | None] = {}  # values share few types: each read once
    for infos in (inferred.input, inferred.output, inferred.value_info):
        for info in infos:
            name = info.name
            if name in wanted:
                value_type = info.type  # protobuf wraps a field anew at each read
                key = value_type.SerializeToString()
                found = read.get(key, False)
                if found is False:
                    found = read[key] = _elem_and_dims(value_type)
                if found is not None:
                    types[name] = key
                    elem_types[name], dims = found
                    if dims is not None:
                        shapes[name] = list(dims)
    for init in inferred.initializer:
        elem_types[init.name] = init.data_type
        shapes[init.name] = list(init.dims)
    return known


@dataclass
class _Local:
    """The seeded nodes as a model of their own (:func:`_seeded_model`): a shell (its
    opsets, its constants), the nodes, and its inputs and value infos serialised."""

    shell: ModelProto
    nodes: list
    #: the graph's inputs and value infos, serialised (:func:`value_info_bytes`)
    infos: bytes
    #: the same with a shape on every input (:func:`_with_ranks`); ``None``: as ``infos``
    ranked_infos: bytes | None
    #: values read that the one-seed graph's inference did not type, or that the batched
    #: graph does not define
    unknown: list[str]


def _seeded_model(
    model: ModelProto,
    seeded: list,
    constant_nodes: dict[str, NodeProto],
    axis: SeedAxis,
    known: _Known,
    declared: list[str],
    defined: set[str],
) -> _Local:
    """The ``seeded`` nodes as a model of their own, for onnx to check: the values they
    read from the rest of ``model`` (``defined`` there) are its inputs, typed as the
    one-seed graph's inference typed them (``seeds`` in front for the seed inputs), or its
    initializers and ``Constant`` nodes where they are small constants (their values shape
    what they reach); every value of ``declared`` has its one-seed type, ``seeds`` in front
    where it carries the seed axis."""
    made = {o for node in seeded for o in node.output[:]}
    made.update(t.name for t in axis.initializers)
    reads: dict[str, None] = {}
    for node in seeded:
        for name in node_inputs(node) if node.attribute else node.input[:]:
            if name and name not in made:
                reads[name] = None
    shell = ModelProto(ir_version=model.ir_version)
    shell.opset_import.extend(model.opset_import)
    graph = shell.graph
    graph.name = "seeded"
    small = [
        t
        for t in model.graph.initializer
        if t.name in reads and tensor_nbytes(t) <= WEIGHTLESS_THRESHOLD
    ]
    graph.initializer.extend([*small, *axis.initializers])
    constants = [node for name, node in constant_nodes.items() if name in reads]
    given = {t.name for t in small} | {n.output[0] for n in constants}
    typed = _TypeCache(axis)
    inputs, ranked, unknown = [], [], []
    for name in reads:
        if name in given:
            continue
        found = typed.types(name, known.types.get(name)) if name in defined else None
        if found is None:
            unknown.append(name)
            continue
        inputs.append(value_info_bytes("input", name, found[0]))
        ranked.append(value_info_bytes("input", name, found[1]) if found[1] else inputs[-1])
    infos = []
    for name in declared:
        found = typed.types(name, known.types.get(name))
        if found is not None:
            infos.append(value_info_bytes("value_info", name, found[0]))
    ranked_infos = b"".join([*ranked, *infos]) if ranked != inputs else None
    return _Local(shell, [*constants, *seeded], b"".join([*inputs, *infos]), ranked_infos, unknown)


class _TypeCache:
    """Serialised value types from serialised one-seed types, ``seeds`` in front for the
    batched values, each distinct type worked out once."""

    def __init__(self, axis: SeedAxis):
        self.axis = axis
        self.made: dict[tuple[bytes, bool], tuple[bytes, bytes | None]] = {}

    def types(self, name: str, key: bytes | None) -> tuple[bytes, bytes | None] | None:
        """``(the type of name, the same with a shape where it has no rank, else None)``,
        serialised; ``None`` where its one-seed type (``key``) is unknown."""
        if key is None:
            return None
        batched = name in self.axis.batched
        found = self.made.get((key, batched))
        if found is None:
            value_type = TypeProto.FromString(key)
            made = key  # the one-seed type serialised: its bytes as they are
            if batched:
                _prepend_axis(value_type, self.axis.seeds)
                made = value_type.SerializeToString()
            found = self.made[key, batched] = made, _ranked(value_type)
        return found


def _ranked(value_type: TypeProto) -> bytes | None:
    """For onnx's checker, which wants a shape on every graph input: ``value_type`` given
    one (no dimension) where it is a tensor of unknown rank, serialised; else ``None`` (the
    checker reads no rank; inference keeps the rank unknown)."""
    if not value_type.HasField("tensor_type") or value_type.tensor_type.HasField("shape"):
        return None
    ranked = TypeProto()
    ranked.CopyFrom(value_type)
    ranked.tensor_type.shape.SetInParent()
    return ranked.SerializeToString()


def _check_seeded(local: _Local) -> None:
    """onnx's checker and strict inference with type checks of the seeded nodes alone:
    ``ValueError`` naming the node onnx refuses (one whose result contradicts its declared
    type, or whose attributes or inputs its schema refuses)."""
    view = model_bytes(local.shell, local.nodes, local.infos)
    try:
        if local.ranked_infos is None:
            check_strictly(view, len(local.nodes))
        else:
            onnx.checker.check_model(model_bytes(local.shell, local.nodes, local.ranked_infos))
            onnx.shape_inference.infer_shapes(view, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        message = " ".join(str(exc).split())[:1000]
        raise ValueError(
            f"a seed-axis rule wrote an invalid node: onnx refuses the seeded nodes "
            f"({message}); the batched graph would contradict the one-seed graph's types"
        ) from exc


def _elem_and_dims(value_type) -> tuple[int, tuple | None] | None:
    """``(element type, dims or None)`` of a tensor type (``None`` for an unknown dim),
    ``None`` for another type."""
    if not value_type.HasField("tensor_type"):
        return None
    tensor = value_type.tensor_type
    if not tensor.HasField("shape"):
        return tensor.elem_type, None
    dims = tuple([d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim])
    return tensor.elem_type, dims


def _int_constants(
    graph: GraphProto, wanted: set[str], constants: dict[str, NodeProto]
) -> dict[str, np.ndarray]:
    """The values of the small integer initializers and ``Constant`` nodes (``constants``)
    named in ``wanted``."""
    found = {}
    tensors = [(t.name, t) for t in graph.initializer if t.name in wanted]
    for name, node in constants.items():
        if name not in wanted:
            continue
        attr = node.attribute[0]
        if attr.name == "value":
            tensors.append((name, attr.t))
        elif attr.name in ("value_int", "value_ints"):
            found[name] = np.array(attr.i if attr.name == "value_int" else attr.ints)
    for name, tensor in tensors:  # the type first: most are float weights
        if tensor.data_type in _INTEGERS and math.prod(tensor.dims) <= 64:
            found[name] = numpy_helper.to_array(tensor)
    return found


_INTEGERS = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


def _name_nodes(graph: GraphProto, scope: NameScope) -> None:
    """A unique name for every unnamed node, in subgraphs too: onnxruntime names the nodes
    its fusions make after the nodes they replace, and refuses two equal names."""
    for node in graph.node:
        if not node.name:
            node.name = scope.unique(f"{node.op_type}_seeded")
        if node.attribute:  # most nodes have none, and no subgraph
            for sub in subgraphs(node):
                _name_nodes(sub, scope)


@dataclass
class _Split:
    """The nodes of a graph split by whether they read a seed, directly or not."""

    #: the nodes reading a seed, in graph order
    linear: list
    #: the others, in graph order
    rest: list
    #: the values the linear nodes read or write
    touched: set[str]
    #: every value name the graph and its subgraphs define
    names: set[str]
    #: the ``Constant`` nodes of the rest by their output
    constants: dict[str, NodeProto]


def _split_nodes(graph: GraphProto, seeds: set[str]) -> _Split:
    """:class:`_Split` of ``graph``: one pass over its nodes."""
    reached = set(seeds)
    split = _Split([], [], set(), set(), {})
    linear, rest, touched, names = split.linear, split.rest, split.touched, split.names
    names.update(v.name for v in [*graph.input, *graph.initializer, *graph.output])
    names.update(t.values.name for t in graph.sparse_initializer)
    for node in graph.node:
        # a slice reads the strings at once: the names are read once a node
        inner = subgraphs(node) if node.attribute else None  # most nodes have no subgraph
        reads = node_inputs(node) if inner else node.input[:]
        writes = node.output[:]
        names.update(writes)
        if inner:
            for sub in inner:
                names |= all_names(sub)
        if reached.isdisjoint(reads):
            rest.append(node)
            if inner is not None and node.op_type == "Constant" and not node.domain:
                split.constants[writes[0]] = node
        else:
            linear.append(node)
            reached.update(writes)
            touched.update(reads)
    names.discard("")
    touched |= reached
    return split


def _prepend_axis(value_type: TypeProto, seeds: int) -> None:
    """A leading dimension ``seeds`` on a tensor type of known rank, in place: its shape
    parsed back from the new dimension's bytes followed by its own (the dimensions are a
    repeated field, whose serialised items concatenate; no dimension copied one by one)."""
    tensor = value_type.tensor_type
    if tensor.HasField("shape"):
        shape = tensor.shape
        shape.ParseFromString(_seed_dim(seeds) + shape.SerializeToString())


@functools.cache  # one or two seed counts per process
def _seed_dim(seeds: int) -> bytes:
    """A ``TensorShapeProto`` of the one dimension ``seeds``, serialised."""
    shape = TensorShapeProto()
    shape.dim.add().dim_value = seeds
    return shape.SerializeToString()
