"""Ranks where onnx's shape inference gives up, declared as value_info.

onnx's inference leaves a value's rank unknown in cases where it is fixed by the model:

* ``Reshape(x, shape)`` with ``shape`` computed (a ``Concat`` of slices of shapes) but of
  static length ``k``: the result has rank ``k``;
* an ``If`` whose branches' outputs have known and equal ranks;
* an operator whose schema fixes the rank of an input or output: every ``LSTM``/``GRU``/
  ``RNN`` tensor (``X``, ``initial_h``, ``initial_c``, ``Y_h``, ``Y_c`` have rank 3, ``Y``
  rank 4, with ``num_directions`` and ``hidden_size`` known), ``Conv``/``ConvTranspose``
  (input and output have the kernel's rank), pools (rank ``len(kernel_shape) + 2``), ``Gemm``
  (rank 2);
* a value whose rank follows from a use whose rank is known: ``y = f(x)`` for a rank-keeping
  ``f`` (activations, ``Cast``, normalisations, ``Slice``) gives ``rank x = rank y``,
  ``Unsqueeze`` and ``Squeeze`` with constant axes give ``rank x = rank y -+ len(axes)``;
* the inputs and the output of a ``Concat`` share one rank: one known fixes the others (a
  ``Squeeze`` without axes on ``[batch, 1, 4]``, whose rank depends on ``batch``, gets the
  rank of what it is concatenated with, through a ``Slice`` say);
* a value a ``Loop`` or ``Scan`` carries keeps its initial value's rank where the body
  keeps it: a fixed point (every such rank assumed for the body's input, the assumptions
  whose body output gets another rank or none dropped until those left hold), true in
  every iteration by induction; the body's input and the node's output are declared so.

A value read where the schema fixes its rank has that rank in every run that succeeds, so
the declarations hold for the model's valid inputs. Each round infers the model (weights left
out; data propagated only within :mod:`onnxgrad._bounded_inference`'s bound, never by declared
sizes), declares what these rules find in the graph that produces each value, and infers again,
so what one rule finds feeds the next and onnx's own inference downstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, helper, numpy_helper

from onnxgrad._bounded_inference import infer_shapes_bounded
from onnxgrad._model_checks import weightless_view
from onnxgrad._onnx_utils import normalize_domain, subgraphs
from onnxgrad.normalize.facts import Facts

#: Rounds of inference and declaration; each round extends the known ranks by at least one
#: rule application, and real models need two or three.
MAX_ROUNDS = 8

Dims = tuple[int | None, ...]

#: Ops whose output 0 has the rank of input 0 (read backwards: the input has the output's).
RANK_KEEPING = frozenset(
    {
        "Abs", "Cast", "Ceil", "Celu", "Clip", "Cos", "Dropout", "Elu", "Erf", "Exp",
        "Floor", "Gelu", "HardSigmoid", "HardSwish", "Hardmax", "Identity", "InstanceNormalization",
        "BatchNormalization", "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "Mish",
        "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin",
        "Softmax", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu",
        "LpNormalization", "MeanVarianceNormalization", "GroupNormalization",
    }
)  # fmt: skip

POOLS = frozenset({"AveragePool", "MaxPool", "LpPool"})
RECURRENT = frozenset({"LSTM", "GRU", "RNN"})


def refined_ranks(model: ModelProto, facts: Facts | None = None) -> ModelProto:
    """``model`` with value_info declaring the ranks (and schema-fixed dims) onnx's shape
    inference leaves unknown (see the module docstring); a model with none is left as is.
    Where ``facts`` say that inference already ranked every value of a model without
    subgraphs (:attr:`Facts.ranks_known`), no rule can apply and none is looked for."""
    if facts is None or not facts.ranks_known:
        _refine(model)
        if facts is not None:
            facts.forget()  # value_info may be declared
    for _ in range(MAX_ROUNDS):  # a carried rank found may give the next Loop's
        carried = _carried_ranks(model)
        if not carried:
            break
        _declare(model, carried)
        _refine(model)
        if facts is not None:
            facts.forget()
    if _declare_inferred_outputs(model) and facts is not None:
        facts.forget()
    return model


def _refine(model: ModelProto) -> None:
    """Rounds of inference and declaration until the rules find nothing more."""
    for _ in range(MAX_ROUNDS):
        facts = _rank_facts(model)
        if not facts:
            break
        _declare(model, facts)


def _declare_inferred_outputs(model: ModelProto) -> bool:
    """The main graph's outputs declared with no shape get the one inference finds (with
    the ranks declared above): an output's gradient is an input of that shape. Returns
    whether one had no shape."""
    bare = [o for o in model.graph.output if o.type.HasField("tensor_type") and not _has_shape(o)]
    if not bare:
        return False
    try:
        inferred = infer_shapes_bounded(weightless_view(model))
    except Exception:  # inference is a hint here
        return True
    shapes = {o.name: o.type.tensor_type.shape for o in inferred.graph.output if _has_shape(o)}
    for output in bare:
        if output.name in shapes:
            output.type.tensor_type.shape.CopyFrom(shapes[output.name])
    return True


# -- the ranks of the values a Loop or a Scan carries: a fixed point -------------------------
@dataclass(frozen=True)
class _Carried:
    """A value a Loop or Scan carries from one iteration to the next: its initial value
    has rank ``fact.dims``'s length; ``fact`` declares the body's input so, the body
    computes ``output`` from it, and ``final`` declares the node's output so."""

    fact: _Fact
    output: str
    final: _Fact | None


