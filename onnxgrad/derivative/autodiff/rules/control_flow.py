r"""Control flow: ``If``, ``Scan`` and ``Loop``.

**If.** A branch reads outer values ``u`` (its captured inputs); for
``y = If(c, f(u), h(u))``

.. math:: \bar u = \mathrm{If}(c,\; (\partial f / \partial u)^\top \bar y,\;
          (\partial h / \partial u)^\top \bar y)

Each branch of the gradient ``If`` recomputes its forward branch and appends the backward
nodes a nested engine emits for it; a branch that does not depend on some ``u`` returns
zeros of ``u``'s shape, so both branches return the same values.

**Scan and Loop.** A body ``(s_t, x_t) -> (s_{t+1}, y_t)`` reading outer values ``c`` runs
for ``t = 0 .. T-1``. Reverse mode runs its vector-Jacobian product backwards in time:

.. math:: (\bar s_t, \bar x_t, \delta\bar c) = \mathrm{body}_t^\top(\bar s_{t+1}, \bar y_t),
          \qquad \bar c = \textstyle\sum_t \delta\bar c

The forward node keeps what this needs: the state entering every iteration (for ``Loop``
also the iteration number and the condition) is appended to it as extra scan outputs by the
rule's forward hook. The gradient is one ``Scan`` over the saved states, the inputs ``x``
and the output gradients ``\bar y`` in the opposite direction; its body recomputes the
forward body for one step and appends the backward nodes a nested engine (the same rules)
emits for it; its states are ``\bar s`` and the running sums ``\bar c``, its scan outputs
``\bar x`` (written in the opposite direction too, so they land where ``x_t`` was read).
The result is a standard ``Scan`` of standard ops, so it can be differentiated again; nested
Scan/Loop/If bodies are handled by the same rules inside the nested engine. Loop-carried
values must keep their shape across iterations (they are stacked).

onnxruntime's Scan requires a rank for every body output, and transposing the backward Scan
again (forward mode, Hessian-vector products) makes outputs of its inputs: so every body
input and output of the backward Scan is typed, from the forward node's outer values, else
from what inference gives the forward body (a carried value of unknown rank takes its body
output's shape, an output gradient slice its body output's), else from inference of the
backward body itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import GraphProto, NodeProto, TensorProto, ValueInfoProto, helper, numpy_helper

from onnxgrad._onnx_utils import FLOAT_TYPES, NameScope, replace_repeated, zeros_like_nodes
from onnxgrad.derivative.autodiff.builder import GradBuilder, NodeView
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.value_types import ValueType, infer_subgraph_types, value_info
from onnxgrad.graph._scopes import free_names
from onnxgrad.graph.select import prune_graph


# -- If ---------------------------------------------------------------------------------------
@register("If", since=13)
def if_grad(b, node, grads, needs):
    n_inputs = len(node.inputs)
    sources = [name for name, need in zip(node.captured, needs[n_inputs:]) if need]
    if not sources:
        return []
    typed = _branches_agree(b, node)
    branches = {
        attr: _branch_gradient(b, node, node.attr(attr), grads, sources, typed)
        for attr in ("then_branch", "else_branch")
    }
    results = b.op("If", node.inputs[0], outputs=len(sources), **branches)
    by_source = dict(zip(sources, [results] if len(sources) == 1 else results))
    return [None] * n_inputs + [by_source.get(name) for name in node.captured]


def _branch_gradient(
    b: GradBuilder,
    node: NodeView,
    branch: GraphProto,
    grads: list,
    sources: list[str],
    typed: bool,
) -> GraphProto:
    """The branch's forward nodes, then its backward nodes, returning one gradient per
    source (zeros where the branch does not depend on it), declared with the source's shape
    when ``typed``, else with its element type only. The branch's declared types stay with
    its forward nodes: the ranks normalisation refined where inference stops are what a
    second derivative of this gradient reads."""
    seeds = {out.name: g for out, g in zip(branch.output, grads) if g is not None}
    backward, gradients = b.differentiate_subgraph(branch, sources, seeds)
    outputs, tail = [], []
    for source in sources:
        name = b.unique_name(f"{source}_branch_grad")
        tail += _result_nodes(b, source, gradients[source], name)
        value = b.value_type(source)
        outputs.append(value_info(name, value if typed else ValueType(value.elem_type, None)))
    graph = helper.make_graph(
        [*branch.node, *backward, *tail],
        b.unique_name(f"{branch.name or 'branch'}_grad"),
        [],
        outputs,
        list(branch.initializer),
        value_info=list(branch.value_info),
    )
    prune_graph(graph, keep_inputs=True)
    return graph


def _branches_agree(b: GradBuilder, node: NodeView) -> bool:
    """Whether both branches' outputs have known and equal ranks. Where they differ (an
    ``If`` that squeezes an unbatched input and leaves a batched one as it is), the output's
    rank is fixed by its uses and one branch never runs with it: shape inference of that
    branch's gradient gives ranks that contradict the sources' types, so the gradient
    branches then declare element types only."""
    then, other = (_output_ranks(b, node.attr(a)) for a in ("then_branch", "else_branch"))
    return None not in then and then == other


def _output_ranks(b: GradBuilder, branch: GraphProto) -> list[int | None]:
    types = _subgraph_types(b, branch)
    ranks = []
    for out in branch.output:
        value = types.get(out.name)
        ranks.append(None if value is None or value.shape is None else len(value.shape))
    return ranks


def _subgraph_types(b: GradBuilder, graph: GraphProto) -> dict[str, ValueType]:
    """The types shape inference gives the values of ``graph`` (a branch or a body), its
    outer values typed (and valued, where constant) as in the enclosing graph."""
    types = {n: b.value_type(n) for n in free_names(graph) if b.has_type(n)}
    constants = {}
    for name in free_names(graph):
        value = b.constant_value(name)
        if value is not None:
            constants[name] = numpy_helper.from_array(value, name)
    infer_subgraph_types(graph, types, b.opset, constants)
    return types


def _result_nodes(b: GradBuilder, source: str, grad: str | None, name: str) -> list[NodeProto]:
    if grad is None:
        return zeros_like_nodes(source, name, b.dtype(source), b.names, b.node_names)
    return [helper.make_node("Identity", [grad], [name], name=b.unique_node_name("Identity"))]


# -- what the forward pass keeps ----------------------------------------------------------------
def _body(node: NodeProto) -> GraphProto:
    return next(a.g for a in node.attribute if a.name == "body")


def _save_body_inputs(
    node: NodeProto, inputs: list[ValueInfoProto], scope: NameScope, rows: bool = False
) -> None:
    """Append every body input in ``inputs`` as a scan output of ``node`` (stacked along
    axis 0 in iteration order); with ``rows``, each is saved as a ``[1, size]`` row."""
    body = _body(node)
    if rows:
        row_shape = scope.unique("row_shape")
        shape = helper.make_tensor(row_shape, TensorProto.INT64, [2], [1, -1])
        body.node.append(helper.make_node("Constant", [], [row_shape], value=shape))
    for info in inputs:
        inner = scope.unique(f"{info.name}_saved")
        if rows:
            saving = helper.make_node("Reshape", [info.name, row_shape], [inner])
        else:
            saving = helper.make_node("Identity", [info.name], [inner])
        saving.name = inner  # a fresh value name: no node of any graph has it
        body.node.append(saving)
        saved = ValueInfoProto()
        saved.CopyFrom(info)
        saved.name = inner
        if rows and info.type.tensor_type.elem_type:
            saved.CopyFrom(value_info(inner, ValueType(info.type.tensor_type.elem_type, (1, None))))
        elif rows:
            saved.ClearField("type")  # an untyped input (function bodies): inferred
        body.output.append(saved)
        node.output.append(scope.unique(f"{info.name}_stacked"))


def _save_scan_states(node: NodeProto, scope: NameScope) -> None:
    """The forward Scan also returns the state entering each iteration."""
    n_states = len(node.input) - NodeView(node, 0).attr("num_scan_inputs")
    _save_body_inputs(node, list(_body(node).input[:n_states]), scope)
    for attr in node.attribute:
        if attr.name in ("scan_output_axes", "scan_output_directions"):
            attr.ints.extend([0] * n_states)


def _save_loop_states(node: NodeProto, scope: NameScope) -> None:
    """The forward Loop also returns, per iteration, its number, condition and state, as
    ``[1, size]`` rows: onnx's reference evaluator stacks Loop scan outputs with
    ``numpy.vstack``, which only agrees with the specification (and onnxruntime) on them."""
    _save_body_inputs(node, list(_body(node).input), scope, rows=True)


# -- the reverse scan ---------------------------------------------------------------------------
@dataclass
class _Stream:
    """A sequence the backward Scan reads slice by slice into body input ``inner``."""

    outer: str
    inner: ValueInfoProto
    axis: int
    direction: int


@dataclass
class _Carried:
    """A float state: body input, body output, gradient of its final value (outer)."""

    inner: ValueInfoProto
    output: str
    seed: str


def _info_type(info: ValueInfoProto) -> ValueType:
    tensor = info.type.tensor_type
    if not tensor.HasField("shape"):
        return ValueType(tensor.elem_type, None)
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tensor.shape.dim
    )
    return ValueType(tensor.elem_type, dims)


def _typed_like(
    b: GradBuilder, node: NodeView, info: ValueInfoProto, outer: str | None, elem_type=None
):
    """A Loop body input typed like its initial value ``outer`` (or ``elem_type``) where
    its declaration lacks the element type or shape (inference leaves a carried value's
    shape unknown since it could change; the saved stack requires it does not)."""
    tensor = info.type.tensor_type
    if tensor.elem_type and tensor.HasField("shape"):
        return info
    if outer is not None and b.shape(outer) is not None:
        return value_info(info.name, _anonymous(b.value_type(outer)))
    if tensor.elem_type:
        return info
    if outer is not None and b.has_type(outer):
        elem_type = b.dtype(outer)
    if not elem_type:
        raise NotImplementedError(
            f"{node.op_type} node {node.name or node.outputs[0]!r}: the type of its body input "
            f"{info.name!r} is unknown"
        )
    return value_info(info.name, ValueType(elem_type, None))


def _typed_slice(b: GradBuilder, info: ValueInfoProto, outer: str, axis: int):
    """A Scan body's scan input typed like a slice of ``outer`` where its declaration lacks
    the element type or shape (function bodies leave them to inference)."""
    tensor = info.type.tensor_type
    if (tensor.elem_type and tensor.HasField("shape")) or not b.has_type(outer):
        return info
    return value_info(info.name, _anonymous(_slice_type(b, outer, axis)))


def _slice_type(b: GradBuilder, x: str, axis: int) -> ValueType | None:
    """The type of ``x`` without its ``axis`` (``None`` where ``x`` has no known type)."""
    if not b.has_type(x):
        return None
    value = b.value_type(x)
    if value.shape is None:
        return value
    shape = list(value.shape)
    del shape[axis % len(shape)]
    return ValueType(value.elem_type, tuple(shape))


def _anonymous(value: ValueType) -> ValueType:
    """``value`` without symbolic dims: symbols from separate shape inferences may share a
    name for different sizes, which onnxruntime rejects in a subgraph's declared types."""
    if value.shape is None:
        return value
    return ValueType(value.elem_type, tuple(d if isinstance(d, int) else None for d in value.shape))


