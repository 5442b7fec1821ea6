r"""The rule table of batched seeds: operators rewritten to carry a leading seed axis.

A value computed from the seeds carries ``k`` of them along a new leading axis (*batched*);
the others (forward values, Jacobian factors, shapes) are the same for every seed and keep
their shape. A rule rewrites one node whose inputs include batched values into nodes computing
all ``k`` results at once, from the per-seed ranks of the values (onnx's shape inference of the
unbatched graph):

- elementwise operators (``Add``, ``Mul``, ``Where``, ``Cast``, ``Tanh``...): a batched input
  of a lower per-seed rank than the result gets unit axes after the seed axis, so numpy
  broadcasting aligns every seed with itself;
- axis arguments (``Transpose``'s ``perm``, ``Softmax``, ``Concat``, ``Gather``, ``Slice``,
  ``Split``, reductions, ``Unsqueeze``/``Squeeze``, ``CumSum``, ``Pad``): shifted by one;
  shape arguments (``Reshape``, ``Expand``, ``Tile``) get the seed count in front; ``Shape``
  skips the seed axis;
- ``MatMul`` and ``Einsum`` broadcast over the seed axis as over any batch axis (a new
  subscript for ``Einsum``), ``Gemm`` becomes a ``MatMul``;
- operators mapping the rows of their first input independently (``Conv``,
  ``ConvTranspose``, pools, ``InstanceNormalization``, ``DepthToSpace``...): the seed axis is
  folded into the batch axis, ``[k, N, ...] -> [k N, ...]``, and unfolded after.

A node no rule covers (or whose ranks or constant arguments are unknown) runs in a ``Scan``
over the seed axis of its batched inputs, reading the others from the enclosing graph, with
the uncovered nodes that follow it up to the next covered one: the result is the same, one
seed at a time. Nodes none of whose inputs is batched run once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import NodeProto, TensorProto, helper

from onnxgrad._onnx_utils import NameScope, subgraphs
from onnxgrad.derivative.autodiff.builder import add_attribute
from onnxgrad.derivative.autodiff.rules._shape_helpers import reshape_to
from onnxgrad.graph._scopes import node_inputs
from onnxgrad.graph.names import rename_values

#: a rule emits ``node`` for batched inputs and says whether its outputs carry the seed
#: axis (``None``: not covered, nothing emitted counts)
Rule = Callable[["SeedAxis", NodeProto], "bool | None"]
_RULES: dict[str, Rule] = {}
_LAST = np.iinfo(np.int64).max


def _rule(*op_types: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        for op_type in op_types:
            _RULES[op_type] = rule
        return rule

    return register


class SeedAxis:
    """The nodes of a graph rewritten one by one to carry ``seeds`` along a leading axis.

    :param shapes: per-seed dimensions (``None`` where unknown) of every value of known rank
    :param constants: the values of the integer constants (initializers, ``Constant``)
    :param types: element type of every typed value
    """

    def __init__(self, seeds: int, scope: NameScope, shapes, constants, types, opset: int):
        self.seeds = seeds
        self.scope = scope
        self.shapes: dict[str, list[int | None]] = shapes
        self.constants: dict[str, np.ndarray] = constants
        self.types: dict[str, int] = types
        self.opset = opset
        self.batched: set[str] = set()
        self.nodes: list[NodeProto] = []
        self._pending: list[NodeProto] = []
        #: the constants the rules made
        self.initializers: list[TensorProto] = []
        #: what :meth:`ints` and :meth:`op` made, by what they were asked: each made once
        self._made: dict[tuple, str] = {}

    def rewrite(self, node: NodeProto) -> None:
        """Emit ``node`` as it is (no batched input) or by its rule, or defer it to a ``Scan``
        (:meth:`flush`) with the other nodes next to it that no rule covers."""
        inputs = node.input[:]  # a slice reads the strings at once
        inner = subgraphs(node) if node.attribute else None  # most nodes have no subgraph
        reads = node_inputs(node) if inner else inputs
        batched = self.batched
        if node.op_type == "Reshape":
            self._reshaped_rank(node)
        if batched.isdisjoint(reads):
            self.nodes.append(node)
            return
        rule = _RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None or (inner and reads.difference(inputs)):
            self._defer(node)
            return
        if self._pending:
            self.flush()
        start, constants = len(self.nodes), len(self.initializers)
        carried = rule(self, node)
        if carried:
            batched.update(node.output[:])
            batched.discard("")
            return
        if carried is None:
            dropped = {t.name for t in self.initializers[constants:]}
            dropped.update(o for n in self.nodes[start:] for o in n.output[:])
            self._made = {k: n for k, n in self._made.items() if n not in dropped}
            del self.nodes[start:], self.initializers[constants:]
            self._defer(node)

    def _reshaped_rank(self, node: NodeProto) -> None:
        """Record the rank of a Reshape's output, its shape's length, where onnx inferred none
        (a shape computed at run time): the rules of the nodes that read it need it."""
        if len(node.input) > 1 and node.output[0] not in self.shapes:
            length = self.length(node.input[1])
            if length is not None:
                self.shapes[node.output[0]] = [None] * length

    def _defer(self, node: NodeProto) -> None:
        """``node`` joins the nodes to run in one ``Scan``: its outputs carry the axis."""
        self._pending.append(node)
        self.batched.update(node.output[:])
        self.batched.discard("")

    def flush(self) -> None:
        """The deferred nodes, in one ``Scan`` over the seed axis of the batched values they
        read from outside, reading the others from the enclosing graph."""
        if not self._pending:
            return
        nodes, self._pending = self._pending, []
        made = {o for node in nodes for o in node.output if o}
        read = [n for node in nodes for n in [*node.input[:], *sorted(node_inputs(node))]]
        scanned = [n for n in dict.fromkeys(read) if n in self.batched and n not in made]
        outputs = [o for node in nodes for o in node.output[:] if o]
        inner = {n: self.scope.unique(f"{n}_one") for n in [*scanned, *outputs]}
        copies = []
        for node in nodes:
            copies.append(NodeProto())
            copies[-1].CopyFrom(node)
        body = helper.make_graph(
            copies,
            self.scope.unique(f"{nodes[0].op_type}_seed"),
            [self._info(inner[n], n) for n in scanned],
            [self._info(inner[o], o) for o in outputs],
        )
        rename_values(body, inner)
        name = self.scope.unique(f"{nodes[0].name or nodes[0].op_type}_SeedScan")
        self.nodes.append(
            helper.make_node(
                "Scan", scanned, outputs, name=name, body=body, num_scan_inputs=len(scanned)
            )
        )

    # helpers for the rules

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        """The output of a node ``op_type(*inputs, **attrs)``: ``out``, or a new name where
        none is given, the same for the same node asked again (the operators the rules
        emit are deterministic)."""
        if out is None:
            key = op_type, inputs, repr(sorted(attrs.items()))
            out = self._made.get(key)
            if out is not None:
                return out
            out = self._made[key] = self.scope.unique(f"seeded_{op_type}")
        name = self.scope.unique(f"{op_type}_seeded")
        node = NodeProto(op_type=op_type, input=inputs, output=[out], name=name)
        for key in sorted(attrs):
            if attrs[key] is not None:
                add_attribute(node.attribute, key, attrs[key])
        self.nodes.append(node)
        return out

    def ints(self, values) -> str:
        """An int64 initializer holding ``values``, one per distinct value (the rules ask
        for the same few axes and counts again and again)."""
        scalar = isinstance(values, (int, np.integer)) or getattr(values, "ndim", 1) == 0
        asked = ("ints", scalar, int(values) if scalar else tuple(int(v) for v in values))
        out = self._made.get(asked)  # the values themselves: no array to make
        if out is not None:
            return out
        array = np.asarray(values, dtype="<i8")  # what numpy_helper.from_array writes
        key = array.shape, array.tobytes()
        out = self._made.get(key)
        if out is None:
            out = self._made[key] = self.scope.unique("seeded_const")
            self.initializers.append(
                TensorProto(name=out, dims=array.shape, data_type=TensorProto.INT64,
                            raw_data=key[1])
            )  # fmt: skip
        self._made[asked] = out
        return out

    def same(self, node: NodeProto, inputs: list[str], **changed) -> None:
        """``node`` over ``inputs``, its attributes updated with ``changed`` (``node`` itself
        where nothing changes)."""
        if not changed and inputs == node.input[:]:
            self.nodes.append(node)
            return
        copy = NodeProto(
            op_type=node.op_type, input=inputs, output=node.output[:], name=node.name,
            domain=node.domain,
        )  # fmt: skip
        kept = {a.name: a for a in node.attribute} if node.attribute else {}
        attributes = copy.attribute
        for key in sorted(kept.keys() | changed.keys()):
            if key not in changed:
                attributes.add().CopyFrom(kept[key])  # append would copy it twice
            elif changed[key] is not None:
                add_attribute(attributes, key, changed[key])
        self.nodes.append(copy)

    def is_batched(self, name: str) -> bool:
        return bool(name) and name in self.batched

    def rank(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None else len(shape)

    def length(self, name: str) -> int | None:
        """The static length of the 1-D value ``name`` (a shape, starts), else ``None``."""
        known = self.constants.get(name)
        if known is not None:
            return int(np.size(known))
        shape = self.shapes.get(name)
        return shape[0] if shape is not None and len(shape) == 1 else None

    def lifted(self, name: str, rank: int) -> str:
        """Batched ``name`` with unit axes after the seed axis up to per-seed ``rank``."""
        missing = rank - self.rank(name)
        return (
            name if missing <= 0 else self.op("Unsqueeze", name, self.ints(range(1, missing + 1)))
        )

    def spread(self, name: str) -> str:
        """Unbatched ``name`` repeated for every seed."""
        shape = self.op("Concat", self.ints([self.seeds]), self.op("Shape", name), axis=0)
        return self.op("Expand", self.op("Unsqueeze", name, self.ints([0])), shape)

    def axes_input(self, node: NodeProto, index: int) -> list[int] | None:
        """The constant integer input ``index`` of ``node`` as a list (``None`` if unknown)."""
        if index >= len(node.input) or not node.input[index]:
            return None
        value = self.constants.get(node.input[index])
        return None if value is None else [int(v) for v in np.ravel(value).tolist()]

    def _info(self, name: str, original: str):
        return helper.make_tensor_value_info(name, self.types.get(original, 0), None)


_ELEMENTWISE = (
    # broadcasting
    "Add", "Sub", "Mul", "Div", "Pow", "Sum", "Max", "Min", "Mean", "Where", "Mod", "BitShift",
    "And", "Or", "Xor", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Clip",
    # one input
    "Identity", "Neg", "Abs", "Cast", "Exp", "Log", "Sqrt", "Reciprocal", "Tanh", "Sigmoid",
    "Relu", "Sign", "Floor", "Ceil", "Round", "Erf", "Sin", "Cos", "Not", "IsNaN", "IsInf",
    "Softplus", "Softsign", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish",
    "Gelu", "Mish", "Atan", "Asin", "Acos", "Sinh", "Cosh", "Tan", "Asinh", "Acosh", "Atanh",
    "ThresholdedRelu", "Shrink", "CastLike", "Trilu",
)  # fmt: skip


@_rule(*_ELEMENTWISE)
def _elementwise(sa: SeedAxis, node: NodeProto) -> bool | None:
    """Batched inputs lifted to the result's per-seed rank (``CastLike``'s target and
    ``Trilu``'s ``k`` do not broadcast: they are not batched)."""
    inputs = node.input[:]
    names = [n for n in inputs if n]
    batched, shapes = sa.batched, sa.shapes  # the most frequent rule: no helper called
    if node.op_type in ("CastLike", "Trilu") and not batched.isdisjoint(names[1:]):
        return None
    if not all(n in shapes for n in names):
        return None
    rank = max(len(shapes[n]) for n in names)
    lifted = [sa.lifted(n, rank) if n in batched else n for n in inputs]
    if lifted == inputs:
        sa.nodes.append(node)  # what sa.same does with nothing changed
    else:
        sa.same(node, lifted)
    return True


