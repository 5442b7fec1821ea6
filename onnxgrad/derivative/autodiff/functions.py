r"""The function fallback: differentiating an operator through its ONNX function body.

An operator with no gradient rule may still be defined as a composition of other
operators: a schema function (``Swish``, ``RMSNormalization``, ``GroupNormalization``...),
a context-dependent function built from the node's attributes and input types
(``Attention``, ``SoftmaxCrossEntropyLoss``...) or a model-local function
(``ModelProto.functions``). For such a node ``y = F(x)`` with body ``y = f_n(...f_1(x))``
the chain rule gives

.. math:: \bar x = J_{f_1}^\top \cdots J_{f_n}^\top \bar y

so the fallback rule recomputes the body (fresh value names, the node's own inputs) in the
backward pass and lets a nested engine differentiate it. The forward graph keeps the fused
operator; the body is only a recipe for its derivative. onnx's inliner does the expansion
(attribute binding, context-dependent bodies, nested local functions); shape inference
types the body's values so that rules needing a static rank still apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial

import onnx
import onnx.inliner
from onnx import FunctionProto, GraphProto, NodeProto, TypeProto, helper

from onnxgrad._onnx_utils import MAX_IR_VERSION, normalize_domain, subgraphs
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import Rule
from onnxgrad.derivative.autodiff.value_types import ValueType, value_info


class FunctionExpansionError(NotImplementedError):
    """The operator has a function, but onnx cannot build its body for this node."""


def function_rule(
    node: NodeProto,
    types: Mapping[str, ValueType],
    opsets: Mapping[str, int],
    functions: Sequence[FunctionProto] = (),
) -> Rule | None:
    """A rule differentiating ``node`` through its function body, or ``None`` without one."""
    body = expand_node(node, types, opsets, functions)
    if body is None:
        return None
    domain = normalize_domain(node.domain)
    version = opsets.get(domain, 1)
    return Rule(domain, node.op_type, version, version, partial(through_body, body), False)


def expand_node(
    node: NodeProto,
    types: Mapping[str, ValueType],
    opsets: Mapping[str, int],
    functions: Sequence[FunctionProto] = (),
) -> list[NodeProto] | None:
    """The nodes of ``node``'s function body, bound to its inputs, outputs and attributes
    (``None`` when the operator has no function at the model's opsets; a
    :class:`FunctionExpansionError` when onnx cannot build it)."""
    domain = normalize_domain(node.domain)
    local = {(normalize_domain(f.domain), f.name) for f in functions}
    if (domain, node.op_type) not in local and not _schema_has_function(node, opsets):
        return None
    model = _single_node_model(_with_default_attributes(node, opsets), types, opsets, functions)
    try:
        inlined = onnx.inliner.inline_selected_functions(
            model, [(node.domain, node.op_type), *local], inline_schema_functions=True
        )
    except Exception as exc:  # the inliner raises bare RuntimeErrors and C++ assertions
        message = " ".join(str(exc).split())[:300]
        raise FunctionExpansionError(f"its function body cannot be built: {message}") from exc
    nodes = list(inlined.graph.node)
    if len(nodes) == 1 and nodes[0].op_type == node.op_type and nodes[0].domain == node.domain:
        return None
    return nodes


def _schema_has_function(node: NodeProto, opsets: Mapping[str, int]) -> bool:
    domain = normalize_domain(node.domain)
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return False
    return schema.has_function or schema.has_context_dependent_function


def _with_default_attributes(node: NodeProto, opsets: Mapping[str, int]) -> NodeProto:
    """``node`` with the schema's default for every attribute it leaves out (a function body
    refers to attributes by name, the defaults included)."""
    domain = normalize_domain(node.domain)
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return node
    present = {a.name for a in node.attribute}
    copy = NodeProto()
    copy.CopyFrom(node)
    for name, attribute in schema.attributes.items():
        default = attribute.default_value
        if name not in present and default is not None and default.type:
            copy.attribute.add().CopyFrom(default)
            copy.attribute[-1].name = name
    return copy


def _single_node_model(
    node: NodeProto,
    types: Mapping[str, ValueType],
    opsets: Mapping[str, int],
    functions: Sequence[FunctionProto],
) -> onnx.ModelProto:
    inputs = []
    for name in dict.fromkeys(i for i in node.input if i):
        value = types.get(name)
        if value is None:
            info = onnx.ValueInfoProto(name=name, type=TypeProto())
            info.type.tensor_type.elem_type = onnx.TensorProto.UNDEFINED
            inputs.append(info)
        else:
            inputs.append(value_info(name, value))
    outputs = [onnx.ValueInfoProto(name=o) for o in node.output if o]
    graph = helper.make_graph([node], "expand", inputs, outputs)
    if "" in node.input:  # the inliner asks for the type of omitted optional inputs too
        graph.value_info.append(helper.make_tensor_value_info("", onnx.TensorProto.FLOAT, None))
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
        ir_version=MAX_IR_VERSION,
    )
    model.functions.extend(functions)
    return model


def through_body(body: list[NodeProto], b: GradBuilder, node: NodeView, grads, needs):
    """Recompute the body under fresh names, then differentiate it with a nested engine."""
    renames = {}
    for inner in body:
        for name in inner.output:
            if name:
                renames[name] = b.unique_name(f"{node.op_type}_body/{name}")
    nodes = [_renamed(inner, renames, b) for inner in body]
    outputs = [onnx.ValueInfoProto(name=renames[o]) for o in node.outputs if o in renames]
    graph = helper.make_graph(nodes, f"{node.op_type}_body", [], outputs)
    seeds = {renames[o]: g for o, g in zip(node.outputs, grads) if g is not None and o in renames}
    sources = [name for name, need in zip(node.inputs, needs) if need and name]
    backward, gradients = b.differentiate_subgraph(graph, sources, seeds)
    b.emit_nodes([*graph.node, *backward])  # forward hooks may have added outputs
    results, seen = [], set()
    for name, need in zip(node.inputs, needs):
        results.append(gradients.get(name) if need and name not in seen else None)
        seen.add(name)
    return results


def _renamed(node: NodeProto, renames: Mapping[str, str], b: GradBuilder) -> NodeProto:
    copy = NodeProto()
    copy.CopyFrom(node)
    copy.name = b.unique_node_name(node.name or node.op_type)
    _rename_values(copy, renames)
    return copy


def _rename_values(node: NodeProto, renames: Mapping[str, str]) -> None:
    node.input[:] = [renames.get(i, i) for i in node.input]
    node.output[:] = [renames.get(o, o) for o in node.output]
    for sub in subgraphs(node):
        _rename_graph(sub, renames)


def _rename_graph(graph: GraphProto, renames: Mapping[str, str]) -> None:
    for inner in graph.node:
        _rename_values(inner, renames)
    for output in graph.output:
        output.name = renames.get(output.name, output.name)
