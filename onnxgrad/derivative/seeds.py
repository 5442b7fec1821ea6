r"""Many seeds in one run: a leading seed axis on the tangents or cotangents.

A JVP graph ``t -> J t`` (or a VJP graph ``g -> J^T g``, an HVP graph ``v -> H v``) is linear
in its seeds. Given ``k`` seeds stacked along a new leading axis, the graph computes
``[J t_1, ..., J t_k]`` in one run: the nodes reading no seed (the forward values, the
Jacobian's factors) run once; the others, the part linear in the seed, become the body of a
``Scan`` over the seed axis, which reads the forward values from the enclosing graph.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnx import GraphProto, ModelProto, ValueInfoProto, helper

from onnxgrad._onnx_utils import NameScope, all_names, finalize_model, replace_repeated
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
    """``model`` (owned by the caller, rewritten in place) with a leading axis of ``seeds``
    on the inputs ``seed_inputs`` and on the outputs ``results``, which must be linear in
    them; the other inputs and outputs keep their shapes."""
    graph = model.graph
    seed_set = set(seed_inputs)
    linear, rest = _split_nodes(graph, seed_set)
    scope = NameScope(all_names(graph))
    body_inputs = {name: scope.unique(f"{name}_one") for name in seed_inputs}
    body_outputs = {name: scope.unique(f"{name}_one") for name in results}
    infos = {i.name: i for i in graph.input} | {o.name: o for o in graph.output}
    body = helper.make_graph(
        linear,
        "seed",
        [_renamed(infos[name], body_inputs[name]) for name in seed_inputs],
        [_renamed(infos[name], body_outputs[name]) for name in results],
    )
    rename_values(body, {**body_inputs, **body_outputs})
    computed = {o for node in linear for o in node.output}
    for name in results:  # a result read from the enclosing graph: the same for every seed
        if name not in computed:
            body.node.append(helper.make_node("Identity", [name], [body_outputs[name]]))
    scan = helper.make_node(
        "Scan",
        list(seed_inputs),
        list(results),
        name=scope.unique("SeedScan"),
        body=body,
        num_scan_inputs=len(seed_inputs),
    )
    replace_repeated(graph.node, [*rest, scan])
    _name_nodes(graph, scope)
    for info in [*graph.input, *graph.output]:
        if info.name in seed_set or info.name in set(results):
            _prepend_axis(info, seeds)
    return finalize_model(model)


def _name_nodes(graph: GraphProto, scope: NameScope) -> None:
    """A unique name for every unnamed node, in the Scan's body too: onnxruntime names the
    nodes its fusions make after the nodes they replace, and refuses two equal names."""
    for node in graph.node:
        if not node.name:
            node.name = scope.unique(f"{node.op_type}_seeded")
        for attr in node.attribute:
            if attr.HasField("g"):
                _name_nodes(attr.g, scope)


def _split_nodes(graph: GraphProto, seeds: set[str]) -> tuple[list, list]:
    """``(nodes reading a seed directly or not, the others)``, each in graph order."""
    reached = set(seeds)
    linear, rest = [], []
    for node in graph.node:
        if reached.isdisjoint(node_inputs(node)):
            rest.append(node)
        else:
            linear.append(node)
            reached.update(node.output)
    return linear, rest


def _renamed(info: ValueInfoProto, name: str) -> ValueInfoProto:
    copy = ValueInfoProto()
    copy.CopyFrom(info)
    copy.name = name
    return copy


def _prepend_axis(info: ValueInfoProto, seeds: int) -> None:
    tensor = info.type.tensor_type
    dims = list(tensor.shape.dim) if tensor.HasField("shape") else None
    if dims is None:
        return
    tensor.shape.ClearField("dim")
    tensor.shape.dim.add().dim_value = seeds
    for dim in dims:
        tensor.shape.dim.add().CopyFrom(dim)