def _is_float(info: ValueInfoProto) -> bool:
    return info.type.tensor_type.elem_type in FLOAT_TYPES


def _fresh_info(b: GradBuilder, base: str, value: ValueType) -> ValueInfoProto:
    name = b.unique_name(base)
    b.declare(name, value)
    return value_info(name, _anonymous(value))


def _body_types(b: GradBuilder, body: GraphProto, inputs: list[ValueInfoProto]):
    """The types inference gives the values of ``body`` with its inputs declared as
    ``inputs``."""
    typed = GraphProto()
    typed.CopyFrom(body)
    replace_repeated(typed.input, inputs)
    return _subgraph_types(b, typed)


def _typed_states(
    b: GradBuilder, body: GraphProto, inputs: list[ValueInfoProto], states: dict[int, str]
) -> tuple[list[ValueInfoProto], dict[str, ValueType]]:
    """``(inputs, types)``: the body inputs, where a carried state ``inputs[i]`` of unknown
    rank takes the shape inference gives the body output ``states[i]`` it becomes (a carried
    value keeps its shape across iterations: the saved stack requires it), and the types of
    the body's values with its inputs so declared."""
    types = _body_types(b, body, inputs)
    refined = list(inputs)
    for i, output in states.items():
        value, declared = types.get(output), _info_type(inputs[i])
        if declared.shape is None and value is not None and value.shape is not None:
            elem_type = declared.elem_type or value.elem_type
            refined[i] = value_info(inputs[i].name, _anonymous(ValueType(elem_type, value.shape)))
    if any(r is not i for r, i in zip(refined, inputs)):
        types = _body_types(b, body, refined)
    return refined, types