def _shifted(axis: int) -> int:
    return axis + 1 if axis >= 0 else axis


def _only_first_batched(sa: SeedAxis, node: NodeProto) -> bool:
    return sa.is_batched(node.input[0]) and not any(sa.is_batched(n) for n in node.input[1:])


@_rule("Softmax", "LogSoftmax", "Hardmax", "Gather", "Split", "LpNormalization", "Flatten")
def _axis_attribute(sa: SeedAxis, node: NodeProto) -> bool | None:
    """The ``axis`` attribute shifted past the seed axis (``Flatten``: then the seed axis
    split off again)."""
    if not _only_first_batched(sa, node):
        return None
    default = {"Gather": 0, "Split": 0, "LpNormalization": -1}.get(node.op_type, 1)
    if node.op_type in ("Softmax", "LogSoftmax", "Hardmax") and sa.opset >= 13:
        default = -1
    axis = next((a.i for a in node.attribute if a.name == "axis"), default)
    if node.op_type != "Flatten":
        sa.same(node, node.input[:], axis=_shifted(axis))
        return True
    rank = sa.rank(node.input[0])
    if rank is None:
        return None
    axis = axis % rank if rank else 0
    flat = sa.op("Flatten", node.input[0], axis=axis + 1)
    if axis == 0:
        flat = sa.op("Unsqueeze", flat, sa.ints([1]))
        sa.op("Identity", flat, out=node.output[0])
        return True
    # [k m, t] -> [k, m, t] with m computed, not -1: Reshape cannot infer it where t = 0
    split = sa.op("Div", sa.op("Shape", flat), sa.ints([sa.seeds, 1]))
    shape = sa.op("Concat", sa.ints([sa.seeds]), split, axis=0)
    reshape_to(sa, flat, shape, out=node.output[0])
    return True


