r"""One runtime adapter model that picks, per run, the cheaper way to apply the fed adapters.

:func:`onnxgrad.graph.lora_runtime.runtime_adapter_model` builds the same deployed model two
ways: ``"branch"`` adds ``s (x A) B`` beside each product (``M r (K + N)`` for ``M`` rows),
``"weights"`` updates the weights once per run (``K N r``, and over quantized weights a few
passes over ``K x N`` to quantize them again), whatever ``M``. :func:`chosen_per_run` puts
both in one ``If`` of standard ONNX, decided by the rows ``M`` of an adapted product's
activation ``x`` (``K`` values a row), a shape known only at run time (batch x sequence):

    If(M > T, weights body, branch body),
    T = sum_w c_w r_w K_w N_w / sum_p r_p (K_p + N_p)

(``w`` the updated weights, ``p`` the branches' products, ``c_w`` the measured cost of one
update's multiply-add against a branch's, :data:`UPDATE_COST`). ``M`` is counted from the
graph inputs' dimensions where onnx's shape inference gives ``x``'s leading dimensions their
names (``batch x sequence``: ``Shape``, ``Gather``, ``Mul``), else as ``Size(x) / K`` after
the nodes computing ``x``, which then run outside the ``If`` (those the two models compute
alike). Each body is one whole model; both read the outer initializers and inputs (the
deployed weights stored once, the adapters still overridable inputs), but for copies of the
scalars and vectors (scales, zero points, biases) onnxruntime's fusions need as constants of
their own graph. onnxruntime optimizes each body as it does the model alone (the same fused
kernels); running a body costs about 0.2 us a node more than the main graph (1.32, one thread).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import ModelProto, NodeProto, helper, numpy_helper

from onnxgrad._onnx_utils import NameScope, all_names, default_opset, subgraphs, weightless_view
from onnxgrad.graph._scopes import node_inputs

#: the cost of a weight update's multiply-add of ``K N r`` against a branch's, by how the
#: weight is stored (measured: ``benchmarks/bench_round_trip.py``, docs/deployed-models.md)
UPDATE_COST = {"float": 1.0, "int8": 4.0, "qdq": 16.0, "nbits": 48.0}
#: the largest share of a dense ``Conv``'s multiply-adds its branch may add and still run
#: faster than the ``Conv`` over an updated kernel (which onnxruntime cannot reorder into its
#: blocked layout at session creation; :func:`conv_branch_pays`)
CONV_BRANCH_SHARE = 0.04
#: the name of the nodes choosing (``CHOOSER/...``, the ``If`` last)
CHOOSER = "adapters_chosen_per_run"
#: operators onnxruntime's QDQ passes propagate a quantization pair over, or fuse
MOVABLE = frozenset(
    {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Identity", "Cast"}
    | {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Gather", "Expand"}
    | {"MaxPool", "Resize", "Concat", "Split", "Shape", "Constant"}
)


def conv_branch_pays(
    groups: int, per_group: int, size: int, outputs: int, rank: int, strided: bool = False
) -> bool:
    """Whether a branch beside a ``Conv`` (:mod:`onnxgrad.graph.conv_branch`) runs faster
    than the ``Conv`` over its kernel updated per run, from ``(g, I/g, k, O)``
    (:func:`~onnxgrad.graph.conv_branch.conv_shape`), ``r`` and whether a stride exceeds 1.
    Both costs grow with the output positions, so the choice holds at any batch. Measured
    (``benchmarks/bench_conv_branch.py``, onnxruntime 1.19 and 1.32, one thread): the
    branch pays only beside a dense (``g = 1``), unstrided ``k > 1`` convolution whose
    branch is at most :data:`CONV_BRANCH_SHARE` of its multiply-adds,
    ``r (I k + O) <= 0.04 I k O``; beside a pointwise, strided, grouped or depthwise one, or
    a small one, the update is faster."""
    if groups != 1 or size == 1 or strided:
        return False
    return rank * (per_group * size + outputs) <= CONV_BRANCH_SHARE * per_group * size * outputs


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
    """One model running ``weights``' nodes when the adapted products read more than
    ``rows`` rows, ``branch``'s otherwise (module docstring); ``activations`` are the
    ``(x, K)`` of those products. ``branch`` itself where the two have the same nodes,
    below opset 11, or where no activation's rows can be counted before its product;
    ``weights`` or ``branch`` alone where its rows are static."""
    if _node_bytes(branch) == _node_bytes(weights) or default_opset(branch) < 11:
        return branch
    names = NameScope(all_names(branch.graph) | all_names(weights.graph))
    prefix: list[NodeProto] = []
    counted = _rows_of_inputs(deployed, activations, rows)
    if counted is None:
        point = _decision_point(branch, weights, activations)
        if point is None:
            return branch
        x, k, prefix = point
        counted = ([(x, None)], k, rows * k)
    factors, static, limit = counted
    if not factors:
        return weights if static > rows else branch
    condition, chooser = _more_rows_than(factors, limit, names)
    bodies = [_body(m, prefix, names, tag) for m, tag in ((weights, "weights"), (branch, "branch"))]
    outside = {o for node in prefix for o in node.output}
    written = {o for node in branch.graph.node for o in node.output} - outside
    chooser.append(
        helper.make_node(
            "If",
            [condition],
            [o.name for o in branch.graph.output if o.name in written],
            name=names.unique(f"{CHOOSER}/applied"),
            then_branch=bodies[0],
            else_branch=bodies[1],
        )
    )
    return _outer_model(branch, weights, prefix, chooser)


def _rows_of_inputs(deployed: ModelProto, activations, rows: int):
    """``(factors, static, limit)``: the rows of one activation ``x`` are ``static`` times
    the product of ``factors``, ``(graph input, axis)`` whose dimension names (onnx's
    shape inference) ``x``'s leading dimensions carry, so that it has more than ``rows``
    rows where that product exceeds ``limit``; ``None`` where no activation's are known."""
    inputs = {}
    for value in deployed.graph.input:
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param:
                inputs.setdefault(dim.dim_param, (value.name, axis))
    try:
        inferred = onnx.shape_inference.infer_shapes(weightless_view(deployed))
    except (onnx.shape_inference.InferenceError, ValueError):
        return None
    values = [*inferred.graph.input, *inferred.graph.value_info]
    shapes = {v.name: v.type.tensor_type for v in values}
    for x, _ in activations:
        known = shapes.get(x)
        if known is None or not known.HasField("shape") or len(known.shape.dim) < 2:
            continue
        leading = known.shape.dim[:-1]
        if all(d.dim_value > 0 or d.dim_param in inputs for d in leading):
            static = int(np.prod([d.dim_value for d in leading if d.dim_value > 0]))
            factors = [inputs[d.dim_param] for d in leading if d.dim_value <= 0]
            return factors, static, rows // static
    return None