def _carried_ranks(model: ModelProto) -> list[_Fact]:
    """The ranks of carried values that inference leaves unknown in the body, where the
    body keeps them: the greatest fixed point of "the body's carried input has its initial
    value's rank" (every such hypothesis declared at once, the rounds run, the hypotheses
    whose body output gets another rank or none dropped, until all those left hold). Each
    kept rank holds in every iteration by induction; the Loop's or Scan's output (the last
    carried value) has it too."""
    if not any(_body(node) for graph in _graphs(model.graph) for node in graph.node):
        return []  # no inference spent on models without a Loop or a Scan
    view = weightless_view(model)
    candidates = list(_carried_candidates(view))
    while candidates:
        trial = ModelProto()
        trial.CopyFrom(view)
        _declare(trial, [c.fact for c in candidates])
        _refine(trial)
        ranks = _inferred_ranks(trial)
        if ranks is None:
            return []
        kept = [c for c in candidates if ranks[c.fact.graph].get(c.output) == len(c.fact.dims)]
        if len(kept) == len(candidates):
            return [f for c in kept for f in (c.fact, c.final) if f is not None]
        candidates = kept
    return []


def _carried_candidates(model: ModelProto) -> Iterator[_Carried]:
    """A hypothesis for each carried value whose initial value's rank is known and whose
    body input declares none (onnx's inference may find it from the initial value, but
    onnxruntime wants a body's outputs shaped before it runs a Scan or a Loop). Loop:
    inputs ``M, cond, v...``, body ``iter, cond, v...`` -> ``cond, v..., scans...``; Scan
    from opset 9: the states first in the inputs and outputs."""
    ranks = _inferred_ranks(model) if _opset(model) >= 9 else None
    if ranks is None:
        return
    graphs = list(_graphs(model.graph))
    index_of = {id(g): k for k, g in enumerate(graphs)}
    for k, graph in enumerate(graphs):
        for node in graph.node:
            body = _body(node)
            if body is None:
                continue
            positions = _carried_positions(node, body)
            for (initial, body_input, body_output), final in zip(positions, node.output):
                rank = ranks[k].get(initial)
                elem = body_input.type.tensor_type.elem_type or ranks[k].elem(initial)
                if rank is None or _has_shape(body_input) or not elem:
                    continue
                dims = (None,) * rank
                known = not final or ranks[k].get(final) is not None
                yield _Carried(
                    _Fact(index_of[id(body)], body_input.name, elem, dims),
                    body_output.name,
                    None if known else _Fact(k, final, elem, dims),
                )


def _body(node: NodeProto) -> GraphProto | None:
    if normalize_domain(node.domain) or node.op_type not in ("Loop", "Scan"):
        return None
    return next((a.g for a in node.attribute if a.name == "body"), None)


def _carried_positions(node: NodeProto, body: GraphProto):
    """``(initial value, body input, body output)`` of each carried value."""
    if node.op_type == "Loop":
        states = range(len(node.input) - 2)
        return [(node.input[2 + i], body.input[2 + i], body.output[1 + i]) for i in states]
    scans = _int(node, "num_scan_inputs") or 0
    states = range(len(node.input) - scans)
    return [(node.input[i], body.input[i], body.output[i]) for i in states]


