"""The JVP model by tangent propagation (:mod:`onnxgrad.derivative.autodiff.tangent`).

The result takes the model's inputs, the differentiated weights (now inputs) and one
``<x>_tangent`` per source, and returns one ``<y>_tangent`` per float output (zeros where no
source reaches it), then the float outputs themselves with ``keep_outputs``. The forward
nodes are the model's own, computed once; the tangent nodes follow them.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx import GraphProto, ModelProto, ValueInfoProto, helper

from onnxgrad._onnx_utils import (
    FLOAT_TYPES,
    NameScope,
    all_names,
    default_opset,
    finalize_model,
    replace_repeated,
)
from onnxgrad.derivative.api import graph_inputs, resolve_request
from onnxgrad.derivative.autodiff.builder import GradBuilder
from onnxgrad.derivative.autodiff.cleanup import live_nodes
from onnxgrad.derivative.autodiff.forward_rewrites import pool_before_relu
from onnxgrad.derivative.autodiff.tangent import (
    NoTangentRule,
    Tangent,
    TangentEngine,
    zeros_of,
)
from onnxgrad.derivative.autodiff.tangent_rules import TANGENT_RULES
from onnxgrad.derivative.autodiff.value_types import infer_value_types
from onnxgrad.derivative.options import DerivativeOptions


def tangent_jvp(
    model: ModelProto,
    weights: Sequence[str] | None,
    inputs: Sequence[str] | None,
    keep_outputs: bool = False,
    checked: bool = True,
) -> tuple[ModelProto, list[str], list[str]]:
    """The JVP of a normalised model the caller owns, rewritten in place into the result
    (``checked``: by onnx's full check); returns it, its tangent inputs and its tangent
    outputs. Raises
    :class:`~onnxgrad.derivative.autodiff.tangent.NoTangentRule` where a node on the way
    has no tangent rule, the model then computing what it did (its pools may have moved
    before their ReLUs: :func:`~onnxgrad.derivative.autodiff.forward_rewrites.pool_before_relu`)."""
    request = resolve_request(model, weights, inputs, DerivativeOptions.KeepOutputs, None, None)
    graph = model.graph
    pool_before_relu(graph)
    sources = [*request.inputs, *request.weights]
    scope = NameScope(all_names(graph))
    seeds = {s: scope.unique(f"{s}_tangent") for s in sources}
    engine = TangentEngine.for_graph(
        graph, default_opset(model), scope, set(sources), TANGENT_RULES,
        lambda: infer_value_types(model),
    )  # fmt: skip
    tangents = engine.run(seeds)
    outputs = [o for o in graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]
    if all(tangents.get(o.name) is None for o in outputs):
        raise NoTangentRule("no output has a tangent: the transposition says why, or gives 0")
    results = {o.name: scope.unique(f"{o.name}_tangent") for o in outputs}
    b = GradBuilder(engine.emitter, "jvp_outputs/")
    nodes = engine.emitted_nodes
    renamed: dict[str, str] = {}
    for output in outputs:
        value = _exact_output(b, output, tangents.get(output.name))
        _write_output(b, nodes, renamed.get(value, value), results[output.name], seeds, renamed)
    engine.write_exposed_outputs()
    kept = outputs if keep_outputs else []
    _rewrite_in_place(model, request, seeds, engine.all_nodes(), results, kept)
    return finalize_model(model, check=checked), list(seeds.values()), list(results.values())


def _exact_output(b: GradBuilder, output, tangent: Tangent | None) -> str:
    """``output``'s tangent with its shape: zeros where it has none, expanded if loose."""
    if tangent is None:
        return zeros_of(b, output.name, output.type.tensor_type.elem_type)
    if not tangent.exact:
        return b.op("Expand", tangent.name, b.shape_of(output.name))
    return tangent.name


def _write_output(b, nodes, value: str, name: str, seeds, renamed: dict) -> None:
    """Make the graph compute ``value`` under the output name ``name``: the producer's
    output renamed, or an Identity of a seed or of a value another output already took."""
    if value in seeds.values() or value in renamed.values():
        nodes.append(helper.make_node("Identity", [value], [name], name=b.unique_node_name(name)))
        return
    for node in nodes:
        for field in (node.input, node.output):
            for i, used in enumerate(field):
                if used == value:
                    field[i] = name
    renamed[value] = name


def _rewrite_in_place(model, request, seeds, nodes, results, kept) -> None:
    """Inputs: the model's, the weights, the tangents; outputs: the tangents, then
    ``kept``; nodes: ``nodes`` (forward and tangent ones), the dead ones pruned."""
    graph: GraphProto = model.graph
    declared = {i.name: i for i in graph.input}
    initializers = {i.name: i for i in graph.initializer}
    new_inputs = [declared[n] for n in graph_inputs(model)]
    for weight in request.weights:
        init = initializers[weight]
        new_inputs.append(helper.make_tensor_value_info(weight, init.data_type, list(init.dims)))
    by_name = {i.name: i for i in new_inputs}
    for source, seed in seeds.items():
        info = ValueInfoProto()
        info.CopyFrom(by_name[source])
        info.name = seed
        new_inputs.append(info)
    replace_repeated(graph.input, new_inputs)
    tangent_outputs = []
    for output in [o for o in graph.output if o.name in results]:
        info = ValueInfoProto()
        info.CopyFrom(output)
        info.name = results[output.name]
        tangent_outputs.append(info)
    kept_names = {o.name for o in kept}
    keep = [o for o in graph.output if o.name in kept_names]
    replace_repeated(graph.output, tangent_outputs + keep)
    needed = {o.name for o in graph.output}
    replace_repeated(graph.node, live_nodes(nodes, needed))
    weights = set(request.weights)
    for index in reversed(range(len(graph.initializer))):
        name = graph.initializer[index].name
        if name in weights or name not in needed:
            del graph.initializer[index]
    graph.ClearField("value_info")
