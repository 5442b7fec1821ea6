"""Element types and shapes of the values of a graph, for the gradient rules.

ONNX shape inference (on a weightless view of the model) gives most of them; two
refinements help the rules build static graphs: the batch symbol is kept through
``Reshape(x, [-1, ...])``, and subgraphs (If branches) are typed as standalone graphs
whose inputs are the outer values they read. One correction keeps them true on every
runtime: a Resize axis whose size from ``scales`` depends on the runtime's precision is left
unknown (:func:`_runtime_sized_resizes`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import numpy as np
from onnx import GraphProto, ModelProto, TensorProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._bounded_inference import infer_shapes_bounded
from onnxgrad._onnx_utils import (
    MAX_IR_VERSION,
    NameScope,
    all_names,
    normalize_domain,
    weightless_view,
)
from onnxgrad.graph._scopes import free_names, node_inputs


@dataclass(frozen=True)
class ValueType:
    """Element type and shape: ints, symbolic names (equal names, equal sizes), ``None`` for
    unknown dims; ``shape=None`` when even the rank is unknown."""

    elem_type: int
    shape: tuple[int | str | None, ...] | None


class InferredTypes(dict):
    """Value types by name; :attr:`failure` says why onnx's inference gave up, if it did."""

    failure: str | None = None


class UnknownTypeError(KeyError, ValueError):
    """A value the gradient rules need the type of, which shape inference could not type
    (a ``ValueError`` for callers, a ``KeyError`` for rules that can do without)."""

    def __init__(self, name: str, types: Mapping[str, ValueType]):
        failure = inference_failure(types)
        cause = (
            f"onnx's shape inference rejects the model: {failure}"
            if failure
            else "shape inference could not type it"
        )
        super().__init__(f"the type of {name!r} is unknown to the gradient builder: {cause}")

    def __str__(self) -> str:
        return str(self.args[0])


def inference_failure(types: Mapping[str, ValueType]) -> str | None:
    """The failure recorded in ``types`` (an :class:`InferredTypes`, or a ChainMap over
    one)."""
    for layer in [types, *getattr(types, "maps", ())]:
        if getattr(layer, "failure", None):
            return layer.failure
    return None


def infer_value_types(
    model: ModelProto, inferred: ModelProto | None = None
) -> dict[str, ValueType]:
    """Element type and shape of every value the shape inference can type.

    Shapes refined by :func:`_refine_reshapes` are fed back as hints for a second pass, so
    the symbols they recover propagate downstream. ``inferred``: onnx's inference of
    ``model``'s weightless view as it stands, with and without data propagation (the
    normalisation's, :attr:`~onnxgrad.normalize.facts.Facts.inferred`), read instead of
    inferring again.
    """
    types = _inferred_types(model, inferred)
    refined = _refine_reshapes(model.graph, types, constant_tensors(model.graph, ()))
    if not refined:
        return types
    hinted = weightless_view(model)
    known = {info.name: info for info in hinted.graph.value_info}
    for name, value in refined.items():
        info = known.get(name) or hinted.graph.value_info.add()
        info.CopyFrom(helper.make_tensor_value_info(name, value.elem_type, list(value.shape)))
    types = _inferred_types(hinted)
    types.update(refined)
    return types


def _inferred_types(model: ModelProto, inferred: ModelProto | None = None) -> dict[str, ValueType]:
    """The types shape inference gives (``inferred``'s, where given), less the Resize sizes
    that depend on the runtime (:func:`_runtime_sized_resizes`) and what follows from them.
    Each round infers again with the Resize outputs found so far declared as computed from
    their input's new type, until they no longer change (a chain of such Resizes takes a
    round per link)."""
    view = None if inferred is not None else weightless_view(model)
    types = _read_types(inferred.graph) if inferred is not None else _shape_inferred(view)
    loose: dict[str, ValueType] = {}
    for _ in range(sum(node.op_type == "Resize" for node in model.graph.node)):
        found = _runtime_sized_resizes(model.graph, types)
        if found == loose:
            break
        loose = found
        view = weightless_view(model) if view is None else view
        unpinned, added = _unpinned(view, loose)
        types = _shape_inferred(unpinned)
        for name in added:
            types.pop(name, None)
    return types


def _shape_inferred(view: ModelProto) -> dict[str, ValueType]:
    try:
        inferred = infer_shapes_bounded(view)
    except Exception as exc:  # inference is best effort: rules fall back to dynamic shapes
        types = _read_types(view.graph)
        types.failure = " ".join(str(exc).split())[:500]
        return types
    return _read_types(inferred.graph)