class _Visible(dict):
    """The ranks of the values a graph sees (its own and its parents'), ``None`` where
    unknown; :meth:`elem` their element types."""

    def __init__(self, ranks: dict, elems: dict):
        super().__init__(ranks)
        self.elems = elems

    def elem(self, name: str) -> int:
        return self.elems.get(name, 0)


def _inferred_ranks(model: ModelProto) -> list[_Visible] | None:
    """What inference knows of every graph's visible values, graphs numbered as
    :func:`_graphs` does; None where inference cannot read the model."""
    try:
        inferred = infer_shapes_bounded(weightless_view(model))
    except Exception:  # inference is a hint here
        return None
    found: list[_Visible] = []

    def visit(graph: GraphProto, parent: _Visible | None) -> None:
        scope = _scope(graph, None, 0)
        ranks = {n: None if d is None else len(d) for n, d in scope.dims.items()}
        visible = _Visible(
            {**(parent or {}), **ranks}, {**(parent.elems if parent else {}), **scope.elem}
        )
        found.append(visible)
        for node in graph.node:
            for sub in subgraphs(node):
                visit(sub, visible)

    visit(inferred.graph, None)
    return found


def _opset(model: ModelProto) -> int:
    return next((o.version for o in model.opset_import if not normalize_domain(o.domain)), 0)


@dataclass
class _Scope:
    """The values a graph defines, with what inference knows of them: ``dims`` is ``None``
    for an unknown rank; ``elem`` 0 for an unknown element type."""

    index: int
    parent: _Scope | None
    elem: dict[str, int] = field(default_factory=dict)
    dims: dict[str, Dims | None] = field(default_factory=dict)
    constants: dict[str, TensorProto] = field(default_factory=dict)

    def owner(self, name: str) -> _Scope | None:
        scope: _Scope | None = self
        while scope is not None and name not in scope.elem:
            scope = scope.parent
        return scope

    def rank(self, name: str) -> int | None:
        owner = self.owner(name)
        found = None if owner is None else owner.dims[name]
        return None if found is None else len(found)

    def constant(self, name: str) -> np.ndarray | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.constants:
                return numpy_helper.to_array(scope.constants[name])
            scope = scope.parent
        return None


@dataclass(frozen=True)
class _Fact:
    graph: int
    name: str
    elem: int
    dims: Dims


def _rank_facts(model: ModelProto) -> list[_Fact]:
    """What the rules find, for values of unknown rank, after one inference of ``model``."""
    view = weightless_view(model)
    for output in view.graph.output:
        output.type.tensor_type.ClearField("shape")
    try:
        inferred = infer_shapes_bounded(view)
    except Exception:  # inference is a hint here: a model it cannot read stays as it is
        return []
    if _every_rank_known(inferred.graph):
        return []  # no rule applies to a value of known rank
    declared = _declared_ranks(model.graph.output)
    for last_word in (False, True):
        if last_word:
            _declared_where_unknown(inferred.graph.output, model.graph.output)
        found: dict[tuple[int, str], _Fact] = {}
        _walk(inferred.graph, None, iter(range(1 << 30)), found)
        facts = [f for f in found.values() if f.graph or declared.get(f.name) != len(f.dims)]
        if facts:
            return facts
    return []


def _every_rank_known(graph: GraphProto) -> bool:
    """Whether every input and node output of ``graph``, which holds no subgraph, has a
    known rank (or is no tensor)."""
    infos = [*graph.input, *graph.value_info, *graph.output]
    known = {  # most are ranked tensors: one test each (another type has no tensor shape)
        i.name
        for i in infos
        if i.type.tensor_type.HasField("shape") or not i.type.HasField("tensor_type")
    }
    known |= {i.name for i in graph.initializer}
    if any(i.name not in known for i in graph.input):
        return False
    for node in graph.node:
        if subgraphs(node) or any(o and o not in known for o in node.output):
            return False
    return True


def _declared_where_unknown(inferred, declared) -> None:
    """The declared shapes of the outputs whose rank inference cannot tell (a ``Squeeze``
    without axes): the last word, when no rule finds more."""
    shapes = {o.name: o.type.tensor_type.shape for o in declared if _has_shape(o)}
    for output in inferred:
        if not _has_shape(output) and output.name in shapes:
            output.type.tensor_type.shape.CopyFrom(shapes[output.name])