@_rule("Concat")
def _concat(sa: SeedAxis, node: NodeProto) -> bool | None:
    axis = next(a.i for a in node.attribute if a.name == "axis")
    inputs = [n if sa.is_batched(n) else sa.spread(n) for n in node.input[:]]
    sa.same(node, inputs, axis=_shifted(axis))
    return True


@_rule("Transpose")
def _transpose(sa: SeedAxis, node: NodeProto) -> bool | None:
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    if perm is None:
        rank = sa.rank(node.input[0])
        if rank is None:
            return None
        perm = list(reversed(range(rank)))
    sa.same(node, node.input[:], perm=[0, *(p + 1 for p in perm)])
    return True


def _leading_count(sa: SeedAxis, shape: str) -> str:
    """``[seeds] ++ shape`` (a constant where ``shape`` is one)."""
    known = sa.constants.get(shape)
    if known is not None:
        return sa.ints([sa.seeds, *np.ravel(known).tolist()])
    return sa.op("Concat", sa.ints([sa.seeds]), shape, axis=0)


@_rule("Reshape")
def _reshape(sa: SeedAxis, node: NodeProto) -> bool | None:
    """A ``0`` in the shape copies the input's dimension at its position: the seed axis,
    prepended to both, keeps the positions aligned."""
    if not _only_first_batched(sa, node) or len(node.input) < 2:
        return None
    sa.same(node, [node.input[0], _leading_count(sa, node.input[1])])
    return True