def _declare_output_shapes(b: GradBuilder, graph: GraphProto) -> None:
    """Body outputs declared without a shape get the one inference finds: onnxruntime's
    Scan requires a rank for every body output."""
    bare = [o for o in graph.output if not o.type.tensor_type.HasField("shape")]
    if not bare:
        return
    types = _subgraph_types(b, graph)
    for out in bare:
        value = types.get(out.name)
        if value is not None and value.shape is not None:
            elem_type = out.type.tensor_type.elem_type or value.elem_type
            out.CopyFrom(value_info(out.name, _anonymous(ValueType(elem_type, value.shape))))


def _reverse_scan(
    b: GradBuilder,
    body: GraphProto,
    carried: list[_Carried],
    streams: list[_Stream],
    output_seeds: list[tuple[str, str]],
    wanted: list[_Stream],
    captured: list[str],
    prologue: tuple[NodeProto, ...] = (),
) -> tuple[list[str], list[str], list[str]]:
    """The backward Scan: gradients of the carried states' initial values, of the ``wanted``
    scan inputs (``wanted[i].axis/direction`` place them) and of the ``captured`` values."""
    forward = GraphProto()
    forward.CopyFrom(body)
    typed = {i.name: i for i in [*(c.inner for c in carried), *(s.inner for s in streams)]}
    for info in forward.input:
        if info.name in typed and typed[info.name] is not info:
            info.CopyFrom(typed[info.name])  # inputs typed by the rule: inference needs them
    state_bars = [_fresh_info(b, f"{c.inner.name}_bar", _info_type(c.inner)) for c in carried]
    sums = [_fresh_info(b, f"{c}_bar_sum", b.value_type(c)) for c in captured]
    seeds: dict[str, list[str]] = {}
    for c, bar in zip(carried, state_bars):
        seeds.setdefault(c.output, []).append(bar.name)
    for output, bar in output_seeds:
        seeds.setdefault(output, []).append(bar)
    seed_nodes, seed_names = _sum_seeds(b, seeds)
    sources = list(dict.fromkeys([c.inner.name for c in carried] + [w.inner.name for w in wanted]))
    backward, grads = b.differentiate_subgraph(forward, sources + captured, seed_names)

    outputs, tail = [], []
    for c, bar in zip(carried, state_bars):
        outputs.append(_result(b, grads[c.inner.name], bar.name, _info_type(c.inner), tail))
    for c, acc in zip(captured, sums):
        total = acc.name if grads[c] is None else _node(b, tail, "Add", acc.name, grads[c])
        outputs.append(_result(b, total, acc.name, b.value_type(c), tail))
    for w in wanted:
        outputs.append(_result(b, grads[w.inner.name], w.inner.name, _info_type(w.inner), tail))

    graph = helper.make_graph(
        [*prologue, *forward.node, *seed_nodes, *backward, *tail],
        b.unique_name(f"{body.name or 'body'}_grad"),
        [*state_bars, *sums, *(s.inner for s in streams)],
        outputs,
        list(forward.initializer),
    )
    prune_graph(graph, keep_inputs=True)
    _declare_output_shapes(b, graph)
    initial = [c.seed for c in carried] + [b.zeros_like(c) for c in captured]
    inputs = [_read_plan(b, s) for s in streams]
    placed = [_write_plan(b, w) for w in wanted]
    results = b.op(
        "Scan",
        *initial,
        *(name for name, _, _ in inputs),
        outputs=len(outputs),
        body=graph,
        num_scan_inputs=len(streams),
        scan_input_axes=_unless_zero([axis for _, axis, _ in inputs]),
        scan_input_directions=_unless_zero([d for _, _, d in inputs]),
        scan_output_axes=_unless_zero([axis for axis, _ in placed]),
        scan_output_directions=_unless_zero([d for _, d in placed]),
    )
    results = [results] if len(outputs) == 1 else list(results)
    n, m = len(carried), len(captured)
    input_grads = [
        _from_time_major(b, g, w) if plan == (0, 0) else g
        for g, w, plan in zip(results[n + m :], wanted, placed)
    ]
    return results[:n], input_grads, results[n : n + m]