def _read_types(graph: GraphProto) -> InferredTypes:
    """The value types an inferred weightless view's ``graph`` declares."""
    types = InferredTypes()
    read: dict[bytes, ValueType | None] = {}  # values share few types: each read once
    for info in [*graph.input, *graph.value_info, *graph.output]:
        key = info.type.SerializeToString()
        if key not in read:
            tensor = info.type.HasField("tensor_type") and info.type.tensor_type.elem_type
            read[key] = _value_type(info) if tensor else None
        if read[key] is not None:
            types[info.name] = read[key]
    for init in graph.initializer:
        types[init.name] = ValueType(init.data_type, tuple(init.dims))
    return types


def _refine_reshapes(
    graph: GraphProto, types: dict[str, ValueType], constants: dict
) -> dict[str, ValueType]:
    """Keep the batch symbol through ``Reshape(x, [-1, ...])``, which shape inference loses.

    When ``x`` has one symbolic dim ``S`` and the static dims of ``x`` and of the target
    shape have equal products, the ``-1`` is ``S`` (``[N, 1] -> [-1, 1]`` stays ``[N, 1]``).
    Returns the refined types.
    """
    refined = {}
    for node in graph.node:
        if node.op_type != "Reshape" or normalize_domain(node.domain):
            continue
        source, target = types.get(node.input[0]), constants.get(node.input[1])
        result = types.get(node.output[0])
        if source is None or source.shape is None or target is None or result is None:
            continue
        symbols = [d for d in source.shape if not isinstance(d, int)]
        requested = [int(v) for v in numpy_helper.to_array(target).ravel()]
        if len(symbols) != 1 or not isinstance(symbols[0], str) or requested.count(-1) != 1:
            continue
        if 0 in requested:
            continue
        known_in = int(np.prod([d for d in source.shape if isinstance(d, int)]))
        known_out = int(np.prod([v for v in requested if v != -1]))
        if known_in == known_out:
            shape = tuple(symbols[0] if v == -1 else v for v in requested)
            if shape != result.shape:
                refined[node.output[0]] = ValueType(result.elem_type, shape)
    return refined


def _runtime_sized_resizes(graph: GraphProto, types: dict[str, ValueType]) -> dict[str, ValueType]:
    """The outputs of the Resize nodes with constant ``scales`` that some axis sizes
    differently on onnxruntime and for onnx (:func:`_scaled_size`), typed from their input's
    type with those axes unknown: the rules then read such sizes at run time."""
    constants = constant_tensors(graph, ())
    loose = {}
    for node in graph.node:
        if node.op_type != "Resize" or normalize_domain(node.domain) or len(node.input) < 3:
            continue
        source, scales = types.get(node.input[0]), constants.get(node.input[2])
        if (len(node.input) > 3 and node.input[3]) or scales is None or source is None:
            continue  # sized by ``sizes``, or not by constant scales
        scales = numpy_helper.to_array(scales).astype(np.float32).ravel()
        axes = _listed_axes(node, source.shape)
        if axes is None or len(axes) != scales.size:
            continue
        shape = list(source.shape)
        for axis, scale in zip(axes, scales):
            shape[axis] = _scaled_size(shape[axis], scale)
        if any(d is None and isinstance(n, int) for d, n in zip(shape, source.shape)):
            loose[node.output[0]] = ValueType(source.elem_type, tuple(shape))
    return loose


def _listed_axes(node, shape) -> list[int] | None:
    """The axes ``scales`` lists (the ``axes`` attribute, from opset 18), else every axis;
    None when the rank is unknown."""
    if shape is None:
        return None
    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    return list(range(len(shape))) if axes is None else [a % len(shape) for a in axes]


def _scaled_size(n: int | str | None, scale: np.float32) -> int | str | None:
    """``floor(n s)`` where onnxruntime's float32 product (``10 * 0.7f = 7.0000001 -> 7``)
    and the float64 one of onnx's inference and reference evaluator (``6.99999988 -> 6``)
    agree; ``n`` itself for ``s = 1``; None otherwise."""
    if scale == 1:
        return n
    if not isinstance(n, int):
        return None
    in_float32 = int(np.floor(np.float32(n) * scale))
    in_float64 = int(np.floor(n * np.float64(scale)))
    return in_float32 if in_float32 == in_float64 else None