@_rule("Tile")
def _tile(sa: SeedAxis, node: NodeProto) -> bool | None:
    if not _only_first_batched(sa, node):
        return None
    repeats = sa.op("Concat", sa.ints([1]), node.input[1], axis=0)
    sa.same(node, [node.input[0], repeats])
    return True


@_rule("Expand")
def _expand(sa: SeedAxis, node: NodeProto) -> bool | None:
    if not _only_first_batched(sa, node):
        return None
    length = sa.rank(node.input[0]), sa.length(node.input[1])
    if None in length:
        return None
    rank, count = length
    total = max(rank, count)
    prefix = sa.ints([sa.seeds, *[1] * (total - count)])
    shape = sa.op("Concat", prefix, node.input[1], axis=0)
    sa.same(node, [sa.lifted(node.input[0], total), shape])
    return True


@_rule("Shape")
def _shape(sa: SeedAxis, node: NodeProto) -> bool | None:
    """The shape of one seed: the seed axis skipped. Not batched."""
    if sa.opset < 15:
        whole = sa.op("Shape", node.input[0])
        sa.op("Slice", whole, sa.ints([1]), sa.ints([_LAST]), out=node.output[0])
    else:
        start = next((a.i for a in node.attribute if a.name == "start"), 0)
        end = next((a.i for a in node.attribute if a.name == "end"), None)
        ends = {} if end is None else {"end": _shifted(end)}
        sa.op("Shape", node.input[0], out=node.output[0], start=_shifted(start), **ends)
    return False


@_rule("Size")
def _size(sa: SeedAxis, node: NodeProto) -> bool | None:
    total = sa.op("Size", node.input[0])
    sa.op("Div", total, sa.ints(sa.seeds), out=node.output[0])
    return False


_REDUCTIONS = (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin",
)  # fmt: skip
#: the opset from which each reduction takes its axes as an input
_AXES_INPUT = {"ReduceSum": 13, "ArgMax": 10**9, "ArgMin": 10**9}