def _more_rows_than(factors, limit: int, names: NameScope):
    """``(the condition, its nodes)``: the product of ``factors`` above ``limit``, each
    factor ``(value, axis)`` one dimension of ``value`` or, ``axis`` ``None``, its size.
    The nodes are named ``CHOOSER/...``."""
    nodes, product = [], None

    def name(base: str) -> str:
        return names.unique(f"{CHOOSER}/{base}")

    for value, axis in factors:
        size = name(f"{value}_rows")
        if axis is None:
            nodes.append(helper.make_node("Size", [value], [size], name=size))
        else:
            shape, index = name(f"{value}_shape"), name(f"{value}_axis")
            nodes.append(helper.make_node("Shape", [value], [shape], name=shape))
            nodes.append(_constant(index, axis))
            nodes.append(helper.make_node("Gather", [shape, index], [size], name=size))
        if product is not None:
            total = name("rows")
            nodes.append(helper.make_node("Mul", [product, size], [total], name=total))
            size = total
        product = size
    bound, condition = name("limit"), name("many_rows")
    nodes.append(_constant(bound, limit))
    nodes.append(helper.make_node("Greater", [product, bound], [condition], name=condition))
    return condition, nodes


def _constant(name: str, value: int) -> NodeProto:
    tensor = numpy_helper.from_array(np.asarray(value, dtype=np.int64))
    return helper.make_node("Constant", [], [name], name=name, value=tensor)


def _node_bytes(model: ModelProto) -> list[bytes]:
    return [node.SerializeToString() for node in model.graph.node]


