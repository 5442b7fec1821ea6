"""A loss graph turned back into one score per observation (the seeds' ``unreduced_onnx_loss``)."""

from __future__ import annotations

import onnx
from onnx import ModelProto, NodeProto, helper

from onnxgrad._onnx_utils import ModelLike, default_opset, finalize_model, load_model
from onnxgrad.graph._builder import GraphBuilder
from onnxgrad.graph.select import prune_graph

#: reductions a loss may end in; the per-observation score reduces the same way over each row
_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceSumSquare")
#: nodes that may sit between the reduction and the loss output without changing its value
_PASS_THROUGH = ("Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten")


def unreduced_onnx_loss(
    onx: ModelLike,
    output_name: str = "score",
    loss_name: str | None = None,
    per_row: bool = True,
) -> ModelProto:
    """The graph of ``onx`` computing the loss of every observation instead of their total.

    The loss output (``loss_name``, default: the first output) must be computed by one
    ``ReduceSum``, ``ReduceMean`` or ``ReduceSumSquare`` of a tensor ``e`` of shape
    ``[N, ...]`` (followed by value-preserving reshapes only, no penalty): the result has
    the one output ``output_name`` of shape ``[N, 1]``, ``s_i = sum_j e_ij`` (``mean_j``,
    ``sum_j e_ij^2`` for the other two). So ``s`` sums to the loss of the reduction
    ``'sum'`` (with sample weights ``w``, ``e`` is already ``w_i e_i``). Raises
    ``ValueError`` naming the node that is not such a reduction. When shape inference shows
    one value per row (``[N]`` or ``[N, 1, ...]``), the row reduction is the identity and
    the graph has none (``s_i = e_i``, ``e_i^2``).

    ``per_row=False`` returns the terms themselves, ``e`` flattened to ``[N, K]``
    (``e_ij^2`` for ``ReduceSumSquare``), onnxcustom's form: one score a row only when the
    loss has one column; with ``ReduceSum`` they sum to the loss.
    """
    model = load_model(onx)
    graph = model.graph
    names = [o.name for o in graph.output]
    loss_name = names[0] if loss_name is None else loss_name
    if loss_name not in names:
        raise ValueError(f"unknown loss output {loss_name!r}, the outputs are {names}")
    node = _final_reduction(graph.node, loss_name)
    elem_type = next(o for o in graph.output if o.name == loss_name).type.tensor_type.elem_type
    if output_name in {i.name for i in graph.input}:
        raise ValueError(f"output_name={output_name!r} is already an input of the graph")
    builder = GraphBuilder(graph, default_opset(model), prefix=output_name)
    single = _one_value_per_row(model, node.input[0])
    rows = builder.op("Flatten", node.input[0], axis=1, hint="rows")
    if node.op_type == "ReduceSumSquare":
        rows = builder.op("Mul", rows, rows, hint="squares")
    if single or not per_row:
        builder.op("Identity", rows, out=output_name)
    else:
        op_type = "ReduceMean" if node.op_type == "ReduceMean" else "ReduceSum"
        builder.reduce(op_type, rows, axes=[1], keepdims=1, out=output_name)
    del graph.output[:]
    columns = 1 if single or per_row else None
    graph.output.append(helper.make_tensor_value_info(output_name, elem_type, [None, columns]))
    prune_graph(graph, keep_inputs=True)
    return finalize_model(model)


def _one_value_per_row(model: ModelProto, name: str) -> bool:
    """Whether inference gives ``name`` a known shape ``[N, 1, ..., 1]`` (or ``[N]``)."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    infos = [*inferred.value_info, *inferred.input, *inferred.output]
    info = next((v for v in infos if v.name == name), None)
    if info is None or not info.type.tensor_type.HasField("shape"):
        return False
    dims = info.type.tensor_type.shape.dim[1:]
    return len(info.type.tensor_type.shape.dim) >= 1 and all(
        d.HasField("dim_value") and d.dim_value == 1 for d in dims
    )


def _final_reduction(nodes, loss_name: str) -> NodeProto:
    producers = {out: node for node in nodes for out in node.output}
    node = producers.get(loss_name)
    while node is not None and node.op_type in _PASS_THROUGH:
        node = producers.get(node.input[0])
    if node is None or node.op_type not in _REDUCTIONS or _reduces_some_axes(node):
        found = "an input or initializer" if node is None else f"{node.op_type} {node.name!r}"
        raise ValueError(
            f"loss {loss_name!r} is computed by {found}, not by one reduction over every axis "
            f"({', '.join(_REDUCTIONS)}): no per-observation score to expose"
        )
    return node


def _reduces_some_axes(node: NodeProto) -> bool:
    """A reduction given explicit axes (an attribute or a second input) is not the total."""
    return (len(node.input) > 1 and bool(node.input[1])) or any(
        a.name == "axes" for a in node.attribute
    )


__all__ = ["unreduced_onnx_loss"]