@_rule(*_REDUCTIONS)
def _reduce(sa: SeedAxis, node: NodeProto) -> bool | None:
    """The axes shifted; no axes (all of them): every per-seed axis, named."""
    if not _only_first_batched(sa, node):
        return None
    if node.op_type in ("ArgMax", "ArgMin"):
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        sa.same(node, node.input[:], axis=_shifted(axis))
        return True
    as_input = sa.opset >= _AXES_INPUT.get(node.op_type, 18)
    if as_input:
        axes = sa.axes_input(node, 1)
        if axes is None and len(node.input) > 1 and node.input[1]:
            return None
    else:
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if not axes:
        noop = next((a.i for a in node.attribute if a.name == "noop_with_empty_axes"), 0)
        if noop and as_input:
            sa.op("Identity", node.input[0], out=node.output[0])
            return True
        rank = sa.rank(node.input[0])
        if rank is None:
            return None
        axes = list(range(rank))
    shifted = [_shifted(a) for a in axes]
    if as_input:
        sa.same(node, [node.input[0], sa.ints(shifted)])
    else:
        sa.same(node, node.input[:], axes=shifted)
    return True


@_rule("Unsqueeze", "Squeeze")
def _unsqueeze(sa: SeedAxis, node: NodeProto) -> bool | None:
    if not _only_first_batched(sa, node):
        return None
    if sa.opset >= 13:
        axes = sa.axes_input(node, 1)
        if axes is None:
            return None
        sa.same(node, [node.input[0], sa.ints([_shifted(a) for a in axes])])
        return True
    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None:
        return None
    sa.same(node, node.input[:], axes=[_shifted(a) for a in axes])
    return True


@_rule("Slice")
def _slice(sa: SeedAxis, node: NodeProto) -> bool | None:
    if not _only_first_batched(sa, node):
        return None
    if sa.opset < 10:
        starts = next(list(a.ints) for a in node.attribute if a.name == "starts")
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
        axes = list(range(len(starts))) if axes is None else axes
        sa.same(node, node.input[:], axes=[_shifted(a) for a in axes])
        return True
    axes = sa.axes_input(node, 3)
    if axes is None:
        if len(node.input) > 3 and node.input[3]:
            return None
        count = sa.length(node.input[1])
        if count is None:
            return None
        axes = list(range(count))
    inputs = [*node.input[:3], sa.ints([_shifted(a) for a in axes]), *node.input[4:]]
    sa.same(node, inputs)
    return True


@_rule("CumSum")
def _cumsum(sa: SeedAxis, node: NodeProto) -> bool | None:
    axis = sa.axes_input(node, 1)
    if not _only_first_batched(sa, node) or axis is None:
        return None
    sa.same(node, [node.input[0], sa.ints(_shifted(axis[0]))])
    return True


@_rule("Pad")
def _pad(sa: SeedAxis, node: NodeProto) -> bool | None:
    """Opset 11 and later: no padding on the seed axis."""
    if not _only_first_batched(sa, node) or sa.opset < 11:
        return None
    if len(node.input) > 3 and node.input[3]:
        axes = sa.axes_input(node, 3)
        if axes is None:
            return None
        sa.same(node, [*node.input[:3], sa.ints([_shifted(a) for a in axes])])
        return True
    rank = sa.rank(node.input[0])
    if rank is None:
        return None
    pads = node.input[1]
    zero = sa.ints([0])
    begin = sa.op("Slice", pads, sa.ints([0]), sa.ints([rank]))
    end = sa.op("Slice", pads, sa.ints([rank]), sa.ints([2 * rank]))
    padded = sa.op("Concat", zero, begin, zero, end, axis=0)
    sa.same(node, [node.input[0], padded, *node.input[2:]])
    return True