def _unless_zero(values: list[int]) -> list[int] | None:
    return values if any(values) else None


def _axis(b: GradBuilder, x: str, axis: int) -> int | None:
    """``axis`` made non-negative, ``None`` when that needs the unknown rank of ``x``."""
    if axis >= 0:
        return axis
    rank = b.rank(x)
    return None if rank is None else axis % rank


def _read_plan(b: GradBuilder, stream: _Stream) -> tuple[str, int, int]:
    """``(tensor, axis, direction)`` for the backward Scan to read ``stream``: the scan axis
    moved first and the sequence reversed with standard ops, so the Scan keeps the default
    axis 0 and forward direction, which every runtime supports (onnx's reference evaluator
    supports no other); the attributes stay where the rank is unknown."""
    axis = _axis(b, stream.outer, stream.axis)
    if axis is None or (axis and b.rank(stream.outer) is None):
        return stream.outer, stream.axis, stream.direction
    x = stream.outer
    if axis:
        rank = b.rank(x)
        x = b.op("Transpose", x, perm=[axis, *(i for i in range(rank) if i != axis)])
    if stream.direction:
        x = _reverse(b, x)
    return x, 0, 0


def _write_plan(b: GradBuilder, stream: _Stream) -> tuple[int, int]:
    """Scan attributes for a wanted gradient: ``(0, 0)`` when :func:`_from_time_major` can
    place it afterwards (known rank or axis 0)."""
    axis = _axis(b, stream.outer, stream.axis)
    if axis is None or (axis and b.rank(stream.outer) is None):
        return stream.axis, stream.direction
    return 0, 0


