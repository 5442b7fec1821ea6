"""Raising a model's default-domain opset with onnx's version converter, and putting back
what the converter loses on the way:

* ``Upsample`` and ``Resize`` before opset 11 sample at ``i / scale`` (asymmetric), and
  onnxruntime's nearest reads ``ceil`` on the axes a node shrinks, ``floor`` on the others;
  the converter's Resize-11 takes the defaults (half_pixel, round_prefer_floor): the
  coordinates and rounding are set back (:func:`_keep_upsample_coordinates`);
* an opset-8 ``Scan`` has a batch axis that the converter drops from the graph's declared
  inputs and outputs: a batch of 1 is squeezed off the Scan instead (:func:`_unbatch_scans`),
  other batches are refused by name;
* the converter infers every value's shape and declares it: from a declared ``-1``
  (PaddlePaddle's dynamic dimension) it derives sizes 0 and below, which onnxruntime's
  layout optimisations then reject (``Invalid Target shape product of 0``): negative
  declared dimensions are made unknown first (:func:`dynamic_dims`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import ModelProto, NodeProto, helper

from onnxgrad._onnx_utils import default_opset, normalize_domain
from onnxgrad.graph._scopes import iter_graphs
from onnxgrad.graph.declared_dims import dynamic_dims


def raised_opset(model: ModelProto, opset: int) -> ModelProto:
    """A copy of ``model`` converted to default-domain ``opset`` by onnx's version converter,
    or a ``ValueError`` naming both opsets and the converter's reason (or the nearest Resize
    below opset 11 whose rounding the raised graph cannot reproduce)."""
    batched = _batched_scans(model)
    copy = ModelProto()
    copy.CopyFrom(model)
    dynamic_dims(copy)
    try:
        converted = onnx.version_converter.convert_version(deduplicated_opsets(copy), opset)
        onnx.checker.check_model(converted)
    except Exception as exc:  # the converter raises RuntimeError, the checker ValidationError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"the model imports default-domain opset {default_opset(model)}, this needs opset "
            f">= {opset}, and onnx's version converter could not raise it ({reason}); "
            f"convert the model to opset {opset} or later"
        ) from exc
    if default_opset(model) < 11 <= opset:
        _keep_upsample_coordinates(
            converted.graph, sizes=_inferred_dims(converted), upsampled=_upsampled(model)
        )
    if batched:
        _unbatch_scans(converted, model, batched, opset)
        onnx.checker.check_model(converted)
    return converted


def _batched_scans(model: ModelProto) -> list[NodeProto]:
    """The Scan nodes of an opset-8 model (they have a batch axis), which the conversion
    must unbatch: only in the main graph, without ``sequence_lens``, with a batch of 1
    (refused by name otherwise)."""
    if default_opset(model) >= 9:
        return []
    scans = []
    sizes = _batch_sizes(model)
    for graph in iter_graphs(model.graph):
        for node in graph.node:
            if node.op_type != "Scan" or normalize_domain(node.domain):
                continue
            where = f"Scan node {node.name or node.output[0]!r} at opset {default_opset(model)}"
            if graph is not model.graph or (node.input and node.input[0]):
                raise NotImplementedError(
                    f"{where}: no gradient for a batched Scan inside a subgraph or with "
                    f"sequence_lens (only batches of 1 are rewritten as an opset-9 Scan)"
                )
            if any(sizes.get(name) != 1 for name in node.input[1:]):
                raise NotImplementedError(
                    f"{where}: no gradient for a batched Scan whose batch is not a static 1 "
                    f"(only batches of 1 are rewritten as an opset-9 Scan)"
                )
            scans.append(node)
    return scans


def _batch_sizes(model: ModelProto) -> dict[str, int | None]:
    """The static size of axis 0 of every value shape inference types."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # unknown sizes: the batched Scans are refused
        inferred = model
    sizes = {}
    for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        dims = info.type.tensor_type.shape.dim
        sizes[info.name] = dims[0].dim_value if dims and dims[0].HasField("dim_value") else None
    return sizes


