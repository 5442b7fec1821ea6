"""Declared shapes reconciled with what the model computes.

onnxruntime only warns when a declared output shape disagrees with the one it computes, and
models ship with such declarations (an output declared 2-D that is 3-D). Copied onto new
inputs (a loss's label, an output's gradient) they make graphs onnxruntime refuses, so the
declarations of the main graph's outputs and values are checked against onnx's shape
inference of the model without them: a rank or element type that disagrees is replaced by
the inferred one, a static dimension that disagrees becomes unknown. Where inference knows
nothing the declaration stays, except an output's static dimensions that inference cannot
confirm: they become unknown (an exporter traced with 54 boxes declares ``[batch, 54, 4]``
for an output whose middle dimension follows an input; onnxruntime computes ``[1, 10, 4]``
with a warning, and refuses a gradient seed declared ``54``).
"""

from __future__ import annotations

import onnx
from onnx import GraphProto, ModelProto, TypeProto, ValueInfoProto

from onnxgrad._bounded_inference import PROPAGATING_OPS
from onnxgrad._onnx_utils import FLOAT_TYPES, normalize_domain, subgraphs, weightless_view
from onnxgrad.normalize.facts import Facts


def reconciled_shapes(model: ModelProto, facts: Facts | None = None) -> ModelProto:
    """``model`` with the declared types of its main graph's outputs and values replaced
    where onnx's shape inference says otherwise (see the module docstring); ``facts``
    learn whether that inference ranked every value (:attr:`Facts.ranks_known`)."""
    graph = model.graph
    declared = [*graph.output, *graph.value_info]
    if facts is not None:
        facts.ranks_known = False
    if not any(_has_tensor_type(info) for info in declared):
        return model
    view = _inferred_view(model)
    if view is None:
        return model
    if facts is not None:
        facts.ranks_known = _every_rank_inferred(view.graph)
    inferred = _tensor_types(view.graph)
    for info in declared:
        found = inferred.get(info.name)
        if found is not None and _has_tensor_type(info) and info.type != found:
            _reconcile(info.type, found)
    for info in graph.output:
        if _has_tensor_type(info):
            _unconfirmed_dims_unknown(info.type, inferred.get(info.name))
    if facts is not None and facts.ranks_known and _inference_stands(model, view):
        facts.inferred = view
    return model


def _inference_stands(model: ModelProto, view: ModelProto) -> bool:
    """Whether ``view`` (the inference of ``model`` without declarations, every value
    ranked) is what inference with the declarations and data propagation gives (see
    :attr:`Facts.inferred`): no value_info, every output declared as inferred, no dimension
    name in them that the inputs lack, no operator propagating data
    (:func:`_no_data_to_propagate`)."""
    graph = model.graph
    if graph.value_info or model.functions:
        return False
    if any(mine.type != found.type for mine, found in zip(graph.output, view.graph.output)):
        return False
    names = _dim_names(graph.input)
    if not _dim_names(graph.output) <= names:
        return False
    propagating = [
        node
        for node in graph.node
        if node.op_type in PROPAGATING_OPS and not normalize_domain(node.domain)
    ]
    return not propagating or _no_data_to_propagate(propagating, view.graph)


def _no_data_to_propagate(nodes, inferred: GraphProto) -> bool:
    """Whether none of the propagating ``nodes`` has data to propagate: onnx's propagation
    starts at ``Shape`` and ``Size`` and reads integer tensors only, so ops reading float
    values alone (an ``Identity`` of a weight) propagate nothing."""
    if any(node.op_type in ("Shape", "Size") for node in nodes):
        return False
    elem_types = {init.name: init.data_type for init in inferred.initializer}
    for info in [*inferred.input, *inferred.value_info, *inferred.output]:
        elem_types[info.name] = info.type.tensor_type.elem_type
    return all(elem_types.get(name) in FLOAT_TYPES for node in nodes for name in node.input if name)


def _dim_names(infos) -> set[str]:
    """The dimension names (``dim_param``) of the tensor types of ``infos``."""
    return {
        dim.dim_param
        for info in infos
        for dim in info.type.tensor_type.shape.dim
        if dim.HasField("dim_param")
    }


def _unconfirmed_dims_unknown(declared: TypeProto, inferred: TypeProto | None) -> None:
    """The static dimensions of ``declared`` that ``inferred`` gives as not static (a traced
    size the inputs do not fix) become unknown. Where inference tells nothing of them (no
    type: it failed, or stopped at an op without a schema; no rank: a converted
    classifier's ``[N, 3]`` probabilities after ``ai.onnx.ml`` ops; another rank) the
    declaration stays: a size no inference disproves is the exporter's word."""
    if inferred is None or not inferred.tensor_type.HasField("shape"):
        return
    target = declared.tensor_type.shape.dim
    found = inferred.tensor_type.shape.dim
    if len(found) != len(target):
        return
    for mine, theirs in zip(target, found, strict=True):
        if mine.HasField("dim_value") and not theirs.HasField("dim_value"):
            mine.ClearField("dim_value")


def _inferred_view(model: ModelProto) -> ModelProto | None:
    """A weightless view of ``model`` typed by onnx's inference with no declaration but the
    inputs'; None where inference fails."""
    view = weightless_view(model)
    del view.graph.value_info[:]
    for output in view.graph.output:
        output.type.Clear()
    try:
        return onnx.shape_inference.infer_shapes(view)
    except Exception:  # inference is a hint here: what it cannot tell stays declared
        return None


def _tensor_types(graph: GraphProto) -> dict[str, TypeProto]:
    """``{value: inferred type}`` of the values and outputs of an inferred graph."""
    infos = [*graph.value_info, *graph.output]
    return {info.name: info.type for info in infos if _has_tensor_type(info)}


def _every_rank_inferred(graph: GraphProto) -> bool:
    """Whether the inferred ``graph`` (declarations cleared but the inputs') gives every
    input and node output a rank, or a type other than a tensor, and holds no subgraph."""
    known = {
        info.name
        for info in [*graph.input, *graph.value_info, *graph.output]
        if info.type.tensor_type.HasField("shape")
        or info.type.WhichOneof("value") not in (None, "tensor_type")
    }
    if any(info.name not in known for info in graph.input):
        return False
    return not any(
        subgraphs(node) or any(o and o not in known for o in node.output) for node in graph.node
    )


def _has_tensor_type(info: ValueInfoProto) -> bool:
    return info.type.HasField("tensor_type")


def _reconcile(declared: TypeProto, inferred: TypeProto) -> None:
    target, found = declared.tensor_type, inferred.tensor_type
    if found.elem_type and found.elem_type != target.elem_type:
        target.elem_type = found.elem_type
    if not found.HasField("shape"):
        return
    if not target.HasField("shape") or len(target.shape.dim) != len(found.shape.dim):
        target.shape.CopyFrom(found.shape)
        return
    for mine, theirs in zip(target.shape.dim, found.shape.dim, strict=True):
        if (
            mine.HasField("dim_value")
            and theirs.HasField("dim_value")
            and mine.dim_value != theirs.dim_value
        ):
            mine.ClearField("dim_value")