def _has_shape(info) -> bool:
    return info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape")


def _declared_ranks(outputs) -> dict[str, int]:
    """The ranks the graph's outputs declare; they are not trusted (a model may declare an
    output 2-D that it computes 3-D, onnxruntime only warns): a rule's rank replaces a
    different one, and only a rank no rule nor inference finds stays as declared."""
    return {
        o.name: len(o.type.tensor_type.shape.dim)
        for o in outputs
        if o.type.HasField("tensor_type") and o.type.tensor_type.HasField("shape")
    }


def _walk(graph: GraphProto, parent: _Scope | None, counter, found) -> None:
    scope = _scope(graph, parent, next(counter))
    for node in graph.node:
        if normalize_domain(node.domain):
            continue
        for name, dims in _node_facts(node, scope):
            owner = scope.owner(name)
            if owner is None or owner.dims.get(name) is not None or not owner.elem[name]:
                continue
            key = (owner.index, name)
            if key not in found:
                found[key] = _Fact(owner.index, name, owner.elem[name], dims)
                owner.dims[name] = dims
    for node in graph.node:
        for sub in subgraphs(node):
            _walk(sub, scope, counter, found)


def _scope(graph: GraphProto, parent: _Scope | None, index: int) -> _Scope:
    scope = _Scope(index, parent)
    for init in graph.initializer:
        scope.elem[init.name] = init.data_type
        scope.dims[init.name] = tuple(init.dims)
        scope.constants[init.name] = init
    for node in graph.node:
        if node.op_type == "Constant" and not normalize_domain(node.domain):
            tensor = _constant_value(node)
            if tensor is not None:
                scope.constants[node.output[0]] = tensor
        for name in node.output:
            if name:
                scope.elem.setdefault(name, 0)
                scope.dims.setdefault(name, None)
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if not info.type.HasField("tensor_type"):
            continue
        scope.elem[info.name] = tensor.elem_type
        scope.dims[info.name] = (
            tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
            if tensor.HasField("shape")
            else None
        )
    return scope


def _constant_value(node: NodeProto) -> TensorProto | None:
    attr = node.attribute[0] if len(node.attribute) == 1 else None
    if attr is None:
        return None
    if attr.name == "value":
        return attr.t
    if attr.name in ("value_int", "value_ints"):
        value = helper.get_attribute_value(attr)
        return numpy_helper.from_array(np.asarray(value, dtype=np.int64))
    return None


def _node_facts(node: NodeProto, scope: _Scope) -> Iterator[tuple[str, Dims]]:
    """``(value, dims)`` pairs the node's schema or its inputs' ranks fix."""
    op = node.op_type
    if op == "Reshape":
        yield from _reshape(node, scope)
    elif op == "If":
        yield from _if(node, scope)
    elif op in RECURRENT:
        yield from _recurrent(node)
    elif op in ("Conv", "ConvTranspose"):
        rank = scope.rank(node.input[1])
        if rank is not None:
            yield from _ranked([node.input[0], node.output[0]], rank)
    elif op in POOLS:
        kernel = _ints(node, "kernel_shape")
        if kernel is not None:
            yield from _ranked([node.input[0], *node.output], len(kernel) + 2)
    elif op == "Gemm":
        yield from _ranked([*node.input[:2], node.output[0]], 2)
    elif op == "Concat":
        yield from _same_rank([*node.input, *node.output[:1]], scope)
    if op in RANK_KEEPING or op in ("Unsqueeze", "Squeeze", "Slice"):
        yield from _rank_keeping(node, scope)


def _same_rank(names, scope: _Scope) -> Iterator[tuple[str, Dims]]:
    """Values that have one rank (a ``Concat``'s inputs and output): the known one."""
    ranks = {scope.rank(n) for n in names if n} - {None}
    if len(ranks) == 1:
        yield from _ranked([n for n in names if n and scope.rank(n) is None], ranks.pop())


def _ranked(names, rank: int) -> Iterator[tuple[str, Dims]]:
    for name in names:
        if name:
            yield name, (None,) * rank


def _reshape(node: NodeProto, scope: _Scope) -> Iterator[tuple[str, Dims]]:
    owner = scope.owner(node.input[1])
    shape = None if owner is None else owner.dims[node.input[1]]
    if shape is not None and len(shape) == 1 and shape[0] is not None:
        yield node.output[0], (None,) * shape[0]


