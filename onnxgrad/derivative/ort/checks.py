"""What onnxruntime-training's gradient builder gets wrong, refused before and after it runs.

Each refused case was run through the builder (onnxruntime-training 1.19.2) and compared
with float64 central finite differences; every one returned a wrong gradient or an invalid
graph:

* ``BatchNormalization`` in inference mode is differentiated as in training mode (batch
  statistics);
* ``AveragePool`` with ``dilations``, with ``auto_pad``, or 3-D (1-D with a dynamic shape
  is refused by :func:`onnxgrad.derivative.ort.backend.check_static_pooling_shapes`);
* ``Conv`` with ``auto_pad`` ``SAME_LOWER`` or ``SAME_UPPER`` (asymmetric padding);
* ``Dropout`` with a mask output in inference mode (the gradient is masked as in training);
* ``ScatterElements``/``ScatterND`` with a ``reduction`` (the data keeps no gradient where
  updates land);
* ``Split`` with an output nothing reads (the gradient takes the shape of the used parts);
* an intermediate value that is also a graph output, read by a node on the gradient path
  (two gradients under one name: an invalid graph).

Only nodes on a path from a differentiated source to an output count. After the build,
every source the builder left without a gradient (zeros) is checked not to reach an output
through differentiable ops, and every gradient's static shape is checked against its
source's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from onnx import ModelProto, NodeProto, TensorProto, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES
from onnxgrad.graph._differentiable import differentiable_values, model_opsets, value_elem_types
from onnxgrad.graph._scopes import node_inputs

_SCATTERS = ("ScatterElements", "ScatterND")
FLOAT = TensorProto.FLOAT


def refuse_known_wrong_cases(model: ModelProto, sources: Sequence[str]) -> None:
    """``NotImplementedError`` naming the first builder case known to be wrong on the path
    from ``sources`` to the outputs of ``model``."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node_inputs(node):
            consumers[name] = consumers.get(name, 0) + 1
    constants = _constants(model)
    path = _nodes_on_path(model, sources)
    read_on_path = {name for node in path for name in node_inputs(node)}
    for node in path:
        case = _wrong_case(node, model, consumers, outputs & read_on_path, constants)
        if case:
            raise NotImplementedError(
                f"backend='ort': onnxruntime-training computes a wrong gradient for {case} "
                f"(node {node.name or node.output[0]!r}); use backend='onnx', the native "
                "engine, whose rules are checked against finite differences"
            )


def _nodes_on_path(model: ModelProto, sources: Iterable[str]) -> list[NodeProto]:
    """Nodes passing a gradient from a source to an output (float values, no ArgMax...)."""
    from onnxgrad.derivative.autodiff.registry import has_zero_gradient

    types = value_elem_types(model)
    nodes = list(model.graph.node)
    active = set(sources)
    for node in nodes:
        if has_zero_gradient(node.domain, node.op_type):
            continue
        if active.intersection(node_inputs(node)):
            active.update(o for o in node.output if types.get(o, FLOAT) in FLOAT_TYPES)
    needed = {o.name for o in model.graph.output}
    path = []
    for node in reversed(nodes):
        if needed.intersection(node.output) and active.intersection(node.output):
            needed |= node_inputs(node)
            path.append(node)
    return path[::-1]


def _attr(node: NodeProto, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            from onnx import helper

            value = helper.get_attribute_value(attribute)
            return value.decode() if isinstance(value, bytes) else value
    return default


def _constants(model: ModelProto) -> dict:
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and _attr(node, "value") is not None:
            values[node.output[0]] = numpy_helper.to_array(_attr(node, "value"))
    return values


def _wrong_case(node, model, consumers, read_outputs, constants) -> str | None:
    """``read_outputs``: the graph outputs a node on the gradient path reads."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        return None
    if op == "BatchNormalization" and _batch_norm_inference(node, model):
        return "BatchNormalization in inference mode"
    if op == "AveragePool":
        if any(d != 1 for d in _attr(node, "dilations", [])):
            return "AveragePool with dilations"
        if _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", ""):
            return "AveragePool with auto_pad"
        if len(_attr(node, "kernel_shape", [])) == 3:
            return "3-D AveragePool"
    if op == "Conv" and _attr(node, "auto_pad", "NOTSET") in ("SAME_LOWER", "SAME_UPPER"):
        return f"Conv with auto_pad={_attr(node, 'auto_pad')}"
    if op == "Dropout" and _dropout_mask_in_inference(node, constants):
        return "Dropout with a mask output in inference mode"
    if op in _SCATTERS and _attr(node, "reduction", "none") != "none":
        return f"{op} with reduction={_attr(node, 'reduction')}"
    graph_outputs = {o.name for o in model.graph.output}
    if op == "Split" and any(
        not name or (consumers.get(name, 0) == 0 and name not in graph_outputs)
        for name in node.output
    ):
        return "Split with unused outputs"
    also_outputs = [o for o in node.output if o in read_outputs]
    if also_outputs:
        return f"the intermediate value {also_outputs[0]!r}, also a graph output"
    return None


def _batch_norm_inference(node: NodeProto, model: ModelProto) -> bool:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset >= 14:
        return not _attr(node, "training_mode", 0)
    return len([o for o in node.output if o]) == 1


def _dropout_mask_in_inference(node: NodeProto, constants: dict) -> bool:
    if len(node.output) < 2 or not node.output[1]:
        return False
    if len(node.input) < 3 or not node.input[2]:
        return True
    mode = constants.get(node.input[2])
    return mode is not None and not bool(mode)


def check_built_gradients(
    model: ModelProto, gradients: dict[str, str | None], sources: Sequence[str]
) -> None:
    """Refuse zeros for a source that reaches an output through differentiable ops."""
    skipped = [s for s in sources if gradients.get(s) is None]
    if not skipped:
        return
    live = differentiable_values(model.graph, model_opsets(model), value_elem_types(model))
    wrong = [s for s in skipped if s in live]
    if wrong:
        raise NotImplementedError(
            f"backend='ort': onnxruntime-training returned no gradient for {wrong}, which "
            "reach an output through differentiable ops: a zero gradient would be wrong; "
            "use backend='onnx'"
        )


def check_gradient_shapes(result: ModelProto, model: ModelProto, sources: Sequence[str]) -> None:
    """Each ``<source>_grad`` output has its source's static shape (where both are known)."""
    shapes = {}
    graph = model.graph
    for info in [*graph.input]:
        shapes[info.name] = _dims(info)
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    declared = {o.name: _dims(o) for o in result.graph.output}
    for source in sources:
        expected, got = shapes.get(source), declared.get(f"{source}_grad")
        if _static(expected) and _static(got) and expected != got:
            raise NotImplementedError(
                f"backend='ort': onnxruntime-training's gradient of {source!r} has shape "
                f"{list(got)}, {source!r} has shape {list(expected)}; use backend='onnx'"
            )


def _dims(info) -> tuple | None:
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)


def _static(dims) -> bool:
    return dims is not None and all(d is not None for d in dims)