def _from_time_major(b: GradBuilder, g: str, stream: _Stream) -> str:
    """Undo :func:`_read_plan` on a gradient stacked along axis 0 in the Scan's order."""
    if stream.direction:
        g = _reverse(b, g)
    axis = _axis(b, stream.outer, stream.axis)
    if axis:
        rank = b.rank(stream.outer)
        g = b.op("Transpose", g, perm=[*range(1, axis + 1), 0, *range(axis + 1, rank)])
    return g


def _reverse(b: GradBuilder, x: str) -> str:
    """``x[::-1]`` along axis 0."""
    return b.op("Slice", x, b.ints([-1]), b.ints([-(2**63)]), b.ints([0]), b.ints([-1]))


def _sum_seeds(b: GradBuilder, seeds: dict[str, list[str]]):
    """One seed per body output (a sum where the output is used several times)."""
    nodes, names = [], {}
    for output, bars in seeds.items():
        names[output] = bars[0] if len(bars) == 1 else _node(b, nodes, "Sum", *bars)
        b.declare(names[output], b.value_type(bars[0]))
    return nodes, names


def _node(b: GradBuilder, nodes: list[NodeProto], op_type: str, *inputs: str) -> str:
    out = b.unique_name(f"{op_type}_out")
    nodes.append(helper.make_node(op_type, list(inputs), [out], name=b.unique_node_name(op_type)))
    return out


