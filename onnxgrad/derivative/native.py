"""``backend="onnx"``: gradient graphs made of default-domain ONNX operators only.

The result keeps the forward nodes it needs, turns the differentiated weights into graph
inputs, seeds the output gradients (``<output>_grad`` inputs, ones, or 1 for the loss) and
appends the nodes emitted by :class:`~onnxgrad.derivative.autodiff.engine.Engine`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    MAX_IR_VERSION,
    MessageStore,
    NameScope,
    all_names,
    default_opset,
    finalize_model,
    normalize_domain,
    np_dtype,
    replace_repeated,
    zeros_like_nodes,
)
from onnxgrad.derivative._naming import free_gradient_names, kept_outputs
from onnxgrad.derivative.api import DerivativeRequest, graph_inputs
from onnxgrad.derivative.autodiff.attention_tiles import expand_tiled_attention, fuse_attention
from onnxgrad.derivative.autodiff.cleanup import clean_graph
from onnxgrad.derivative.autodiff.engine import Engine
from onnxgrad.derivative.autodiff.forward_rewrites import gathers_as_split, pool_before_relu
from onnxgrad.derivative.autodiff.value_types import (
    ValueType,
    constant_tensors,
    infer_value_types,
    value_info,
)
from onnxgrad.derivative.late_backward import delay_early_backward
from onnxgrad.derivative.leaf_order import readiest_leaves_last
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.derivative.recompute import (
    name_forward_nodes,
    recompute_in_backward,
    tiles_attention,
)
from onnxgrad.graph._builder import mark_structural_constants


def native_derivative(request: DerivativeRequest) -> ModelProto:
    """Build the gradient model described in :mod:`onnxgrad.derivative.api`."""
    model = _gradient_model(request)  # the engine and its tables are gone before the check
    try:
        return finalize_model(model, check=request.checked)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        message = " ".join(str(exc).split())[:1000]
        raise ValueError(
            f"the gradient graph fails onnx's check ({message}): do the model's declared "
            "types and shapes agree with what its graph computes?"
        ) from exc


def _gradient_model(request: DerivativeRequest) -> ModelProto:
    """The request's model rewritten in place into the gradient model, unchecked."""
    model = request.model
    opset = default_opset(model)
    sources = [*request.inputs, *request.weights]
    renames = free_gradient_names(model.graph, request)
    original_names = {new: old for old, new in renames.items()}
    pooled = pool_before_relu(model.graph)
    # the normalisation's inference stands while neither step above rewrote the graph
    inferred = request.facts.take_inferred() if request.facts is not None else None
    types = infer_value_types(model, None if renames or pooled else inferred)
    del inferred  # a view of the whole graph: not held through the engine
    graph = model.graph
    gathers_as_split(graph, types, opset)
    scope = NameScope(all_names(graph))
    for name in (f"{x}_grad" for x in sources):
        scope.reserve(name)
    if tiles_attention(request.recompute):
        fuse_attention(graph, types, sources, opset)

    engine = Engine.for_graph(
        graph,
        types,
        opset,
        scope,
        constant_tensors(graph, request.weights),
        opsets={normalize_domain(o.domain): o.version for o in model.opset_import},
        functions=model.functions,
    )
    seed_inputs, seeds = _seed_output_gradients(engine, request, types, original_names)
    gradients = engine.gradients(sources, seeds)
    if not request.structural_zeros and not engine.reaches_through_floats(sources, seeds):
        _check_some_gradient_flows(gradients)

    grad_outputs, tail_nodes = _gradient_outputs(engine, gradients, types)
    check_default_domain_only(engine.emitted_nodes + tail_nodes)
    expand_tiled_attention(graph, types, scope, engine.emitter.node_names)
    forward_names = (
        name_forward_nodes(graph, engine.emitter.node_names) if request.recompute else set()
    )
    new_nodes = engine.emitted_nodes + tail_nodes
    kept_types = types if request.recompute else None
    # the engine's tables, the names and types go before the clean-up (not the engine's nodes)
    del engine, gradients, tail_nodes, scope, types
    _rewrite_in_place(model, request, seed_inputs, grad_outputs, new_nodes, seeds)
    del new_nodes, grad_outputs, seed_inputs  # copied into the graph
    if request.recompute:
        _lighten_backward(model.graph, forward_names, kept_types, request.recompute, seeds)
    if request.order_leaves:
        readiest_leaves_last(model.graph)
    mark_structural_constants(model.graph)
    return model


def _lighten_backward(graph, forward_names, types, recompute, seeds) -> None:
    """Values recomputed in the backward (``recompute``), then backward work on forward
    values only delayed until the gradient reaches it."""
    recompute_in_backward(graph, forward_names, types, recompute)
    delay_early_backward(graph, forward_names, seeds.values())


def _rewrite_in_place(
    model: ModelProto,
    request: DerivativeRequest,
    seed_inputs: list[ValueInfoProto],
    grad_outputs: list[ValueInfoProto],
    new_nodes: list,
    seeds: dict[str, str],
) -> None:
    """Turn the request's private copy into the gradient model, so that no initializer is
    ever copied: the differentiated ones become inputs, the others stay where they are; the
    ``seeds`` (output -> its gradient's seed) stay distinct values; ``new_nodes`` (the
    gradient's nodes) are moved into the graph, the list emptied."""
    graph = model.graph
    replace_repeated(graph.input, _new_inputs(graph, request) + seed_inputs)
    replace_repeated(graph.output, grad_outputs + kept_outputs(graph.output, request))
    weights = set(request.weights)
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name in weights:
            del graph.initializer[index]
    graph.ClearField("value_info")
    graph.name = f"{graph.name}_grad" if graph.name else "gradient"
    graph.node.extend(new_nodes)  # copied once; emptied, the list frees the engine's copies
    new_nodes.clear()
    clean_graph(graph, apart=seeds.values())
    model.ir_version = min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)
    model.producer_name = model.producer_name or "onnxgrad"