@_rule("MatMul")
def _matmul(sa: SeedAxis, node: NodeProto) -> bool | None:
    """The seed axis broadcast as a batch axis; a batched vector on the left is a matrix of
    seeds, on the right (against a matrix) the product transposed."""
    a, b = node.input
    ranks = sa.rank(a), sa.rank(b)
    if None in ranks:
        return None
    ra, rb = ranks
    both = sa.is_batched(a) and sa.is_batched(b)
    if both:
        if min(ra, rb) < 2:
            return None
        top = max(ra, rb)
        sa.same(node, [sa.lifted(a, top), sa.lifted(b, top)])
        return True
    if sa.is_batched(a):
        if ra == 1 and rb > 2:
            return None
        sa.same(node, [sa.lifted(a, rb) if ra >= 2 else a, b])
        return True
    if rb >= 2:
        sa.same(node, [a, sa.lifted(b, ra)])
        return True
    if ra == 1:
        sa.same(node, [b, a])
        return True
    if ra == 2 and sa.types.get(node.output[0]) in (TensorProto.FLOAT, TensorProto.FLOAT16):
        # [z, n] by A' [n, m]: onnxruntime's Einsum crashes on an empty batch
        sa.op("MatMul", b, sa.op("Transpose", a, perm=[1, 0]), out=node.output[0])
        return True
    if ra == 2:
        sa.op("Einsum", a, b, out=node.output[0], equation="mn,zn->zm")
        return True
    return None