def _unpinned(view: ModelProto, loose: dict[str, ValueType]) -> tuple[ModelProto, list[str]]:
    """A copy of ``view`` in which the Resize nodes of ``loose`` read their scales from new
    graph inputs (also returned: inference cannot size those nodes) and their outputs are
    declared with ``loose``; the declared shapes of every value downstream (value_info and
    graph outputs, as a model saved after shape inference holds them) are dropped, to be
    inferred again."""
    unpinned = ModelProto()
    unpinned.CopyFrom(view)
    graph = unpinned.graph
    downstream, added = set(loose), []
    scope = NameScope(all_names(graph))
    for node in graph.node:
        if node.op_type == "Resize" and node.output[0] in loose:
            node.input[2] = scope.unique(f"{node.input[2]}_at_run_time")
            graph.input.append(
                helper.make_tensor_value_info(node.input[2], TensorProto.FLOAT, [None])
            )
            added.append(node.input[2])
        elif node_inputs(node) & downstream:
            downstream.update(node.output)
    declared = {name: value_info(name, value) for name, value in loose.items()}
    kept = [i for i in graph.value_info if i.name not in downstream]
    del graph.value_info[:]
    graph.value_info.extend(kept + list(declared.values()))
    for output in graph.output:
        if output.name in declared:
            output.type.CopyFrom(declared[output.name].type)
        elif output.name in downstream:
            output.type.tensor_type.ClearField("shape")
    return unpinned, added


def constant_tensors(graph: GraphProto, weights: Sequence[str]) -> dict[str, TensorProto]:
    """Values rules may read: initializers that are not differentiated, Constant outputs."""
    excluded = set(weights) | {i.name for i in graph.input}
    tensors = {i.name: i for i in graph.initializer if i.name not in excluded}
    for node in graph.node:
        if node.op_type == "Constant" and not normalize_domain(node.domain):
            tensor = _constant_node_tensor(node)
            if tensor is not None:
                tensors[node.output[0]] = tensor
    return tensors


def _constant_node_tensor(node) -> TensorProto | None:
    attr = node.attribute[0] if len(node.attribute) == 1 else None
    if attr is None or attr.name in ("sparse_value", "value_string", "value_strings"):
        return None
    if attr.name == "value":
        return attr.t
    value = helper.get_attribute_value(attr)
    dtype = np.float32 if attr.name.startswith("value_float") else np.int64
    return numpy_helper.from_array(np.asarray(value, dtype=dtype))


def _value_type(info: ValueInfoProto) -> ValueType:
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return ValueType(tensor.elem_type, None)
    return ValueType(tensor.elem_type, tuple(_dim(d) for d in tensor.shape.dim))


def _dim(dim) -> int | str | None:
    if dim.HasField("dim_value"):
        return dim.dim_value
    return dim.dim_param or None


def infer_subgraph_types(
    graph: GraphProto,
    types: MutableMapping[str, ValueType],
    opset: int,
    constants: Mapping[str, TensorProto] | None = None,
) -> None:
    """Add to ``types`` the values of ``graph``, a subgraph reading outer values (the
    subgraph's own layer of types: a sibling subgraph may use the same names).

    Outer values with a known value (``constants``: Constant outputs, initializers) are
    given to the inference as initializers, so that axes, shapes and pads read from the
    outer scope (as function bodies do) still give static ranks and shapes inside.
    """
    constants = constants or {}
    outer = [n for n in sorted(free_names(graph)) if n in types or n in constants]
    standalone = GraphProto()
    standalone.CopyFrom(graph)
    del standalone.input[:]
    standalone.input.extend([value_info(n, types[n]) for n in outer if n not in constants])
    standalone.input.extend(graph.input)
    for name in outer:
        if name in constants:
            tensor = standalone.initializer.add()
            tensor.CopyFrom(constants[name])
            tensor.name = name
    model = helper.make_model(
        standalone,
        opset_imports=[helper.make_opsetid("", opset)],
        ir_version=MAX_IR_VERSION,
    )
    for name, value in _inferred_types(model).items():
        types.setdefault(name, value)


def value_info(name: str, value: ValueType) -> ValueInfoProto:
    """A tensor ValueInfoProto with ``value``'s type (unknown dims left unnamed)."""
    dims = None if value.shape is None else [d if d is not None else "" for d in value.shape]
    return helper.make_tensor_value_info(name, value.elem_type, dims)
