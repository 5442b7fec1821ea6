"""``backend="onnx"``: gradient graphs made of default-domain ONNX operators only.

The result keeps the forward nodes it needs, turns the differentiated weights into graph
inputs, seeds the output gradients (``<output>_grad`` inputs, ones, or 1 for the loss) and
appends the nodes emitted by :class:`~onnxgrad.derivative.autodiff.engine.Engine`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, TensorProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    NameScope,
    all_names,
    default_opset,
    finalize_model,
    make_model_like,
    np_dtype,
)
from onnxgrad.derivative._naming import free_gradient_names, kept_outputs
from onnxgrad.derivative.api import DerivativeRequest, graph_inputs
from onnxgrad.derivative.autodiff.builder import ValueType
from onnxgrad.derivative.autodiff.engine import Engine
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.graph.select import prune_graph


def native_derivative(request: DerivativeRequest) -> ModelProto:
    """Build the gradient model described in :mod:`onnxgrad.derivative.api`."""
    model = request.model
    opset = default_opset(model)
    sources = [*request.inputs, *request.weights]
    renames = free_gradient_names(model.graph, request)
    original_names = {new: old for old, new in renames.items()}
    types = infer_value_types(model)
    graph = model.graph
    scope = NameScope(all_names(graph) | {node.name for node in graph.node})
    for name in (f"{x}_grad" for x in sources):
        scope.reserve(name)

    engine = Engine(graph, types, opset, scope, constant_tensors(graph, request.weights))
    seed_inputs, seeds = _seed_output_gradients(engine, request, types, original_names)
    gradients = engine.gradients(sources, seeds)

    grad_outputs, tail_nodes = _gradient_outputs(engine, gradients, types)
    kept = kept_outputs(graph.output, request)
    weights = set(request.weights)
    new_graph = helper.make_graph(
        [],
        f"{graph.name}_grad" if graph.name else "gradient",
        _new_inputs(graph, request) + seed_inputs,
        grad_outputs + kept,
        [i for i in graph.initializer if i.name not in weights],
    )
    new_graph.node.extend(list(graph.node) + engine.emitted_nodes + tail_nodes)
    prune_graph(new_graph, keep_inputs=True)
    result = make_model_like(new_graph, model)
    check_default_domain_only(engine.emitted_nodes + tail_nodes)
    return finalize_model(result)


def infer_value_types(model: ModelProto) -> dict[str, ValueType]:
    """Element type and shape of every value the shape inference can type.

    Shapes refined by :func:`_refine_reshapes` are fed back as hints for a second pass, so
    the symbols they recover propagate downstream.
    """
    types = _inferred_types(model)
    refined = _refine_reshapes(model.graph, types, constant_tensors(model.graph, ()))
    if not refined:
        return types
    hinted = ModelProto()
    hinted.CopyFrom(model)
    known = {info.name: info for info in hinted.graph.value_info}
    for name, value in refined.items():
        info = known.get(name) or hinted.graph.value_info.add()
        info.CopyFrom(helper.make_tensor_value_info(name, value.elem_type, list(value.shape)))
    types = _inferred_types(hinted)
    types.update(refined)
    return types


def _inferred_types(model: ModelProto) -> dict[str, ValueType]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
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
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
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
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
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


def _seed_output_gradients(
    engine: Engine,
    request: DerivativeRequest,
    types: dict[str, ValueType],
    original_names: dict[str, str],
) -> tuple[list[ValueInfoProto], dict[str, str]]:
    """Graph inputs ``<output>_grad`` (``Zero``) or constant seeds (``FillGrad``, ``Loss``)."""
    outputs = list(request.model.graph.output)
    options = request.options
    if DerivativeOptions.Loss in options:
        loss = next(o for o in outputs if o.name == request.loss)
        return [], {loss.name: _ones_like(engine, loss.name, types)}
    if DerivativeOptions.FillGrad in options:
        return [], {o.name: _ones_like(engine, o.name, types) for o in outputs}
    seed_inputs, seeds = [], {}
    for output in outputs:
        name = f"{original_names.get(output.name, output.name)}_grad"
        if name in engine.emitter.scope:
            raise ValueError(f"cannot add the input {name!r}: the name is already used")
        engine.emitter.scope.reserve(name)
        info = ValueInfoProto()
        info.CopyFrom(output)
        info.name = name
        seed_inputs.append(info)
        seeds[output.name] = name
        if output.name in types:
            types[name] = types[output.name]
    return seed_inputs, seeds


def _ones_like(engine: Engine, name: str, types: dict[str, ValueType]) -> str:
    value = types.get(name)
    if value is None:
        raise ValueError(f"the element type of output {name!r} is unknown: cannot seed ones")
    one = numpy_helper.from_array(np.array([1], dtype=np_dtype(value.elem_type)))
    seed = engine.emitter.emit(
        "ConstantOfShape",
        engine.emitter.emit("Shape", [name], 1, f"{name}_seed/", {}),
        1,
        f"{name}_seed/",
        {"value": one},
    )[0]
    types[seed] = value
    return seed


def _gradient_outputs(
    engine: Engine, gradients: dict[str, str | None], types: dict[str, ValueType]
) -> tuple[list[ValueInfoProto], list]:
    """One ``<x>_grad`` output per source; structural zeros become zeros of x's shape."""
    outputs, nodes = [], []
    unique = engine.emitter.scope.unique
    for source, grad in gradients.items():
        name = f"{source}_grad"
        value = types[source]
        if grad is None:
            zero = numpy_helper.from_array(np.array([0], dtype=np_dtype(value.elem_type)))
            shape = unique(f"{name}_shape")
            nodes += [
                helper.make_node("Shape", [source], [shape], name=unique(f"{name}_Shape")),
                helper.make_node(
                    "ConstantOfShape", [shape], [name], name=unique(f"{name}_Zeros"), value=zero
                ),
            ]
        else:
            nodes.append(
                helper.make_node("Identity", [grad], [name], name=unique(f"{name}_Identity"))
            )
        dims = None if value.shape is None else [d if d is not None else "" for d in value.shape]
        outputs.append(helper.make_tensor_value_info(name, value.elem_type, dims))
    return outputs, nodes


def _new_inputs(graph: GraphProto, request: DerivativeRequest) -> list[ValueInfoProto]:
    """The model's inputs (minus initializers listed as inputs), then the weights."""
    inputs = {i.name: i for i in graph.input}
    result = [inputs[name] for name in graph_inputs(request.model)]
    initializers = {i.name: i for i in graph.initializer}
    for weight in request.weights:
        init = initializers[weight]
        result.append(helper.make_tensor_value_info(weight, init.data_type, list(init.dims)))
    return result


def check_default_domain_only(nodes: list) -> None:
    """Post-condition: every emitted gradient node belongs to the default ONNX domain."""
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in nodes if n.domain not in ("", "ai.onnx")})
    if foreign:
        raise AssertionError(f"the native engine emitted non-standard ops {foreign}")