def _unbatch_scans(
    converted: ModelProto, original: ModelProto, scans: list[NodeProto], opset: int
) -> None:
    """onnx's converter keeps an opset-8 Scan node as is and drops the batch axis from the
    graph's declared inputs and outputs; the batch of 1 is squeezed off the Scan's inputs
    and put back on its outputs instead, and the original declarations restored."""
    batched_outputs = {o for node in scans for o in node.output if o}
    graph = converted.graph
    nodes = []
    for node in graph.node:
        if node.op_type != "Scan" or not set(node.output) & batched_outputs:
            nodes.append(node)
            continue
        squeezed = [f"{name}__unbatched" for name in node.input]
        for source, target in zip(node.input, squeezed):
            nodes += _axis_op("Squeeze", source, target, opset)
        batched = list(node.output)
        node.input[:] = squeezed
        node.output[:] = [f"{name}__unbatched" for name in batched]
        nodes.append(node)
        for source, target in zip(node.output, batched):
            nodes += _axis_op("Unsqueeze", source, target, opset)
    del graph.node[:]
    graph.node.extend(nodes)
    for field in ("input", "output"):
        del getattr(graph, field)[:]
        getattr(graph, field).extend(getattr(original.graph, field))
    del graph.value_info[:]


def _axis_op(op_type: str, source: str, target: str, opset: int) -> list[NodeProto]:
    """``op_type`` (Squeeze or Unsqueeze) of axis 0, as the opset takes its axes."""
    if opset >= 13:
        axes = helper.make_node(
            "Constant", [], [f"{target}__axes"], value=onnx.numpy_helper.from_array(np.array([0]))
        )
        return [axes, helper.make_node(op_type, [source, f"{target}__axes"], [target])]
    return [helper.make_node(op_type, [source], [target], axes=[0])]


def _upsampled(model: ModelProto) -> set[str]:
    """The outputs of the model's Upsample nodes (onnxruntime refuses their scales < 1)."""
    return {
        node.output[0]
        for graph in iter_graphs(model.graph)
        for node in graph.node
        if node.op_type == "Upsample" and not normalize_domain(node.domain)
    }


