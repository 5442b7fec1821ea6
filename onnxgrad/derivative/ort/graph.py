"""Graph surgery of ``backend="ort"``, before and after onnxruntime-training's builder.

``OrtModuleGraphBuilder`` returns the forward graph, then a ``YieldOp`` node whose inputs
are the model outputs ``y_k`` and whose outputs are their gradients ``g_k``, then the
backward nodes. :func:`assemble` replaces that placeholder with the seeds the options ask
for and gives the result the interface of :mod:`onnxgrad.derivative.api`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._onnx_utils import (
    MAX_IR_VERSION,
    MAX_OPSET,
    NameScope,
    all_names,
    copy_message,
    default_opset,
    normalize_domain,
    np_dtype,
    replace_repeated,
    zeros_like_nodes,
)
from onnxgrad.derivative._naming import free_gradient_names, kept_outputs, seeds_are_inputs
from onnxgrad.derivative.api import DerivativeRequest
from onnxgrad.derivative.options import DerivativeOptions
from onnxgrad.graph._scopes import iter_graphs, node_inputs
from onnxgrad.graph.names import rename_values
from onnxgrad.graph.select import prune_graph

MS_DOMAIN = "com.microsoft"
_GRAD_SUFFIX = re.compile(r"_grad(_\d+)?$")


@dataclass
class Forward:
    """The model handed to the builder and how its outputs relate to the user's model.

    :param model: the user's model without initializers among its inputs, with only the
        loss output under ``Loss``, no intermediate value named like a gradient, and every
        output computed by a node.
    :param outputs: the user's outputs (original names), aligned with ``model.graph.output``.
    """

    model: ModelProto
    outputs: list[ValueInfoProto] = field(default_factory=list)


@dataclass(frozen=True)
class BuiltGraph:
    """What the builder produced: its ``YieldOp`` graph and the gradient names it chose."""

    model: ModelProto | None
    gradients: dict[str, str]
    seeds: dict[str, str]


def prepare_forward(request: DerivativeRequest) -> Forward:
    """The model the builder differentiates; ``request.model`` is left untouched."""
    model = ModelProto()
    model.CopyFrom(request.model)
    opset = default_opset(model)
    if opset > MAX_OPSET:
        raise ValueError(
            f"onnxruntime-training 1.19.2 accepts opsets up to {MAX_OPSET}, the model has "
            f"opset {opset}: use backend='onnx'"
        )
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    replace_repeated(graph.input, [i for i in graph.input if i.name not in initializers])
    if DerivativeOptions.Loss in request.options:
        replace_repeated(graph.output, [o for o in graph.output if o.name == request.loss])
    outputs = [copy_message(o) for o in graph.output]
    _free_gradient_names(graph, request)
    _detach_outputs(graph)
    return Forward(model, outputs)


def _detach_outputs(graph: GraphProto) -> None:
    """Compute outputs that are inputs or initializers with an ``Identity`` node.

    onnxruntime-training's builder segfaults on an output that is also a differentiated
    input.
    """
    sources = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    scope = NameScope(all_names(graph))
    for output in graph.output:
        if output.name in sources:
            detached = scope.unique(f"{output.name}_output")
            graph.node.append(helper.make_node("Identity", [output.name], [detached]))
            output.name = detached


def _free_gradient_names(graph: GraphProto, request: DerivativeRequest) -> None:
    """Rename the intermediates the result's names, or the builder's own ``<value>_grad``
    names, could hit."""
    free_gradient_names(graph, request, also=_GRAD_SUFFIX.search)


def connected_sources(model: ModelProto, names: Sequence[str]) -> list[str]:
    """The ``names`` some output depends on through at least one node."""
    graph = model.graph
    needed = {o.name for o in graph.output}
    reached = set()
    for node in reversed(graph.node):
        if needed.intersection(node.output):
            inputs = node_inputs(node)
            needed |= inputs
            reached |= inputs
    return [name for name in names if name in reached]


def built_graph(model: ModelProto | None, info: dict | None) -> BuiltGraph:
    """Gradient names from the builder's GraphInfo (``model=None``: nothing was built)."""
    if model is None or info is None:
        return BuiltGraph(None, {}, {})
    gradients = dict(info["user_input_grad_names"])
    gradients.update(
        zip(info["initializer_names_to_train"], info["initializer_grad_names_to_train"])
    )
    skipped = set(info["output_grad_indices_non_differentiable"])
    outputs = [o for k, o in enumerate(info["user_output_names"]) if k not in skipped]
    return BuiltGraph(model, gradients, dict(zip(outputs, info["module_output_gradient_name"])))