def _result(
    b: GradBuilder, grad: str | None, like: str, value: ValueType, nodes: list[NodeProto]
) -> ValueInfoProto:
    """A body output holding ``grad`` (zeros shaped like ``like`` for a symbolic zero)."""
    name = b.unique_name("grad_out")
    if grad is None:
        nodes += zeros_like_nodes(like, name, value.elem_type, b.names, b.node_names)
    else:
        nodes.append(
            helper.make_node("Identity", [grad], [name], name=b.unique_node_name("Identity"))
        )
    return value_info(name, _anonymous(value))


def _captured_sources(node: NodeView, needs: list[bool]) -> list[str]:
    return [c for c, need in zip(node.captured, needs[len(node.inputs) :]) if need]


def _output_gradient_streams(b, body_outputs, grads, axes, directions, types):
    """Streams of the given output gradients ``y_bar`` and the seeds they bind, each slice
    typed like the body output ``y_t`` (as declared, else as inferred in ``types``, the
    body's values), else like a slice of ``y_bar``."""
    streams, seeds = [], []
    for info, g, axis, direction in zip(body_outputs, grads, axes, directions):
        if g is None:
            continue
        value = _info_type(info)
        if value.shape is None:
            inferred = types.get(info.name) or _slice_type(b, g, axis)
            if inferred is not None and inferred.shape is not None:
                value = ValueType(value.elem_type or inferred.elem_type, inferred.shape)
        if not value.elem_type:
            value = ValueType(b.dtype(g), value.shape)
        inner = _fresh_info(b, f"{info.name}_bar", value)
        streams.append(_Stream(g, inner, axis, 1 - direction))
        seeds.append((info.name, inner.name))
    return streams, seeds


