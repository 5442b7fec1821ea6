"""Turn the model of an onnxscript function into the concrete graph the catalogue serves.

onnxscript emits untyped inputs and outputs and keeps helper functions as model-local
functions. This module inlines them, keeps the outputs a catalogue entry asks for (dropping
the nodes only the others needed), names the sample-weight input (an input with a default:
every sample weighs 1 when it is not fed), declares element types and shapes, and validates
the result with ``onnx.checker.check_model(full_check=True)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
from onnx_ir.passes import common as passes

from onnxgrad._onnx_utils import finalize_model
from onnxgrad.functions._registry import WEIGHT, BuildContext, Dim, GraphSpec, Port


def concretize(
    spec: GraphSpec,
    ctx: BuildContext,
    params: Mapping[str, Any],
    weight_name: str | None,
    input_shapes: Mapping[str, tuple[Dim, ...]],
) -> onnx.ModelProto:
    """Build ``spec`` for ``ctx`` and return a typed, checker-valid model."""
    model = ir.serde.deserialize_model(spec.build(ctx, **params))
    passes.InlinePass()(model)
    passes.RemoveUnusedFunctionsPass()(model)
    inputs = spec.input_ports(params, ctx.weighted)
    outputs = spec.output_ports(params)
    _expect_inputs(model.graph, inputs, spec.name)
    _keep_outputs(model.graph, outputs, spec.name)
    passes.RemoveUnusedNodesPass()(model)
    passes.RemoveUnusedOpsetsPass()(model)

    public = {WEIGHT: weight_name} if ctx.weighted else {}
    declared = _declared_shapes(inputs, public, input_shapes)
    for value, port in zip(model.graph.inputs, inputs):
        value.name = public.get(port.name, port.name)
        _declare(value, port, declared[port.name], ctx)
    for value, port in zip(model.graph.outputs, outputs):
        shape = declared[port.like] if port.like else port.shape
        _declare(value, port, shape, ctx)
    passes.NameFixPass()(model)

    model.graph.name = spec.name
    model.graph.doc_string = inspect.cleandoc(spec.build.__doc__ or "")
    model.producer_name = "onnxgrad"
    proto = ir.serde.serialize_model(model)
    proto.ir_version = _min_ir_version(ctx.opset)
    if ctx.weighted:
        _default_to_one(proto, weight_name, declared[WEIGHT], ctx)
    try:
        _declare_inferred_outputs(proto, outputs)
        return finalize_model(proto)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        shapes = {public.get(k, k): v for k, v in declared.items()}
        raise ValueError(
            f"graph {spec.name!r} is invalid with the input shapes {shapes}: {exc}"
        ) from exc


def _declared_shapes(
    inputs: list[Port], public: Mapping[str, str], requested: Mapping[str, tuple[Dim, ...]]
) -> dict[str, tuple[Dim, ...]]:
    """Shapes of the inputs: requested, else that of the input they follow, else the default."""
    declared: dict[str, tuple[Dim, ...]] = {}
    for port in inputs:
        name = public.get(port.name, port.name)
        if name in requested:
            declared[port.name] = requested[name]
        else:
            declared[port.name] = declared[port.like] if port.like else port.shape
    return declared


def _expect_inputs(graph: ir.Graph, ports: list[Port], name: str) -> None:
    found = [v.name for v in graph.inputs]
    if found != [p.name for p in ports]:
        raise RuntimeError(
            f"builder of {name!r} takes inputs {found}, its catalogue entry declares "
            f"{[p.name for p in ports]}"
        )


def _keep_outputs(graph: ir.Graph, ports: list[Port], name: str) -> None:
    produced = {v.name: v for v in graph.outputs}
    missing = [p.name for p in ports if p.name not in produced]
    if missing:
        raise RuntimeError(f"builder of {name!r} does not produce the outputs {missing}")
    graph.outputs.clear()
    graph.outputs.extend(produced[p.name] for p in ports)


def _declare(value: ir.Value, port: Port, shape: tuple[Dim, ...] | None, ctx: BuildContext):
    elem = onnx.TensorProto.INT64 if port.integer else ctx.elem_type
    value.type = ir.TensorType(ir.DataType(elem))
    value.shape = None if shape is None else ir.Shape(shape)


def _declare_inferred_outputs(proto: onnx.ModelProto, outputs: list[Port]) -> None:
    """Give outputs declared without a shape the type onnx shape inference finds."""
    pending = {p.name for p in outputs if p.shape is None and p.like is None}
    if not pending:
        return
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    types = {v.name: v.type for v in (*inferred.graph.output, *inferred.graph.value_info)}
    for out in proto.graph.output:
        if out.name in pending and types.get(out.name, onnx.TypeProto()).HasField("tensor_type"):
            out.type.CopyFrom(types[out.name])


def _default_to_one(
    proto: onnx.ModelProto, name: str, shape: tuple[Dim, ...], ctx: BuildContext
) -> None:
    """Give input ``name`` a default of ones (an initializer of the same name, which a fed
    value overrides): a graph run without sample weights weighs every sample 1. The default
    has the declared shape, each symbolic dimension 1 (``[1]`` for ``[N]``)."""
    dims = [d if isinstance(d, int) else 1 for d in shape]
    ones = onnx.numpy_helper.from_array(np.ones(dims, dtype=ctx.dtype), name)
    proto.graph.initializer.append(ones)


def _min_ir_version(opset: int) -> int:
    return onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", opset)])
