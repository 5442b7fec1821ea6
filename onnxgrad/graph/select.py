"""Cutting a graph down to what computes a chosen set of outputs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx
from onnx import GraphProto, ModelProto, ValueInfoProto, helper

from onnxgrad._onnx_utils import (
    ModelLike,
    finalize_model,
    load_model,
    replace_repeated,
    retain,
    subgraphs,
)
from onnxgrad.graph._scopes import node_inputs

#: onnx shape inference names the unknown dimensions it creates ``unk__<i>``.
_INFERRED_DIM_PREFIX = "unk__"


def remove_unused_nodes(model: ModelLike) -> ModelProto:
    """A copy of ``model`` without the nodes and initializers no output depends on.

    Subgraphs are pruned against their own outputs. Graph inputs are kept, even unused
    ones: they are the model's interface (use :func:`select_model_inputs_outputs` to drop
    them).
    """
    model = load_model(model)
    prune_graph(model.graph, keep_inputs=True)
    return finalize_model(model)


def select_model_inputs_outputs(
    model: ModelLike,
    outputs: Sequence[str] | str | None = None,
    inputs: Sequence[str] | str | None = None,
    infer_shapes: bool = True,
) -> ModelProto:
    """The part of ``model`` computing ``outputs`` from ``inputs``.

    The arguments come in the seeds' order, ``(model, outputs=None, inputs=None)``, so
    ``select_model_inputs_outputs(onx, ['score'])`` keeps the output ``'score'``.

    :param outputs: names of outputs or intermediate results (which become outputs);
        ``None`` keeps the current outputs.
    :param inputs: names of graph inputs or intermediate results; an intermediate result
        becomes a new input and the nodes computing it go. ``None`` keeps the current inputs
        the outputs need. Every input listed is kept, needed or not.

    Types and shapes of new inputs and outputs come from shape inference
    (``infer_shapes=False``: from the types the model declares only, the value infos included,
    as mlprodict's option; a value with none is refused by name). Nodes,
    initializers and (with ``inputs=None``) inputs the outputs do not need are removed.
    Raises ``ValueError`` naming an unknown name, or an output that cannot be computed from
    the chosen inputs.
    """
    return select_in_place(load_model(model), outputs, inputs, infer_shapes)


def select_in_place(
    model: ModelProto,
    outputs: Sequence[str] | str | None = None,
    inputs: Sequence[str] | str | None = None,
    infer_shapes: bool = True,
) -> ModelProto:
    """:func:`select_model_inputs_outputs` of a model the caller owns: rewritten in place,
    no copy of its weights."""
    graph = model.graph
    input_names = _names(inputs, "inputs")
    output_names = _names(outputs, "outputs")
    infos = _value_infos(model, infer_shapes)
    produced = {o for node in graph.node for o in node.output if o}
    known = produced | {i.name for i in graph.input} | {i.name for i in graph.initializer}

    if output_names is not None:
        _check_known(output_names, known, "output")
        replace_repeated(graph.output, [_typed_info(infos, n, "output") for n in output_names])
    if input_names is not None:
        _check_known(input_names, produced | {i.name for i in graph.input}, "input")
        new_inputs = [_typed_info(infos, n, "input") for n in input_names]
        fed = set(input_names)
        replace_repeated(graph.node, [n for n in graph.node if not fed.intersection(n.output)])
        replace_repeated(graph.input, new_inputs)
    prune_graph(graph, keep_inputs=input_names is not None)
    _check_computable(graph)
    return finalize_model(model)


def _names(names: Sequence[str] | str | None, what: str) -> list[str] | None:
    if names is None:
        return None
    names = [names] if isinstance(names, str) else list(names)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{what} must be a list of non-empty names, got {names!r}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{what} lists {duplicates} more than once")
    return names


def _check_known(names: Iterable[str], known: set[str], what: str) -> None:
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}: no value of the graph is named so")


def _value_infos(model: ModelProto, infer: bool = True) -> dict[str, ValueInfoProto]:
    """Every typed value of the main graph, inferred types filling the gaps (``infer``)."""
    from onnxgrad._model_checks import weightless_view

    inferred = model.graph
    if infer:
        try:
            inferred = onnx.shape_inference.infer_shapes(weightless_view(model)).graph
        except Exception:  # fall back on what the model declares
            inferred = model.graph
    infos: dict[str, ValueInfoProto] = {}
    for graph in (inferred, model.graph):
        for info in [*graph.value_info, *graph.input, *graph.output]:
            if info.type.WhichOneof("value") is not None:
                infos[info.name] = info
    for init in model.graph.initializer:
        infos.setdefault(
            init.name, helper.make_tensor_value_info(init.name, init.data_type, init.dims)
        )
    return infos


def _typed_info(infos: dict[str, ValueInfoProto], name: str, what: str) -> ValueInfoProto:
    if name not in infos:
        raise ValueError(f"cannot make {name!r} an {what}: shape inference gives it no type")
    info = ValueInfoProto()
    info.CopyFrom(infos[name])
    if info.type.HasField("tensor_type"):
        for dim in info.type.tensor_type.shape.dim:
            if dim.dim_param.startswith(_INFERRED_DIM_PREFIX):
                dim.ClearField("dim_param")
    return info


def prune_graph(graph: GraphProto, keep_inputs: bool) -> None:
    """Drop, in place, the nodes, initializers, value_info (and inputs unless
    ``keep_inputs``) no output of ``graph`` needs; subgraphs are pruned against their own
    outputs first."""
    for node in graph.node:
        for sub in subgraphs(node):
            prune_graph(sub, keep_inputs=True)
    needed = {o.name for o in graph.output}
    keep = [False] * len(graph.node)
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if needed.intersection(node.output):
            keep[index] = True
            needed |= node_inputs(node)
    retain(graph.node, keep)
    _delete_unneeded(graph.initializer, lambda i: i.name in needed)
    _delete_unneeded(graph.sparse_initializer, lambda i: i.values.name in needed)
    if not keep_inputs:
        replace_repeated(graph.input, [i for i in graph.input if i.name in needed])
    available = needed | {o for node in graph.node for o in node.output}
    replace_repeated(graph.value_info, [v for v in graph.value_info if v.name in available])


def _delete_unneeded(field, needed) -> None:
    """Delete in place the items of a repeated field that ``needed`` rejects: the others
    (weights, possibly big) are never copied."""
    for index in reversed(range(len(field))):
        if not needed(field[index]):
            del field[index]


def _check_computable(graph: GraphProto) -> None:
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    available |= {o for node in graph.node for o in node.output}
    for node in graph.node:
        missing = sorted(n for n in node_inputs(node) if n not in available)
        if missing:
            raise ValueError(
                f"node {node.name or node.op_type!r} ({node.op_type}) needs {missing}, "
                "which the selected inputs do not provide: add them to inputs"
            )
    missing = [o.name for o in graph.output if o.name not in available]
    if missing:
        raise ValueError(f"outputs {missing} cannot be computed from the selected inputs")