def _keep_upsample_coordinates(
    graph, constants: dict | None = None, sizes=None, upsampled: frozenset = frozenset()
) -> None:
    """Upsample and Resize before opset 11 sample at ``i / scale`` (asymmetric); onnxruntime's
    nearest then reads ``x[ceil(i / s)]`` on an axis with ``s < 1`` and ``x[floor(i / s)]`` on
    the others (its ``simple`` nearest mode; an axis with ``s == 1`` is copied). onnx's
    converter turns them into Resize-11 nodes without those attributes, whose defaults
    (half_pixel, round_prefer_floor) compute another function: the coordinates are set back,
    with ``nearest_mode`` ceil when every resized axis shrinks, floor when none does, and a
    nearest node whose scales both shrink and grow axes becomes two chained Resize nodes
    (ceil for the shrinking axes, then floor for the growing ones). A nearest Resize-10 needs
    constant scales (a ``ValueError`` names it otherwise); one from an Upsample (whose
    ``upsampled`` output onnxruntime computes only for scales >= 1) takes the floor."""
    constants = dict(constants or {})
    constants.update({t.name: t for t in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant" and not normalize_domain(node.domain):
            for attribute in node.attribute:
                if attribute.name == "value":
                    constants[node.output[0]] = attribute.t
    if sizes is None:
        sizes = {}
    sizes = {**sizes, **_declared_dims(graph)}
    nodes: list[NodeProto] = []
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _keep_upsample_coordinates(attribute.g, constants, sizes, upsampled)
        if node.op_type != "Resize" or normalize_domain(node.domain):
            nodes.append(node)
            continue
        present = {a.name: a for a in node.attribute}
        if "coordinate_transformation_mode" not in present:
            node.attribute.append(
                helper.make_attribute("coordinate_transformation_mode", "asymmetric")
            )
        mode = present["mode"].s.decode() if "mode" in present else "nearest"
        if "nearest_mode" in present or mode != "nearest":
            nodes.append(node)
            continue
        if node.output[0] in upsampled:
            node.attribute.append(helper.make_attribute("nearest_mode", "floor"))
            nodes.append(node)
            continue
        nodes += _simple_nearest(graph, node, constants, sizes)
    del graph.node[:]
    graph.node.extend(nodes)


def _declared_dims(graph) -> dict[str, list]:
    """``{name: [int or None per axis]}`` for every value whose shape the graph declares."""
    dims = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            dims[info.name] = [
                d.dim_value if d.HasField("dim_value") else None
                for d in info.type.tensor_type.shape.dim
            ]
    return dims


def _inferred_dims(model: ModelProto) -> dict[str, list]:
    """:func:`_declared_dims` of the main graph after shape inference (none if it fails)."""
    try:
        return _declared_dims(onnx.shape_inference.infer_shapes(model).graph)
    except Exception:  # inference is only used to prove that an axis grows
        return {}


def _simple_nearest(graph, node: NodeProto, constants: dict, sizes: dict) -> list[NodeProto]:
    """The nodes computing onnxruntime's opset-10 nearest Resize ``node`` (see
    :func:`_keep_upsample_coordinates`)."""
    label = node.name or node.output[0]
    source = node.input[2] if len(node.input) > 2 else ""
    if source not in constants:
        raise ValueError(
            f"Resize/Upsample node {label!r} (nearest, opset < 11) has scales {source!r} "
            "that are not a constant: onnxruntime rounds up on the axes it shrinks and down "
            "on the others, which the raised opset can only express for constant scales"
        )
    scales = onnx.numpy_helper.to_array(constants[source]).astype(np.float32).ravel()
    shrinks, grows = scales < 1, scales > 1
    if not (shrinks.any() and grows.any()):
        node.attribute.append(
            helper.make_attribute("nearest_mode", "ceil" if shrinks.any() else "floor")
        )
        return [node]
    dims = sizes.get(node.input[0])
    grown = (
        dims is not None
        and len(dims) == len(scales)
        and any(
            d is not None and int(np.float32(s) * np.float32(d)) > d
            for d, s in zip(dims, scales)
            if s > 1
        )
    )
    if not (grown or (scales[grows] >= 2).any()):
        raise ValueError(
            f"Resize/Upsample node {label!r} (nearest, opset < 11) shrinks some axes and grows "
            f"others (scales {scales.tolist()}), no growing axis provably changing the size of "
            f"{node.input[0]!r}: onnxruntime reads it with ceil on the shrinking axes and "
            "floor on the others, which takes two Resize nodes, and onnxruntime copies a "
            "Resize input whose shape does not change instead of sampling it"
        )
    intermediate = f"{node.output[0]}__shrunk"
    down, up = f"{intermediate}_scales", f"{node.output[0]}__grown_scales"
    graph.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.where(shrinks, scales, 1).astype(np.float32), down),
            onnx.numpy_helper.from_array(np.where(grows, scales, 1).astype(np.float32), up),
        ]
    )
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    roi = node.input[1]
    return [
        helper.make_node(
            "Resize", [node.input[0], roi, down], [intermediate], name=f"{label}__shrink",
            **{**attributes, "nearest_mode": "ceil"},
        ),
        helper.make_node(
            "Resize", [intermediate, roi, up], list(node.output), name=f"{label}__grow",
            **{**attributes, "nearest_mode": "floor"},
        ),
    ]  # fmt: skip


def deduplicated_opsets(model: ModelProto) -> ModelProto:
    """One import per domain (skl2onnx may list the default domain twice)."""
    versions: dict[str, int] = {}
    for op in model.opset_import:
        domain = normalize_domain(op.domain)
        versions[domain] = max(versions.get(domain, 0), op.version)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in versions.items())
    return model