def _if(node: NodeProto, scope: _Scope) -> Iterator[tuple[str, Dims]]:
    branches = {a.name: a.g for a in node.attribute if a.name in ("then_branch", "else_branch")}
    if len(branches) != 2:
        return
    then, other = branches["then_branch"], branches["else_branch"]
    for index, name in enumerate(node.output):
        ranks = {_branch_rank(g, g.output[index].name, scope) for g in (then, other)}
        if name and len(ranks) == 1 and None not in ranks:
            yield name, (None,) * ranks.pop()


def _branch_rank(graph: GraphProto, name: str, outer: _Scope) -> int | None:
    for info in [*graph.output, *graph.value_info]:
        if info.name == name and info.type.tensor_type.HasField("shape"):
            return len(info.type.tensor_type.shape.dim)
    if any(name in node.output for node in graph.node):
        return None
    return outer.rank(name)


def _recurrent(node: NodeProto) -> Iterator[tuple[str, Dims]]:
    """X ``[seq, batch, input]``, initial_h/c and Y_h/Y_c ``[directions, batch, hidden]``,
    Y ``[seq, directions, batch, hidden]`` (``layout=0``; ``layout=1`` puts batch first)."""
    hidden = _int(node, "hidden_size")
    directions = 2 if _string(node, "direction") == "bidirectional" else 1
    batch_first = _int(node, "layout") == 1
    state = (None, directions, hidden) if batch_first else (directions, None, hidden)
    sequence = (None, None, directions, hidden) if batch_first else (None, directions, None, hidden)
    if node.input and node.input[0]:
        yield node.input[0], (None, None, None)
    for index in (5, 6):
        if len(node.input) > index and node.input[index]:
            yield node.input[index], state
    for index, name in enumerate(node.output):
        if name:
            yield name, sequence if index == 0 else state


def _rank_keeping(node: NodeProto, scope: _Scope) -> Iterator[tuple[str, Dims]]:
    """The input's rank from the output's and back: equal, or ``-+ len(axes)`` for
    Unsqueeze/Squeeze with constant axes."""
    if not node.input or not node.input[0] or not node.output or not node.output[0]:
        return
    source, result = node.input[0], node.output[0]
    known, unknown, sign = (
        (result, source, 1) if scope.rank(source) is None else (source, result, -1)
    )
    rank = scope.rank(known)
    if rank is None or scope.rank(unknown) is not None:
        return
    if node.op_type in ("Unsqueeze", "Squeeze"):
        axes = _axes(node, scope)
        if axes is None:
            return
        rank += sign * (-axes if node.op_type == "Unsqueeze" else axes)
    if rank >= 0:
        yield unknown, (None,) * rank


def _axes(node: NodeProto, scope: _Scope) -> int | None:
    """How many axes an Unsqueeze/Squeeze lists, when they are constant and given."""
    if len(node.input) > 1 and node.input[1]:
        value = scope.constant(node.input[1])
        return None if value is None else int(value.size)
    listed = _ints(node, "axes")
    return None if listed is None else len(listed)


def _ints(node: NodeProto, name: str) -> list[int] | None:
    for attr in node.attribute:
        if attr.name == name:
            return list(attr.ints)
    return None


def _int(node: NodeProto, name: str) -> int | None:
    for attr in node.attribute:
        if attr.name == name:
            return attr.i
    return None


def _string(node: NodeProto, name: str) -> str:
    for attr in node.attribute:
        if attr.name == name:
            return attr.s.decode()
    return ""


def _declare(model: ModelProto, facts: list[_Fact]) -> None:
    """Add (or complete) value_info for each fact in the graph that defines its value."""
    graphs = list(_graphs(model.graph))
    for fact in facts:
        graph = graphs[fact.graph]
        info = next((i for i in graph.value_info if i.name == fact.name), None)
        if info is None:
            if any(o.name == fact.name for o in [*graph.output, *graph.input]):
                info = next(o for o in [*graph.output, *graph.input] if o.name == fact.name)
            else:
                info = graph.value_info.add()
        info.CopyFrom(helper.make_tensor_value_info(fact.name, fact.elem, list(fact.dims)))


def _graphs(graph: GraphProto) -> Iterator[GraphProto]:
    """Every graph in the order :func:`_walk` numbers them."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _graphs(sub)
