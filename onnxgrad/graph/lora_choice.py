r"""One runtime adapter model that picks, per run, the cheaper way to apply the fed adapters.

:func:`onnxgrad.graph.lora_runtime.runtime_adapter_model` builds the same deployed model two
ways: ``"branch"`` adds ``s (x A) B`` beside each product (``M r (K + N)`` for ``M`` rows),
``"weights"`` updates the weights once per run (``K N r``, and over quantized weights a few
passes over ``K x N`` to quantize them again), whatever ``M``. :func:`chosen_per_run` puts
both in one ``If`` of standard ONNX, decided by the rows of the first adapted product's
activation ``x`` (``K`` values a row), a shape known only at run time (batch x sequence):

    rows = Size(x) / K,        If(rows > T, weights body, branch body),
    T = sum_w c_w r_w K_w N_w / sum_p r_p (K_p + N_p)

(``w`` the updated weights, ``p`` the branches' products, ``c_w`` the measured cost of one
update's multiply-add against a branch's, :data:`UPDATE_COST`). The nodes computing ``x``
(those the two models share, before any adapted weight is read) stay outside the ``If``;
both bodies read the outer initializers and inputs, so the deployed weights are stored once
and the adapters stay overridable inputs.
"""

from __future__ import annotations

import numpy as np
from onnx import ModelProto, NodeProto, helper, numpy_helper

from onnxgrad._onnx_utils import NameScope, all_names, subgraphs
from onnxgrad.graph._scopes import node_inputs

#: the cost of a weight update's multiply-add of ``K N r`` against a branch's, by how the
#: weight is stored (measured: ``benchmarks/bench_round_trip.py``, docs/deployed-models.md)
UPDATE_COST = {"float": 1.0, "int8": 4.0, "qdq": 16.0}