def assemble(built: BuiltGraph, forward: Forward, request: DerivativeRequest) -> ModelProto:
    """The gradient model with the interface described in :mod:`onnxgrad.derivative.api`."""
    base = built.model if built.model is not None else forward.model
    graph = GraphProto()
    graph.CopyFrom(base.graph)
    graph.name = f"{forward.model.graph.name or 'model'}_grad"
    scope = NameScope(all_names(graph))
    keep_yield = DerivativeOptions.KeepYieldOp in request.options

    seed_inputs: list[ValueInfoProto] = []
    seed_nodes: list[NodeProto] = []
    chosen, seeds = set(request.outputs), dict(built.seeds)
    if seeds_are_inputs(request.options):
        seed_inputs = _seed_inputs(graph, forward, seeds, scope, chosen)
        seed_nodes = _constant_seeds(forward, seeds, scope, lambda name: 0.0)
    elif not keep_yield:
        seed_nodes = _constant_seeds(
            forward, seeds, scope, lambda name: 1.0 if name in chosen else 0.0
        )
    nodes = list(graph.node)
    position = next(
        (k for k, n in enumerate(nodes) if n.op_type == "YieldOp" and n.domain == MS_DOMAIN),
        len(nodes),
    )
    if not keep_yield and position < len(nodes):
        nodes[position : position + 1] = seed_nodes

    grad_outputs, zero_nodes = _gradient_outputs(graph, forward, built, request, scope)
    replace_repeated(graph.node, nodes + zero_nodes)
    replace_repeated(graph.input, _inputs(graph, forward, request) + seed_inputs)
    replace_repeated(graph.output, grad_outputs + kept_outputs(forward.outputs, request))
    weights = set(request.weights)
    replace_repeated(graph.initializer, [i for i in graph.initializer if i.name not in weights])
    prune_graph(graph, keep_inputs=True)
    return _model(graph, forward.model, base)


def _seed_inputs(
    graph: GraphProto,
    forward: Forward,
    seeds: dict[str, str],
    scope: NameScope,
    chosen: set[str],
) -> list[ValueInfoProto]:
    """One ``<output>_grad`` input per differentiated output (``Zero``), named after the
    user's output; the seeds of the other outputs leave ``seeds`` (they get zeros)."""
    inputs, renames = [], {}
    for current, original in zip(forward.model.graph.output, forward.outputs):
        if original.name not in chosen:
            continue
        name = f"{original.name}_grad"
        if current.name in seeds and seeds[current.name] != name:
            renames[seeds[current.name]] = name
        info = copy_message(original)
        info.name = name
        inputs.append(info)
        scope.reserve(name)
        seeds.pop(current.name, None)
    if renames:
        rename_values(graph, renames)
    return inputs


def _constant_seeds(
    forward: Forward, seeds: dict[str, str], scope: NameScope, value
) -> list[NodeProto]:
    """``g = ConstantOfShape(Shape(y), value(y))`` for each output ``y`` left in ``seeds``
    (1 for a differentiated output, 0 for another one)."""
    nodes = []
    originals = dict(zip((o.name for o in forward.model.graph.output), forward.outputs))
    for output in forward.model.graph.output:
        if output.name not in seeds:
            continue
        shape = scope.unique(f"{output.name}_shape")
        fill = value(originals[output.name].name)
        constant = np.full((1,), fill, dtype=np_dtype(output.type.tensor_type.elem_type))
        nodes += [
            helper.make_node("Shape", [output.name], [shape], name=scope.unique(f"{shape}_Shape")),
            helper.make_node(
                "ConstantOfShape",
                [shape],
                [seeds[output.name]],
                name=scope.unique(f"{output.name}_Seed"),
                value=numpy_helper.from_array(constant),
            ),
        ]
    return nodes


def _gradient_outputs(
    graph: GraphProto,
    forward: Forward,
    built: BuiltGraph,
    request: DerivativeRequest,
    scope: NameScope,
) -> tuple[list[ValueInfoProto], list[NodeProto]]:
    """``<source>_grad`` outputs, inputs first; a source the builder skipped gets zeros."""
    types = _source_types(forward.model, request)
    built_outputs = {o.name: o for o in graph.output}
    renames, outputs, zero_nodes = {}, [], []
    for source in (*request.inputs, *request.weights):
        name = f"{source}_grad"
        gradient = built.gradients.get(source)
        if gradient is None:
            zero_nodes += zeros_like_nodes(
                source, name, types[source].type.tensor_type.elem_type, scope
            )
        elif gradient != name:
            renames[gradient] = name
        info = copy_message(built_outputs.get(gradient) or types[source])
        info.name = name
        outputs.append(info)
    if renames:
        rename_values(graph, renames)
    return outputs, zero_nodes


def _source_types(model: ModelProto, request: DerivativeRequest) -> dict[str, ValueInfoProto]:
    types = {i.name: i for i in model.graph.input if i.name in request.inputs}
    for init in model.graph.initializer:
        if init.name in request.weights:
            types[init.name] = helper.make_tensor_value_info(
                init.name, init.data_type, list(init.dims)
            )
    return types


def _inputs(
    graph: GraphProto, forward: Forward, request: DerivativeRequest
) -> list[ValueInfoProto]:
    """The model's inputs, then the weights (typed as the builder typed them)."""
    types = _source_types(forward.model, request)
    built = {i.name: i for i in graph.input}
    weights = [copy_message(built.get(w) or types[w]) for w in request.weights]
    return [copy_message(i) for i in forward.model.graph.input] + weights


def _model(graph: GraphProto, forward: ModelProto, built: ModelProto) -> ModelProto:
    """Wrap ``graph`` declaring only the domains its nodes use (the user's versions first)."""
    used = {normalize_domain(n.domain) for g in iter_graphs(graph) for n in g.node} | {""}
    versions = {normalize_domain(op.domain): op.version for op in built.opset_import}
    versions.update({normalize_domain(op.domain): op.version for op in forward.opset_import})
    opsets = [helper.make_opsetid(d, versions.get(d, 1)) for d in sorted(used)]
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        ir_version=min(max(forward.ir_version, built.ir_version), MAX_IR_VERSION),
        producer_name="onnxgrad",
    )
    model.functions.extend(f for f in forward.functions if f.domain in used)
    return model