@_rule("Gemm")
def _gemm(sa: SeedAxis, node: NodeProto) -> bool | None:
    """``alpha A' B' + beta C`` with an ``Einsum`` for the product (its subscripts say the
    transpositions: a ``Transpose`` before a ``MatMul`` becomes onnxruntime's
    ``FusedMatMul``, which has no float64 kernel)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    a, b = node.input[:2]
    elem = sa.types.get(node.output[0], TensorProto.FLOAT)
    product = _gemm_product(sa, a, b, attrs, elem)
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if alpha != 1.0:
        product = sa.op("Mul", product, _scalar(sa, alpha, elem))
    c = node.input[2] if len(node.input) > 2 else ""
    if not c:
        sa.op("Identity", product, out=node.output[0])
        return True
    if sa.is_batched(c):
        if sa.rank(c) is None:
            return None
        c = sa.lifted(c, 2)
    if beta != 1.0:
        c = sa.op("Mul", c, _scalar(sa, beta, elem))
    sa.op("Add", product, c, out=node.output[0])
    return True


def _gemm_product(sa: SeedAxis, a: str, b: str, attrs: dict, elem: int) -> str:
    """``A' B'`` of a ``Gemm`` whose operands may carry the seed axis, in float32 or float16:
    a (broadcast) ``MatMul`` of the operands, each transposed where the Gemm says so, which
    onnxruntime folds away for a constant ``B`` (its ``Einsum`` costs more: 1.3x the
    batched tangent of a two-layer MLP, and crashes on an empty batch); else an ``Einsum``
    whose subscripts say the transpositions (a ``Transpose`` before a ``MatMul`` becomes
    onnxruntime's ``FusedMatMul``, which has no float64 kernel)."""
    if elem in (TensorProto.FLOAT, TensorProto.FLOAT16):
        left = _transposed(sa, a, attrs.get("transA", 0))
        return sa.op("MatMul", left, _transposed(sa, b, attrs.get("transB", 0)))
    left = ("nm" if attrs.get("transA", 0) else "mn", a)
    right = ("pn" if attrs.get("transB", 0) else "np", b)
    terms = [("z" + t if sa.is_batched(n) else t) for t, n in (left, right)]
    result = "zmp" if sa.is_batched(a) or sa.is_batched(b) else "mp"
    return sa.op("Einsum", a, b, equation=f"{terms[0]},{terms[1]}->{result}")


def _transposed(sa: SeedAxis, t: str, flag: int) -> str:
    """``t``'s last two axes swapped where ``flag``."""
    if not flag:
        return t
    return sa.op("Transpose", t, perm=[0, 2, 1] if sa.is_batched(t) else [1, 0])


def _scalar(sa: SeedAxis, value: float, elem: int) -> str:
    out = sa.scope.unique("seeded_scalar")
    tensor = helper.make_tensor(out, elem, [], [value])
    sa.nodes.append(
        helper.make_node(
            "Constant", [], [out], name=sa.scope.unique("Constant_seeded"), value=tensor
        )
    )
    return out


@_rule("Einsum")
def _einsum(sa: SeedAxis, node: NodeProto) -> bool | None:
    """A new subscript for the seed axis, on the batched operands and the result."""
    equation = next(a.s for a in node.attribute if a.name == "equation").decode()
    equation = equation.replace(" ", "")
    if "->" not in equation:
        return None
    letter = next(
        c for c in "zyxwvutsrqponmlkjihgfedcbaZYXWVUTSRQPONMLKJIHGFEDCBA" if c not in equation
    )
    operands, result = equation.split("->")
    terms = operands.split(",")
    terms = [letter + t if sa.is_batched(n) else t for t, n in zip(terms, node.input[:])]
    sa.same(node, node.input[:], equation=f"{','.join(terms)}->{letter}{result}")
    return True


#: operators mapping the rows (axis 0) of their first input independently, the other
#: inputs parameters
_ROWWISE = (
    "Conv", "ConvTranspose", "AveragePool", "MaxPool", "LpPool", "GlobalAveragePool",
    "GlobalMaxPool", "GlobalLpPool", "InstanceNormalization", "LRN", "DepthToSpace",
    "SpaceToDepth", "BatchNormalization", "MaxRoiPool",
)  # fmt: skip


@_rule(*_ROWWISE)
def _rowwise(sa: SeedAxis, node: NodeProto) -> bool | None:
    """The seed axis folded into the batch axis, ``[k, N, ...] -> [k N, ...]``, and back."""
    if not _only_first_batched(sa, node) or len([o for o in node.output[:] if o]) != 1:
        return None
    training = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
    if node.op_type == "MaxRoiPool" or training:  # statistics across the rows
        return None
    x, y = node.input[0], node.output[0]
    folded = sa.op("Reshape", x, _folded_shape(sa, x, [-1], x, 2))
    out = sa.scope.unique(f"{y}_folded")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    sa.nodes.append(
        helper.make_node(node.op_type, [folded, *node.input[1:]], [out], name=node.name, **attrs)
    )
    _unfold(sa, out, y)
    return True


def _unfold(sa: SeedAxis, folded: str, y: str) -> None:
    """``y``, ``[k, N, ...]``, from ``folded``, ``[k N, ...]``: a constant shape with ``-1``
    for ``N`` where ``y``'s other sizes are static and none is 0, else ``N = (k N) / k``
    read at run time (Reshape cannot infer a ``-1`` beside a 0, nor an empty batch)."""
    dims = sa.shapes.get(y)
    if dims and None not in dims and 0 not in dims:
        sa.op("Reshape", folded, sa.ints([sa.seeds, -1, *dims[1:]]), out=y)
        return
    shape = sa.op("Shape", folded)
    if dims:  # [k N, ...] / [k, 1, ..., 1]
        split = sa.op("Div", shape, sa.ints([sa.seeds] + [1] * (len(dims) - 1)))
    else:
        rows = sa.op("Div", sa.op("Slice", shape, sa.ints([0]), sa.ints([1])), sa.ints([sa.seeds]))
        rest = sa.op("Slice", shape, sa.ints([1]), sa.ints([_LAST]))
        split = sa.op("Concat", rows, rest, axis=0)
    reshape_to(sa, folded, sa.op("Concat", sa.ints([sa.seeds]), split, axis=0), out=y)


def _folded_shape(sa: SeedAxis, per_seed: str, head: list[int], value: str, start: int) -> str:
    """``head`` followed by ``per_seed``'s dimensions after the first: a constant where they
    are static, else read from ``value``'s shape from ``start`` on."""
    dims = sa.shapes.get(per_seed)
    if dims and None not in dims:
        return sa.ints([*head, *dims[1:]])
    rest = sa.op("Slice", sa.op("Shape", value), sa.ints([start]), sa.ints([_LAST]))
    return sa.op("Concat", sa.ints(head), rest, axis=0)


@_rule("GatherElements", "ScatterElements")
def _elements(sa: SeedAxis, node: NodeProto) -> bool | None:
    """The indices repeated for every seed (they index as many axes as the data, the seed
    axis now included), the axis shifted; unbatched data or updates spread."""
    indices = node.input[1]
    rank = sa.rank(indices)
    if sa.is_batched(indices) or rank is None:
        return None
    repeat = sa.op("Concat", sa.ints([sa.seeds]), sa.op("Shape", indices), axis=0)
    spread = sa.op("Expand", sa.op("Unsqueeze", indices, sa.ints([0])), repeat)
    others = [n if sa.is_batched(n) else sa.spread(n) for n in node.input[2:]]
    data = node.input[0] if sa.is_batched(node.input[0]) else sa.spread(node.input[0])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    sa.same(node, [data, spread, *others], axis=_shifted(axis))
    return True
