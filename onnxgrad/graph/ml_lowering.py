"""Lowering the ``ai.onnx.ml`` operators of converted models into standard ONNX.

scikit-learn converters keep a linear model's coefficients in the attributes of
``ai.onnx.ml`` operators, which nothing can train or differentiate. Each operator below is
replaced by default-domain nodes computing exactly what onnxruntime computes, with the
parameters as float initializers (weights):

* ``LinearRegressor``: ``y = x W^T + b`` (``targets`` columns), then the post transform
  (``LOGISTIC``, ``SOFTMAX``, ``SOFTMAX_ZERO``; onnxruntime applies none to one target);
* ``LinearClassifier``: scores ``s = x W^T + b``; the label is ``classes[argmax s]`` (one
  score: ``classes[s > 0]``) through ``Gather`` on an int64 or string initializer; the
  scores output is the post transform of ``s``. Two classes whose rows are ``(-w, -b)``
  and ``(w, b)`` (skl2onnx's binary models) keep one parameter set: ``s = x w + b`` and the
  scores ``[-s, s]``, so ``[logistic(-s), logistic(s)]`` stays a distribution however
  ``w`` and ``b`` are trained. For one score and two classes
  ``[1 - t, t]`` with ``t = sigmoid(s)`` (``LOGISTIC``, as onnxruntime >= 1.20 computes it;
  1.19 leaves ``s``) or ``t = s`` (the other transforms);
* ``SVMRegressor`` and ``SVMClassifier``, every kernel, probabilities included: see
  :mod:`onnxgrad.graph.ml_svm`;
* ``Scaler``: ``(x - offset) * scale``, its offset and scale initializers marked
  :data:`~onnxgrad.graph._builder.FITTED_STATISTIC` (statistics of the training data:
  trained only when named); ``Normalizer``: ``x / max x``, ``x / sum |x|`` or
  ``x / ||x||_2`` per row (rows whose norm is 0 unchanged); ``Binarizer``:
  ``x > threshold``; ``Imputer``: replaced values (or NaN) swapped for imputed ones;
* ``ArrayFeatureExtractor``: ``Gather`` along the last axis (``[1, k]`` for a 1-D input);
* ``FeatureVectorizer``: every input cast to float, cut or zero-padded to its declared
  width and concatenated.

``ZipMap`` (probabilities as a list of dictionaries) stays, or goes with
``keep_zipmap=False``; either way its probability tensor becomes a graph output named
``probabilities`` (or its own name when that one is taken), after the original outputs.
``CastMap`` and the ops without a float derivative (tree ensembles, label encoders,
nearest neighbours...) stay as they are, and so does an operator configured in a way the
lowering does not reproduce (:func:`why_not_lowered` says why; the gradient engine's error
repeats it). Models below default-domain opset 13 are first raised to 13
(:func:`~onnxgrad.graph.opset_raise.raised_opset`; left at their opset, which the lowering
also supports, when that cannot be done exactly).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import ModelProto, NodeProto, TensorProto, helper

from onnxgrad._onnx_utils import (
    MIN_OPSET,
    ModelLike,
    default_opset,
    finalize_model,
    load_model,
)
from onnxgrad.graph._builder import FITTED_STATISTIC, GraphBuilder
from onnxgrad.graph.opset_raise import deduplicated_opsets, raised_opset
from onnxgrad.graph.select import prune_graph

ML_DOMAIN = "ai.onnx.ml"
#: the name the probability tensor behind a ZipMap is exposed under, when it is free
PROBABILITIES = "probabilities"


class _Context:
    """What a lowering needs besides the node: a builder and the inferred value types."""

    def __init__(self, builder: GraphBuilder, types: dict[str, tuple[int, int | None]]):
        self.b = builder
        self.types = types

    def elem_type(self, name: str) -> int:
        return self.types.get(name, (TensorProto.FLOAT, None))[0]

    def rank(self, name: str) -> int | None:
        return self.types.get(name, (0, None))[1]

    def to_float(self, name: str) -> str:
        if self.elem_type(name) == TensorProto.FLOAT:
            return name
        return self.b.op("Cast", name, hint="as_float", to=TensorProto.FLOAT)

    def as_rows(self, name: str) -> str:
        """A 1-D input is one observation (onnxruntime's convention): ``[C] -> [1, C]``."""
        if self.rank(name) != 1:
            return name
        return self.b.op("Reshape", name, self.b.const(np.array([1, -1], np.int64), "rows"))


Lowering = Callable[[_Context, NodeProto], bool]
_LOWERINGS: dict[str, Lowering] = {}
#: ``op_type -> node -> reason or None``: why a lowering leaves a node as it is
_REFUSALS: dict[str, Callable[[NodeProto], str | None]] = {}


def _lowers(op_type: str) -> Callable[[Lowering], Lowering]:
    def register(function: Lowering) -> Lowering:
        _LOWERINGS[op_type] = function
        return function

    return register


def _refusals(*op_types: str) -> Callable:
    def register(function: Callable[[NodeProto], str | None]) -> Callable:
        for op_type in op_types:
            _REFUSALS[op_type] = function
        return function

    return register


def why_not_lowered(node: NodeProto) -> str | None:
    """Why :func:`lower_ml_operators` leaves this ``ai.onnx.ml`` node as it is (the attribute
    and its value), or ``None`` when it lowers it or knows no reason."""
    refusal = _REFUSALS.get(node.op_type) if node.domain == ML_DOMAIN else None
    return refusal(node) if refusal else None


def lowerable_nodes(model: ModelProto) -> list[NodeProto]:
    """The main-graph ``ai.onnx.ml`` nodes :func:`lower_ml_operators` replaces (or tries to)."""
    return [
        n
        for n in model.graph.node
        if n.domain == ML_DOMAIN and (n.op_type in _LOWERINGS or n.op_type == "ZipMap")
    ]


def needs_lowering(model: ModelProto, min_opset: int = MIN_OPSET) -> bool:
    """Whether ``model`` holds a lowerable ``ai.onnx.ml`` node or imports a default-domain
    opset below ``min_opset``."""
    return bool(lowerable_nodes(model)) or default_opset(model) < min_opset


def lowered_if_needed(
    model: ModelProto, keep_zipmap: bool = False, min_opset: int = MIN_OPSET
) -> ModelProto:
    """:func:`lower_ml_operators` of ``model`` when :func:`needs_lowering`, else ``model``;
    a model below ``min_opset`` is raised to it first (:func:`raised_opset`)."""
    if not needs_lowering(model, min_opset):
        return model
    if default_opset(model) < min_opset:
        model = raised_opset(model, min_opset)
    return lower_ml_operators(model, keep_zipmap=keep_zipmap)


def lower_ml_operators(model: ModelLike, keep_zipmap: bool = True) -> ModelProto:
    """A copy of ``model`` whose ``ai.onnx.ml`` operators are standard ONNX nodes with their
    parameters as initializers (see the module docstring for each operator's formula).

    The original outputs keep their names, types and values; a ``ZipMap``'s probability
    tensor is added as an output (``probabilities``), and with ``keep_zipmap=False`` the
    ZipMap output itself is dropped. An operator the lowering does not support as
    configured (the ``PROBIT`` transform, an input of unknown rank...: see
    :func:`why_not_lowered`) is left as it is.
    """
    model = _upgraded(deduplicated_opsets(load_model(model)))
    graph = model.graph
    zipmaps = [n for n in graph.node if n.domain == ML_DOMAIN and n.op_type == "ZipMap"]
    types = _inferred_types(model)
    while _lowering_pass(model, types):
        types = _inferred_types(model)
    builder = GraphBuilder(graph, default_opset(model), prefix="ml")
    _expose_probabilities(graph, builder, zipmaps, types, keep_zipmap)
    if not keep_zipmap:
        prune_graph(graph, keep_inputs=True)
    return finalize_model(model)


def _lowering_pass(model: ModelProto, types: dict) -> bool:
    """Lower every node it can (in place); whether it lowered any. A node whose input rank
    only shape inference of the lowered graph knows waits for the next pass."""
    graph = model.graph
    original = list(graph.node)
    builder = GraphBuilder(graph, default_opset(model), prefix="ml")
    del graph.node[:]
    context = _Context(builder, types)
    lowered = False
    for node in original:
        lower = _LOWERINGS.get(node.op_type) if node.domain == ML_DOMAIN else None
        builder.prefix = node.name or node.op_type
        if lower is not None and lower(context, node):
            lowered = True
        else:
            graph.node.append(node)
    return lowered


def _upgraded(model: ModelProto) -> ModelProto:
    """``model`` raised to :data:`MIN_OPSET` where :func:`raised_opset` can, else as it is
    (the lowering works at any opset; ``lowered_if_needed`` checks the opset it needs)."""
    if default_opset(model) >= MIN_OPSET:
        return model
    try:
        return raised_opset(model, MIN_OPSET)
    except (ValueError, NotImplementedError):
        return model


def _inferred_types(model: ModelProto) -> dict[str, tuple[int, int | None]]:
    """``{value: (element type, rank or None)}`` from shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a hint only: unknown values are taken for float of unknown rank
        inferred = model
    types = {}
    graph = inferred.graph
    for info in [*graph.input, *graph.output, *graph.value_info]:
        tensor = info.type.tensor_type
        if info.type.HasField("tensor_type") and tensor.elem_type:
            rank = len(tensor.shape.dim) if tensor.HasField("shape") else None
            types[info.name] = (tensor.elem_type, rank)
    for init in graph.initializer:
        types[init.name] = (init.data_type, len(init.dims))
    return types


def _expose_probabilities(graph, builder, zipmaps, types, keep_zipmap: bool) -> None:
    outputs = {o.name for o in graph.output}
    for node in zipmaps:
        tensor = node.input[0]
        if tensor not in outputs:
            name = tensor
            if not builder.is_used(PROBABILITIES):
                name = builder.op("Identity", tensor, out=PROBABILITIES)
            elem, _ = types.get(tensor, (TensorProto.FLOAT, 2))
            classes = _attr(node, "classlabels_int64s") or _attr(node, "classlabels_strings")
            shape = [None, len(classes) if classes else None]
            graph.output.append(helper.make_tensor_value_info(name, elem, shape))
            outputs.add(name)
        if not keep_zipmap:
            kept = [o for o in graph.output if o.name not in node.output]
            del graph.output[:]
            graph.output.extend(kept)


# -- shared pieces --------------------------------------------------------------------------
def _attr(node: NodeProto, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            value = helper.get_attribute_value(attribute)
            if isinstance(value, bytes):
                return value.decode()
            if isinstance(value, list) and value and isinstance(value[0], bytes):
                return [v.decode() for v in value]
            return value
    return default


def _linear(c: _Context, node: NodeProto, coefficients, intercepts, n_out: int) -> str | None:
    """``x W^T + b`` with ``W`` of ``n_out`` rows as initializers, or ``None`` (unknown
    shape)."""
    x = c.as_rows(c.to_float(node.input[0]))
    weights = np.asarray(coefficients, dtype=np.float32)
    if n_out < 1 or weights.size % n_out:
        return None
    w = c.b.initializer(weights.reshape(n_out, -1).T.copy(), "coefficients")
    scores = c.b.op("MatMul", x, w, hint="scores")
    if intercepts:
        b = c.b.initializer(np.asarray(intercepts, dtype=np.float32), "intercepts")
        scores = c.b.op("Add", scores, b, hint="scores")
    return scores


def _post_transform(c: _Context, scores: str, transform: str, out: str) -> str:
    """The post transform of several scores per row, written to ``out``."""
    if transform == "LOGISTIC":
        return c.b.op("Sigmoid", scores, out=out)
    if transform == "SOFTMAX":
        return c.b.op("Softmax", scores, out=out, axis=1 if c.b.opset < 13 else -1)
    if transform == "SOFTMAX_ZERO":
        return _softmax_zero(c, scores, out)
    return c.b.op("Identity", scores, out=out)


def _softmax_zero(c: _Context, s: str, out: str) -> str:
    """onnxruntime's softmax that leaves (near) zero scores near zero:
    ``e_j = exp(s_j - m)`` where ``|s_j| > 1e-7``, ``s_j exp(-m)`` elsewhere, over
    ``sum_{|s_j| > 1e-7} e_j``."""
    b = c.b
    m = b.reduce("ReduceMax", s, [1], keepdims=1)
    nonzero = b.op("Greater", b.op("Abs", s), b.const(np.array(1e-7, np.float32), "tiny"))
    exp = b.op("Exp", b.op("Sub", s, m))
    small = b.op("Mul", s, b.op("Exp", b.op("Neg", m)))
    zero = b.const(np.array(0.0, np.float32), "zero")
    total = b.reduce("ReduceSum", b.op("Where", nonzero, exp, zero), [1], keepdims=1)
    return b.op("Div", b.op("Where", nonzero, exp, small), total, out=out)


_PROBIT = "post_transform 'PROBIT' has no lowering"


def _refuses_probit(node: NodeProto) -> bool:
    return _attr(node, "post_transform", "NONE") == "PROBIT"


@_refusals("LinearRegressor", "LinearClassifier")
def _linear_refusal(node: NodeProto) -> str | None:
    return _PROBIT if _refuses_probit(node) else None


# -- linear models --------------------------------------------------------------------------
@_lowers("LinearRegressor")
def _linear_regressor(c: _Context, node: NodeProto) -> bool:
    targets = _attr(node, "targets", 1)
    if _refuses_probit(node):
        return False
    scores = _linear(
        c, node, _attr(node, "coefficients", []), _attr(node, "intercepts", []), targets
    )
    if scores is None:
        return False
    transform = _attr(node, "post_transform", "NONE") if targets > 1 else "NONE"
    _post_transform(c, scores, transform, node.output[0])
    return True


@_lowers("LinearClassifier")
def _linear_classifier(c: _Context, node: NodeProto) -> bool:
    if _refuses_probit(node):
        return False
    intercepts = _attr(node, "intercepts", [])
    strings = _attr(node, "classlabels_strings")
    labels = strings if strings else _attr(node, "classlabels_ints", [])
    n_scores = len(intercepts)
    coefficients = _attr(node, "coefficients", [])
    if _mirrored_pair(coefficients, intercepts, len(labels)):
        half = len(coefficients) // 2
        s = _linear(c, node, coefficients[half:], intercepts[1:], 1)
        scores = c.b.op("Concat", c.b.op("Neg", s), s, hint="scores", axis=1)
    else:
        scores = _linear(c, node, coefficients, intercepts, n_scores)
    if scores is None:
        return False
    b = c.b
    if n_scores == 1:
        two = len(labels) == 2
        default = ["0", "1"] if strings else [0, 1]
        _class_lookup(c, node, strings, labels if two else default, _positive(c, scores))
        if len(node.output) > 1 and node.output[1]:
            if two:
                if _attr(node, "post_transform", "NONE") == "LOGISTIC":
                    scores = b.op("Sigmoid", scores)
                one = b.const(np.array(1.0, np.float32), "one")
                b.op("Concat", b.op("Sub", one, scores), scores, out=node.output[1], axis=1)
            else:
                b.op("Identity", scores, out=node.output[1])
        return True
    index = b.op("ArgMax", scores, hint="class_index", axis=1, keepdims=0)
    _class_lookup(c, node, strings, labels, index)
    if len(node.output) > 1 and node.output[1]:
        _post_transform(c, scores, _attr(node, "post_transform", "NONE"), node.output[1])
    return True


def _mirrored_pair(coefficients, intercepts, n_labels: int) -> bool:
    """Whether two score rows are ``(-w, -b)`` and ``(w, b)``: a binary model written as two
    classes (skl2onnx's binary linear classifiers)."""
    if n_labels != 2 or len(intercepts) != 2 or not coefficients or len(coefficients) % 2:
        return False
    w = np.asarray(coefficients, dtype=np.float32).reshape(2, -1)
    b = np.asarray(intercepts, dtype=np.float32)
    return bool(np.array_equal(w[0], -w[1]) and b[0] == -b[1])


def _positive(c: _Context, scores: str) -> str:
    """``[N]`` int64: 1 where the single score is > 0."""
    b = c.b
    zero = b.const(np.array(0.0, np.float32), "zero")
    positive = b.op("Cast", b.op("Greater", scores, zero), to=TensorProto.INT64)
    return b.op("Reshape", positive, b.const(np.array([-1], np.int64), "flat"))


def _class_lookup(c: _Context, node: NodeProto, strings, labels, index: str) -> None:
    if not node.output[0]:
        return
    dtype = object if strings else np.int64
    classes = c.b.initializer(np.array(labels, dtype=dtype), "classes")
    c.b.op("Gather", classes, index, out=node.output[0], axis=0)


# -- preprocessing --------------------------------------------------------------------------
@_lowers("Scaler")
def _scaler(c: _Context, node: NodeProto) -> bool:
    x = c.to_float(node.input[0])
    offset = np.asarray(_attr(node, "offset", [0.0]), dtype=np.float32)
    scale = np.asarray(_attr(node, "scale", [1.0]), dtype=np.float32)
    # statistics of the training data (a StandardScaler's mean and 1/std), not weights
    centred = c.b.op("Sub", x, c.b.initializer(offset, "offset", FITTED_STATISTIC))
    c.b.op("Mul", centred, c.b.initializer(scale, "scale", FITTED_STATISTIC), out=node.output[0])
    return True


@_lowers("Normalizer")
def _normalizer(c: _Context, node: NodeProto) -> bool:
    b = c.b
    x = c.to_float(node.input[0])
    norm = _attr(node, "norm", "MAX")
    if norm == "MAX":
        total = b.reduce("ReduceMax", x, [-1], keepdims=1)
    elif norm == "L1":
        total = b.reduce("ReduceSum", b.op("Abs", x), [-1], keepdims=1)
    elif norm == "L2":
        total = b.reduce("ReduceSum", b.op("Mul", x, x), [-1], keepdims=1)
    else:
        return False
    zero, one = (
        b.const(np.array(0.0, np.float32), "zero"),
        b.const(np.array(1.0, np.float32), "one"),
    )
    safe = b.op("Where", b.op("Equal", total, zero), one, total, hint="norm")
    if norm == "L2":
        safe = b.op("Sqrt", safe)
    b.op("Div", x, safe, out=node.output[0])
    return True


@_lowers("Binarizer")
def _binarizer(c: _Context, node: NodeProto) -> bool:
    elem = c.elem_type(node.input[0])
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    threshold = c.b.const(np.array(_attr(node, "threshold", 0.0), dtype=dtype), "threshold")
    above = c.b.op("Greater", node.input[0], threshold)
    c.b.op("Cast", above, out=node.output[0], to=elem)
    return True


@_lowers("Imputer")
def _imputer(c: _Context, node: NodeProto) -> bool:
    b = c.b
    x = node.input[0]
    floats = _attr(node, "imputed_value_floats")
    if floats:
        imputed = np.asarray(floats, dtype=np.float32)
        replaced = np.float32(_attr(node, "replaced_value_float", 0.0))
    else:
        imputed = np.asarray(_attr(node, "imputed_value_int64s", []), dtype=np.int64)
        replaced = np.int64(_attr(node, "replaced_value_int64", 0))
    if imputed.size == 0 or c.rank(x) is None:
        return False
    if imputed.size > 1 and c.rank(x) == 1:
        imputed = imputed[:1]
    if np.issubdtype(imputed.dtype, np.floating) and np.isnan(replaced):
        mask = b.op("IsNaN", x)
    else:
        mask = b.op("Equal", x, b.const(np.array(replaced), "replaced"))
    values = b.const(imputed if imputed.size > 1 else imputed.reshape(()), "imputed")
    b.op("Where", mask, values, x, out=node.output[0])
    return True


@_lowers("ArrayFeatureExtractor")
def _array_feature_extractor(c: _Context, node: NodeProto) -> bool:
    x, indices = node.input[0], node.input[1]
    rank = c.rank(x)
    if rank is None:
        return False
    b = c.b
    flat = b.op("Reshape", indices, b.const(np.array([-1], np.int64), "flat"))
    if rank == 1:
        picked = b.op("Gather", x, flat, axis=0)
        b.op("Reshape", picked, b.const(np.array([1, -1], np.int64), "rows"), out=node.output[0])
    else:
        b.op("Gather", x, flat, out=node.output[0], axis=rank - 1)
    return True


@_lowers("FeatureVectorizer")
def _feature_vectorizer(c: _Context, node: NodeProto) -> bool:
    widths = _attr(node, "inputdimensions", [])
    if len(widths) != len(node.input) or any(c.rank(x) is None for x in node.input):
        return False
    b = c.b
    rows = b.const(np.array([0, -1], np.int64), "rows_by_batch")
    one_row = b.const(np.array([1, -1], np.int64), "one_row")
    parts = []
    for x, width in zip(node.input, widths):
        flat = b.op("Reshape", c.to_float(x), one_row if c.rank(x) == 1 else rows)
        parts.append(_fit_width(c, flat, int(width)))
    b.op("Concat", *parts, out=node.output[0], axis=1)
    return True


def _fit_width(c: _Context, x: str, width: int) -> str:
    """Columns ``[0, width)`` of ``x``, zero-padded on the right when it has fewer."""
    b = c.b
    cut = b.op(
        "Slice",
        x,
        b.const(np.array([0], np.int64), "start"),
        b.const(np.array([width], np.int64), "end"),
        b.const(np.array([1], np.int64), "axis"),
    )
    have = b.op(
        "Slice", b.op("Shape", cut), *(b.const(np.array([v], np.int64), "i") for v in (1, 2))
    )
    missing = b.op("Sub", b.const(np.array([width], np.int64), "width"), have)
    pads = b.op("Concat", b.const(np.array([0, 0, 0], np.int64), "pads"), missing, axis=0)
    return b.op("Pad", cut, pads)


__all__ = ["lower_ml_operators", "needs_lowering"]