# -- Scan ---------------------------------------------------------------------------------------
@register("Scan", since=11, forward=_save_scan_states)
def scan_grad(b, node, grads, needs):
    body = node.attr("body")
    m = node.attr("num_scan_inputs")
    n = len(node.inputs) - m
    k = len(node.outputs) - 2 * n
    in_axes = node.attr("scan_input_axes", [0] * m)
    in_dirs = node.attr("scan_input_directions", [0] * m)
    out_axes = node.attr("scan_output_axes", [0] * (k + n))[:k]
    out_dirs = node.attr("scan_output_directions", [0] * (k + n))[:k]
    states = [_typed_like(b, node, info, outer) for info, outer in zip(body.input[:n], node.inputs)]
    slices = [
        _typed_slice(b, info, node.inputs[n + i], in_axes[i])
        for i, info in enumerate(body.input[n:])
    ]
    inputs, types = _typed_states(
        b, body, [*states, *slices], {j: body.output[j].name for j in range(n)}
    )
    states, slices = inputs[:n], inputs[n:]
    saved = node.outputs[n + k :]

    floats = [j for j in range(n) if _is_float(states[j])]
    carried = [
        _Carried(states[j], body.output[j].name, grads[j] or b.zeros_like(node.inputs[j]))
        for j in floats
    ]
    streams = [_Stream(saved[j], states[j], 0, 1) for j in range(n)]
    streams += [
        _Stream(node.inputs[n + i], slices[i], in_axes[i], 1 - in_dirs[i]) for i in range(m)
    ]
    bar_streams, seeds = _output_gradient_streams(
        b, body.output[n : n + k], grads[n : n + k], out_axes, out_dirs, types
    )
    wanted = [
        _Stream(node.inputs[n + i], slices[i], in_axes[i], 1 - in_dirs[i])
        for i in range(m)
        if needs[n + i] and _is_float(slices[i])
    ]
    captured = _captured_sources(node, needs)
    if not (carried or wanted or captured):
        return []
    state_grads, input_grads, captured_grads = _reverse_scan(
        b, body, carried, streams + bar_streams, seeds, wanted, captured
    )
    result = [None] * (n + m)
    for j, g in zip(floats, state_grads):
        result[j] = g
    wanted_inputs = [n + i for i in range(m) if needs[n + i] and _is_float(slices[i])]
    for index, g in zip(wanted_inputs, input_grads):
        result[index] = g
    by_name = dict(zip(captured, captured_grads))
    return result + [by_name.get(c) for c in node.captured]


# -- Loop ---------------------------------------------------------------------------------------
def _check_tensor_states(node: NodeView, body: GraphProto) -> None:
    for info in body.input:
        if info.type.HasField("sequence_type") or info.type.HasField("optional_type"):
            raise NotImplementedError(
                f"Loop node {node.name!r}: no gradient through the non-tensor loop-carried "
                f"value {info.name!r} (sequences and optionals cannot be stacked per iteration)"
            )


@register("Loop", since=11, forward=_save_loop_states)
def loop_grad(b, node, grads, needs):
    body = node.attr("body")
    n = len(node.inputs) - 2
    k = len(body.output) - 1 - n - (2 + n)
    _check_tensor_states(node, body)
    counters = [
        _typed_like(b, node, info, None, elem)
        for info, elem in zip(body.input[:2], (TensorProto.INT64, TensorProto.BOOL))
    ]
    states = [
        _typed_like(b, node, info, outer) for info, outer in zip(body.input[2:], node.inputs[2:])
    ]
    inputs, types = _typed_states(
        b, body, [*counters, *states], {2 + j: body.output[1 + j].name for j in range(n)}
    )
    states = inputs[2:]
    saved = node.outputs[n + k :]

    floats = [j for j in range(n) if _is_float(states[j])]
    carried = [
        _Carried(states[j], body.output[1 + j].name, grads[j] or b.zeros_like(node.inputs[2 + j]))
        for j in floats
    ]
    shapes = [b.ints([]), b.ints([]), *(b.shape_of(v) for v in node.inputs[2:])]
    streams, prologue = [], []
    for stacked, info, shape in zip(saved, [*counters, *states], shapes):
        row = _fresh_info(
            b, f"{info.name}_row", ValueType(info.type.tensor_type.elem_type, (1, None))
        )
        prologue.append(
            helper.make_node(
                "Reshape", [row.name, shape], [info.name], name=b.unique_node_name("Reshape")
            )
        )
        streams.append(_Stream(stacked, row, 0, 1))
    bar_streams, seeds = _output_gradient_streams(
        b, body.output[1 + n : 1 + n + k], grads[n : n + k], [0] * k, [0] * k, types
    )
    captured = _captured_sources(node, needs)
    if not (carried or captured):
        return []
    state_grads, _, captured_grads = _reverse_scan(
        b, body, carried, streams + bar_streams, seeds, [], captured, tuple(prologue)
    )
    result = [None] * (2 + n)
    for j, g in zip(floats, state_grads):
        result[2 + j] = g
    by_name = dict(zip(captured, captured_grads))
    return result + [by_name.get(c) for c in node.captured]
