"""Renaming values of a graph, outer-scope uses in subgraphs included."""

from __future__ import annotations

from collections.abc import Mapping

from onnx import GraphProto, ModelProto, helper

from onnxgrad._onnx_utils import ModelLike, NameScope, all_names, finalize_model, load_model
from onnxgrad.graph._scopes import defined_names, node_inputs
from onnxgrad.normalize.shapes import reconciled_shapes


def onnx_rename_weights(model: ModelLike) -> ModelProto:
    """A copy of ``model`` whose initializers are renamed ``I<k>_<name>`` so that their
    alphabetical order is the order the graph first uses them.

    ``k`` counts from 0 in the order of the first node reading the initializer (subgraph
    reads included), unused initializers last; it is zero-padded to the width of the
    largest index. Every use is renamed, in subgraphs too, unless a subgraph shadows the
    name. The initializer list is sorted by the new names. An initializer that is also a
    graph output keeps its output name through an ``Identity`` node. An output declared
    without a shape (skl2onnx's ``FloatTensorType()``, which onnx's checker refuses) gets
    the one shape inference finds.
    """
    model = reconciled_shapes(load_model(model))
    graph = model.graph
    order = _first_use_order(graph)
    if not order:
        return finalize_model(model)
    width = len(str(len(order) - 1))
    scope = NameScope(all_names(graph) - set(order))
    mapping = {old: scope.unique(f"I{k:0{width}d}_{old}") for k, old in enumerate(order)}
    output_names = {o.name for o in graph.output}
    rename_values(graph, mapping)
    graph.initializer.sort(key=lambda init: init.name)
    for old in sorted(output_names & set(mapping)):
        graph.node.insert(0, helper.make_node("Identity", [mapping[old]], [old]))
        for out in graph.output:
            if out.name == mapping[old]:
                out.name = old
    return finalize_model(model)


def _first_use_order(graph: GraphProto) -> list[str]:
    initializers = [init.name for init in graph.initializer]
    known = set(initializers)
    order: dict[str, None] = {}
    for node in graph.node:
        for name in [*node.input, *sorted(node_inputs(node) - set(node.input))]:
            if name in known:
                order.setdefault(name, None)
    for name in initializers:
        order.setdefault(name, None)
    return list(order)


def rename_values(graph: GraphProto, mapping: Mapping[str, str]) -> None:
    """Rename, in place, every occurrence of the names in ``mapping``: definitions
    (inputs, initializers, node outputs, value_info) and uses, in subgraphs unless they
    define the name themselves."""
    for init in graph.initializer:
        init.name = mapping.get(init.name, init.name)
    for sparse in graph.sparse_initializer:
        sparse.values.name = mapping.get(sparse.values.name, sparse.values.name)
    for info in [*graph.input, *graph.output, *graph.value_info]:
        info.name = mapping.get(info.name, info.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                inner = {k: v for k, v in mapping.items() if k not in defined_names(sub)}
                if inner:
                    rename_values(sub, inner)
