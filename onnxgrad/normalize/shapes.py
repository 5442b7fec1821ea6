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
from onnx import ModelProto, TypeProto, ValueInfoProto

from onnxgrad._onnx_utils import weightless_view


def reconciled_shapes(model: ModelProto) -> ModelProto:
    """``model`` with the declared types of its main graph's outputs and values replaced
    where onnx's shape inference says otherwise (see the module docstring)."""
    graph = model.graph
    declared = [*graph.output, *graph.value_info]
    if not any(_has_tensor_type(info) for info in declared):
        return model
    inferred = _inferred_types(model)
    for info in declared:
        found = inferred.get(info.name)
        if found is not None and _has_tensor_type(info) and info.type != found:
            _reconcile(info.type, found)
    for info in graph.output:
        if _has_tensor_type(info):
            _unconfirmed_dims_unknown(info.type, inferred.get(info.name))
    return model


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


def _inferred_types(model: ModelProto) -> dict[str, TypeProto]:
    """``{value: inferred type}`` of the main graph, with no declaration but the inputs'."""
    view = weightless_view(model)
    del view.graph.value_info[:]
    for output in view.graph.output:
        output.type.Clear()
    try:
        view = onnx.shape_inference.infer_shapes(view)
    except Exception:  # inference is a hint here: what it cannot tell stays declared
        return {}
    infos = [*view.graph.value_info, *view.graph.output]
    return {info.name: info.type for info in infos if _has_tensor_type(info)}


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