def crossover_rows(updates: list[tuple[int, int, int, str]], branches: list[tuple]) -> int:
    """``T`` of the module docstring from ``(K, N, r, storage)`` of each updated weight and
    ``(K, N, r)`` of each branch's product (at least one row)."""
    work = sum(UPDATE_COST[storage] * r * k * n for k, n, r, storage in updates)
    per_row = sum(r * (k + n) for k, n, r in branches)
    return max(1, int(work // per_row)) if per_row else 1


def chosen_per_run(
    deployed: ModelProto,
    branch: ModelProto,
    weights: ModelProto,
    activations: list[tuple[str, int]],
    rows: int,
) -> ModelProto:
    """One model running ``weights``' nodes when the first of ``activations`` (``(x, K)``
    of the adapted products) whose ancestors both models compute as ``deployed`` does has
    more than ``rows`` rows, ``branch``'s otherwise. ``branch`` itself where the two have
    the same nodes or no activation is computed before an adapted weight is read."""
    if _node_bytes(branch) == _node_bytes(weights):
        return branch
    point = _decision_point(deployed, branch, weights, activations)
    if point is None:
        return branch
    x, k, prefix = point
    outer = {o for node in prefix for o in node.output}
    names = NameScope(all_names(branch.graph) | all_names(weights.graph))
    bodies = [_body(m, outer, names, tag) for m, tag in ((weights, "weights"), (branch, "branch"))]
    size = names.unique(f"{x}_size")
    limit = names.unique(f"{x}_rows_limit")
    condition = names.unique(f"{x}_many_rows")
    chooser = [
        helper.make_node("Size", [x], [size], name=names.unique("adapters_rows")),
        helper.make_node(
            "Constant",
            [],
            [limit],
            name=names.unique("adapters_rows_limit"),
            value=numpy_helper.from_array(np.asarray(rows * k, dtype=np.int64)),
        ),
        helper.make_node("Greater", [size, limit], [condition], name=names.unique("many_rows")),
        helper.make_node(
            "If",
            [condition],
            [o.name for o in branch.graph.output],
            name=names.unique("adapters_applied"),
            then_branch=bodies[0],
            else_branch=bodies[1],
        ),
    ]
    return _outer_model(branch, weights, prefix, chooser)


def _node_bytes(model: ModelProto) -> list[bytes]:
    return [node.SerializeToString() for node in model.graph.node]


def _decision_point(deployed, branch, weights, activations):
    """``(x, K, the deployed nodes computing x)`` for the first activation whose ancestors
    both built models hold unchanged, or ``None``."""
    producers = {o: node for node in deployed.graph.node for o in node.output}
    order = {id(node): i for i, node in enumerate(deployed.graph.node)}
    built = [_by_output(branch), _by_output(weights)]
    candidates = sorted(
        dict(activations).items(), key=lambda item: order.get(id(producers.get(item[0])), -1)
    )
    for x, k in candidates:
        prefix = _ancestors(x, producers, order)
        if all(_unchanged(node, models) for node in prefix for models in built):
            return x, k, prefix
    return None


def _by_output(model: ModelProto) -> dict[str, bytes]:
    return {node.output[0]: node.SerializeToString() for node in model.graph.node if node.output}


def _unchanged(node: NodeProto, built: dict[str, bytes]) -> bool:
    return built.get(node.output[0]) == node.SerializeToString()


def _ancestors(name: str, producers: dict, order: dict) -> list[NodeProto]:
    """The nodes ``name`` depends on, in the deployed order."""
    found, stack = {}, [name]
    while stack:
        node = producers.get(stack.pop())
        if node is None or id(node) in found:
            continue
        found[id(node)] = node
        stack.extend(node_inputs(node))
    return sorted(found.values(), key=lambda node: order[id(node)])


def _body(model: ModelProto, outer: set[str], names: NameScope, tag: str):
    """``model``'s nodes outside ``outer``'s producers as an ``If`` body: every value they
    write renamed (a body may not shadow the outer names), the graph outputs its outputs."""
    graph = model.graph
    nodes = [n for n in graph.node if not (n.output and n.output[0] in outer)]
    renamed = {o: names.unique(f"{o}/{tag}") for n in nodes for o in n.output if o}
    body_nodes = [_renamed(node, renamed, names, tag) for node in nodes]
    outputs = []
    for output in graph.output:
        value = renamed.get(output.name)
        if value is None:  # an outer value or input read as it is
            value = names.unique(f"{output.name}/{tag}")
            body_nodes.append(helper.make_node("Identity", [output.name], [value]))
        info = helper.make_empty_tensor_value_info(value)
        info.type.CopyFrom(output.type)
        outputs.append(info)
    infos = []
    for info in graph.value_info:
        if info.name in renamed:
            copy = helper.make_empty_tensor_value_info(renamed[info.name])
            copy.type.CopyFrom(info.type)
            infos.append(copy)
    return helper.make_graph(body_nodes, f"{graph.name}_{tag}", [], outputs, value_info=infos)


def _renamed(node: NodeProto, renamed: dict[str, str], names: NameScope, tag: str) -> NodeProto:
    copy = NodeProto()
    copy.CopyFrom(node)
    _rename_reads(copy, renamed)
    copy.output[:] = [renamed.get(o, o) for o in copy.output]
    if copy.name:
        copy.name = names.unique(f"{copy.name}/{tag}")
    return copy


def _rename_reads(node: NodeProto, renamed: dict[str, str]) -> None:
    """Rename what ``node`` and its subgraphs read from the enclosing scopes."""
    node.input[:] = [renamed.get(i, i) for i in node.input]
    for sub in subgraphs(node):
        own = {i.name for i in sub.input} | {i.name for i in sub.initializer}
        own |= {o for n in sub.node for o in n.output}
        free = {k: v for k, v in renamed.items() if k not in own}
        for inner in sub.node:
            _rename_reads(inner, free)
        for output in sub.output:
            output.name = free.get(output.name, output.name)


def _outer_model(branch, weights, prefix, chooser) -> ModelProto:
    """The model: ``branch``'s inputs, outputs and initializers with ``weights``' own too,
    ``prefix`` then ``chooser`` as its nodes."""
    model = ModelProto()
    model.CopyFrom(branch)
    graph = model.graph
    known = {init.name for init in graph.initializer}
    graph.initializer.extend(i for i in weights.graph.initializer if i.name not in known)
    kept = {o for node in prefix for o in node.output}
    infos = [info for info in graph.value_info if info.name in kept]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    del graph.node[:]
    graph.node.extend([*prefix, *chooser])
    domains = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in weights.opset_import if o.domain not in domains)
    model.ir_version = max(branch.ir_version, weights.ir_version)
    return model


__all__ = ["UPDATE_COST", "chosen_per_run", "crossover_rows"]