class NoFloatPath(NotImplementedError):
    """No output depends on the ``sources`` through float values: the gradient is refused.
    Differentiating a gradient graph again (``onnx_hvp``), this says that the gradient is
    constant in the sources wherever it is differentiable: the Hessian is 0 there."""

    def __init__(self, sources: list[str]) -> None:
        super().__init__(
            f"the model is not differentiable with respect to {sources}: no output depends "
            "on them through a float path (only through indices or comparisons, such as "
            "TopK indices, ArgMax, Equal), every gradient would be 0"
        )
        self.sources = sources

    def __reduce__(self):  # pickled (a worker process) with its sources, not its message
        return type(self), (self.sources,)


def _check_some_gradient_flows(gradients: dict[str, str | None]) -> None:
    """A gradient graph of zeros only is refused where no output depends on a source
    through float values (a nearest-neighbour model reaches its outputs through TopK's
    indices): :class:`NoFloatPath`. One reaching them through piecewise-constant float
    operators (Hardmax, Floor, Sign...) has the derivative 0 wherever it has one, and gets
    it."""
    if gradients and all(g is None for g in gradients.values()):
        raise NoFloatPath(sorted(gradients))


def _seed_output_gradients(
    engine: Engine,
    request: DerivativeRequest,
    types: dict[str, ValueType],
    original_names: dict[str, str],
) -> tuple[list[ValueInfoProto], dict[str, str]]:
    """Graph inputs ``<output>_grad`` (``Zero``) or constant seeds (``FillGrad``, ``Loss``) for
    the outputs of ``request.outputs``; the others get no gradient."""
    outputs = list(request.model.graph.output)
    options = request.options
    if DerivativeOptions.Loss in options:
        loss = next(o for o in outputs if o.name == request.loss)
        return [], {loss.name: _ones_like(engine, loss.name, types)}
    outputs = [o for o in outputs if original_names.get(o.name, o.name) in request.outputs]
    if DerivativeOptions.FillGrad in options:
        return [], {o.name: _ones_like(engine, o.name, types) for o in outputs}
    seed_inputs, seeds = [], {}
    for output in outputs:
        name = f"{original_names.get(output.name, output.name)}_grad"
        if name in engine.emitter.scope:
            raise ValueError(f"cannot add the input {name!r}: the name is already used")
        engine.emitter.scope.reserve(name)
        seed_inputs.append(_seed_info(output, name, types.get(output.name)))
        seeds[output.name] = name
        if output.name in types:
            types[name] = types[output.name]
    return seed_inputs, seeds


def _seed_info(output: ValueInfoProto, name: str, value: ValueType | None) -> ValueInfoProto:
    """``output``'s declaration under ``name``, less the sizes it fixes where the inferred
    type does not (a Resize size that depends on the runtime, as 6 for ``10 * 0.7`` saved
    by onnx's inference where onnxruntime makes 7: see ``value_types``)."""
    info = ValueInfoProto()
    info.CopyFrom(output)
    info.name = name
    if value is None or value.shape is None or not info.type.tensor_type.HasField("shape"):
        return info
    for dim, inferred in zip(info.type.tensor_type.shape.dim, value.shape):
        if dim.HasField("dim_value") and not isinstance(inferred, int):
            dim.Clear()
    return info


def _ones_like(engine: Engine, name: str, types: dict[str, ValueType]) -> str:
    value = types.get(name)
    if value is None:
        raise ValueError(f"the element type of output {name!r} is unknown: cannot seed ones")
    dtype = np_dtype(value.elem_type)
    if value.shape is not None and all(isinstance(d, int) for d in value.shape):
        # a Constant of its own, not the emitter's shared one: a rule's ``1 - s`` read through
        # the seed would count as depending on it, and ``late_backward`` would not delay it
        ones = numpy_helper.from_array(np.ones(value.shape, dtype=dtype))
        seed = engine.emitter.emit("Constant", [], 1, f"{name}_seed/", {"value": ones})[0]
        types[seed] = value
        return seed
    one = numpy_helper.from_array(np.array([1], dtype=dtype))
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
    outputs, nodes, store = [], [], MessageStore()
    values, node_names = engine.emitter.scope, engine.emitter.node_names
    for source, grad in gradients.items():
        name = f"{source}_grad"
        value = types[source]
        if grad is None:
            nodes += zeros_like_nodes(source, name, value.elem_type, values, node_names)
        else:
            identity = node_names.unique(f"{name}_Identity")
            nodes.append(store.keep(helper.make_node("Identity", [grad], [name], name=identity)))
        outputs.append(store.keep(value_info(name, value)))
    return outputs, nodes


def _new_inputs(graph: GraphProto, request: DerivativeRequest) -> list[ValueInfoProto]:
    """The model's inputs (minus initializers listed as inputs), then the weights."""
    inputs = {i.name: i for i in graph.input}
    result = [inputs[name] for name in graph_inputs(request.model)]
    initializers = {i.name: i for i in graph.initializer}
    store = MessageStore()
    for weight in request.weights:
        init = initializers[weight]
        info = helper.make_tensor_value_info(weight, init.data_type, list(init.dims))
        result.append(store.keep(info))
    return result


def check_default_domain_only(nodes: list) -> None:
    """Post-condition: every emitted gradient node belongs to the default ONNX domain."""
    foreign = sorted({f"{n.domain}::{n.op_type}" for n in nodes if normalize_domain(n.domain)})
    if foreign:
        raise AssertionError(f"the native engine emitted non-standard ops {foreign}")