def _decision_point(branch: ModelProto, weights: ModelProto, activations):
    """``(x, K, the nodes computing x)`` for the first activation whose ancestors in
    ``branch`` ``weights`` holds unchanged too (a convolution's kernel updated the same way
    in both included), or ``None``."""
    producers = {o: node for node in branch.graph.node for o in node.output}
    order = {id(node): i for i, node in enumerate(branch.graph.node)}
    other = {node.output[0]: node.SerializeToString() for node in weights.graph.node if node.output}
    candidates = sorted(
        dict(activations).items(), key=lambda item: order.get(id(producers.get(item[0])), -1)
    )
    for x, k in candidates:
        prefix = _ancestors(x, producers, order)
        if all(other.get(node.output[0]) == node.SerializeToString() for node in prefix):
            return x, k, prefix
    return None


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


def _body(model: ModelProto, prefix: list[NodeProto], names: NameScope, tag: str):
    """``model``'s nodes outside ``prefix`` as an ``If`` body: every value they write
    renamed (a body may not shadow the outer names), the graph outputs they write its
    outputs (an output that is an input, an initializer or written before the ``If`` stays
    as it is). The
    quantization and layout nodes of ``prefix`` it reads are computed again inside
    (:func:`_recomputed_reads`), the rank-0 and rank-1 initializers it reads copied in."""
    graph = model.graph
    outer = {o for node in prefix for o in node.output}
    nodes = [n for n in graph.node if not (n.output and n.output[0] in outer)]
    nodes = [*_recomputed_reads(prefix, nodes), *nodes]
    written = {o for n in nodes for o in n.output if o}
    renamed = {o: names.unique(f"{o}/{tag}") for o in written}
    read = {name for node in nodes for name in node_inputs(node)}
    overridable = {i.name for i in graph.input}
    own = [
        init
        for init in graph.initializer
        if init.name in read and len(init.dims) <= 1 and init.name not in overridable
    ]
    renamed.update({init.name: names.unique(f"{init.name}/{tag}") for init in own})
    body_nodes = [_renamed(node, renamed, names, tag) for node in nodes]
    outputs = []
    for output in graph.output:
        if output.name not in written:  # an input, initializer or outer value: no If output
            continue
        info = helper.make_empty_tensor_value_info(renamed[output.name])
        info.type.CopyFrom(output.type)
        outputs.append(info)
    infos = []
    for info in graph.value_info:
        if info.name in renamed:
            copy = helper.make_empty_tensor_value_info(renamed[info.name])
            copy.type.CopyFrom(info.type)
            infos.append(copy)
    initializers = [_renamed_tensor(init, renamed[init.name]) for init in own]
    return helper.make_graph(
        body_nodes, f"{graph.name}_{tag}", [], outputs, initializers, value_info=infos
    )


def _recomputed_reads(prefix: list[NodeProto], nodes: list[NodeProto]) -> list[NodeProto]:
    """The nodes of ``prefix`` that ``nodes`` read and that onnxruntime's quantization
    passes move or cross (:data:`MOVABLE`), with those they read in turn: a body computes
    them again (a pass over one activation each), so that no such pattern spans the ``If``
    boundary (one that does makes onnxruntime 1.32's ``QDQPropagationTransformer`` abort)."""
    producers = {o: node for node in prefix for o in node.output}
    wanted = [producers[n] for node in nodes for n in node_inputs(node) if n in producers]
    copied: dict[int, NodeProto] = {}
    while wanted:
        node = wanted.pop()
        if id(node) in copied or node.op_type not in MOVABLE:
            continue
        copied[id(node)] = node
        wanted.extend(producers[i] for i in node_inputs(node) if i in producers)
    return [node for node in prefix if id(node) in copied]


def _renamed_tensor(tensor, name: str):
    copy = type(tensor)()
    copy.CopyFrom(tensor)
    copy.name = name
    return copy


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
    read = {name for node in [*prefix, *chooser] for name in node_inputs(node)}
    read |= {i.name for i in graph.input} | {o.name for o in graph.output}
    kept = [init for init in graph.initializer if init.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    values = {o for node in prefix for o in node.output}
    infos = [info for info in graph.value_info if info.name in values]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    del graph.node[:]
    graph.node.extend([*prefix, *chooser])
    domains = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in weights.opset_import if o.domain not in domains)
    model.ir_version = max(branch.ir_version, weights.ir_version)
    return model


__all__ = [
    "CHOOSER",
    "CONV_BRANCH_SHARE",
    "UPDATE_COST",
    "chosen_per_run",
    "conv_branch_pays",
    "crossover_rows",
]
