"""Element types and shapes of the values of a graph, for the gradient rules.

ONNX shape inference (on a weightless view of the model) gives most of them; two
refinements help the rules build static graphs: the batch symbol is kept through
``Reshape(x, [-1, ...])``, and subgraphs (If branches) are typed as standalone graphs
whose inputs are the outer values they read.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, TensorProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._model_checks import weightless_view
from onnxgrad._onnx_utils import MAX_IR_VERSION, normalize_domain
from onnxgrad.graph._scopes import free_names


@dataclass(frozen=True)
class ValueType:
    """Element type and shape: ints, symbolic names (equal names, equal sizes), ``None`` for
    unknown dims; ``shape=None`` when even the rank is unknown."""

    elem_type: int
    shape: tuple[int | str | None, ...] | None


def infer_value_types(model: ModelProto) -> dict[str, ValueType]:
    """Element type and shape of every value the shape inference can type.

    Shapes refined by :func:`_refine_reshapes` are fed back as hints for a second pass, so
    the symbols they recover propagate downstream.
    """
    types = _inferred_types(model)
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


def _inferred_types(model: ModelProto) -> dict[str, ValueType]:
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_view(model), data_prop=True)
    except Exception:  # inference is best effort: rules fall back to dynamic shapes
        inferred = model
    graph = inferred.graph
    types: dict[str, ValueType] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types[info.name] = _value_type(info)
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
