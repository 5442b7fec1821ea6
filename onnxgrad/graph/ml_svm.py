"""Lowering the support vector machines of ``ai.onnx.ml`` into standard ONNX, computing what
onnxruntime computes.

The kernel between an input row ``x`` and a support vector ``v`` (``kernel_params`` =
``gamma, coef0, degree``; onnxruntime reads a ``kernel_type`` it does not know as
``SIGMOID``)::

    LINEAR   <x, v>                      POLY     (gamma <x, v> + coef0) ^ degree
    RBF      exp(-gamma |x - v|^2)       SIGMOID  tanh(gamma <x, v> + coef0)

``SVMRegressor``: ``y = K(x, V) alpha + rho_0`` (a linear kernel folded into
``y = x (alpha^T V) + rho_0``; without support vectors ``y = x alpha + rho_0``); with
``one_class``, ``sign(y)`` as ``1`` or ``-1``.

``SVMClassifier`` with support vectors (libsvm's one-vs-one): ``C`` classes, class ``c``
owning ``vectors_per_class[c]`` consecutive vectors, dual coefficients ``a`` of shape
``[C - 1, V]`` and the ``P = C (C - 1) / 2`` pairs ``i < j`` in row-major order::

    s_ij = sum_{v of class i} a[j - 1, v] K_v + sum_{v of class j} a[i, v] K_v + rho_ij

Pair ``(i, j)`` votes for ``i`` when ``s_ij > 0``, else for ``j``; the label is
``classes[argmax votes]``, the first class of a tie (onnxruntime's ``max_element``). The
second output is:

* without ``prob_a``: the post transform of the ``P`` scores; with two classes
  ``[-s, s]`` (``NONE``), ``[logistic(-s), logistic(s)]`` (``LOGISTIC``, as onnxruntime
  1.32 computes it; 1.19 writes ``[1 - s, s]``) or ``[1 - s, s]`` (the softmaxes);
* with ``prob_a``, ``prob_b``: Platt's pairwise probabilities
  ``r_ij = clip(1 - logistic(A_ij s_ij + B_ij), 1e-7, 1 - 1e-7)``, ``r_ji = 1 - r_ij``,
  coupled into class probabilities ``p`` (Wu, Lin & Weng 2004, method 2) by onnxruntime's
  iteration, a ``Loop`` here; then the post transform of ``p``.

Without support vectors (liblinear's layout) the scores are ``s = x a^T + rho_0``
(``C`` columns), the label ``classes[argmax s]``, except with two classes and no ``prob_a``:
``classes[1]`` when ``max s > 0`` (``max s >= 0.5`` when every coefficient is ``>= 0``, a
rule fixed at lowering time from the coefficients), as onnxruntime decides.

The pair scores are accumulated in float64 (onnxruntime sums them in double) and the RBF
distances as ``sum_f (x_f - v_f)^2`` (not ``|x|^2 - 2 <x, v> + |v|^2``, which loses digits
on features far from 0), at the price of an ``[N, V, F]`` intermediate.

Support vectors, coefficients, ``rho`` and Platt's ``A``, ``B`` become float initializers
(weights): the scores and probabilities are differentiable in them and in ``x``; the label
is not. A ``post_transform`` of ``PROBIT`` and attributes of inconsistent sizes are not
lowered (:func:`svm_refusal` says why).
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper

from onnxgrad.graph.ml_lowering import (
    _PROBIT,
    _attr,
    _class_lookup,
    _Context,
    _linear,
    _lowers,
    _post_transform,
    _refusals,
)

#: onnxruntime's bounds on Platt's pairwise probabilities
_PROBABILITY_FLOOR = np.float32(1e-7)
#: onnxruntime's (and libsvm's) pairwise coupling: at most max(this, C) sweeps per row
_COUPLING_SWEEPS = 100


def _f32(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


# -- kernels ----------------------------------------------------------------------------------
def _kernel_params(node: NodeProto) -> tuple[float, float, float]:
    gamma, coef0, degree = ([float(v) for v in _attr(node, "kernel_params", [])] + [0.0] * 3)[:3]
    return gamma, coef0, degree


def _kernel(c: _Context, node: NodeProto, x: str, support_vectors: np.ndarray) -> str:
    """``K[n, v] = k(x_n, V_v)``, ``[N, V]``, for the node's ``kernel_type``; the support
    vectors ``V`` (``[V, F]``) become a weight."""
    b = c.b
    kernel = _attr(node, "kernel_type", "LINEAR")
    gamma, coef0, degree = _kernel_params(node)
    vectors = b.initializer(support_vectors, "support_vectors")
    if kernel == "RBF":  # [N, 1, F]: F written out, so an empty batch reshapes too
        features = support_vectors.shape[1]
        rows = b.op("Reshape", x, b.const(np.array([0, 1, features], np.int64), "rows3d"))
        diff = b.op("Sub", rows, vectors)
        distance = b.reduce("ReduceSum", b.op("Mul", diff, diff), [2], keepdims=0)
        return b.op("Exp", b.op("Mul", b.const(_f32(-gamma), "minus_gamma"), distance))
    linear = kernel == "LINEAR"
    inputs = [x, vectors]
    if not linear and coef0 != 0:
        inputs.append(b.const(_f32([coef0]), "coef0"))
    elif b.opset < 11:  # Gemm's C is optional from opset 11
        inputs.append(b.const(_f32([0.0]), "no_bias"))
    dot = b.op("Gemm", *inputs, hint="dot", transB=1, alpha=1.0 if linear else gamma)
    if linear:
        return dot
    if kernel != "POLY":
        return b.op("Tanh", dot, hint="kernel")
    if degree == 2:
        return b.op("Mul", dot, dot, hint="kernel")
    if degree == 3:
        return b.op("Mul", b.op("Mul", dot, dot), dot, hint="kernel")
    return b.op("Pow", dot, b.const(_f32(degree), "degree"), hint="kernel")


# -- SVMRegressor -----------------------------------------------------------------------------
@_lowers("SVMRegressor")
def _svm_regressor(c: _Context, node: NodeProto) -> bool:
    n_supports = _attr(node, "n_supports", 0)
    with_kernel = n_supports > 0 and _attr(node, "kernel_type", "LINEAR") != "LINEAR"
    if svm_refusal(node) or (with_kernel and c.rank(node.input[0]) is None):
        return False
    b = c.b
    coefficients = np.asarray(_attr(node, "coefficients", []), dtype=np.float64)
    rho = _attr(node, "rho", [0.0])[:1]
    vectors = np.asarray(_attr(node, "support_vectors", []), dtype=np.float64)
    if with_kernel:
        x = c.as_rows(c.to_float(node.input[0]))
        sv = _f32(vectors).reshape(n_supports, -1)
        alpha = b.initializer(_f32(coefficients[:n_supports]).reshape(-1, 1), "coefficients")
        scores = b.op("MatMul", _kernel(c, node, x, sv), alpha)
        scores = b.op("Add", scores, b.initializer(_f32(rho), "rho"))
    else:
        if n_supports > 0:
            coefficients = coefficients[:n_supports] @ vectors.reshape(n_supports, -1)
        scores = _linear(c, node, coefficients.astype(np.float32), rho, 1)
    if not _attr(node, "one_class", 0):
        b.op("Identity", scores, out=node.output[0])
        return True
    positive = b.op("Greater", scores, b.const(_f32(0.0), "zero"))
    one, minus_one = b.const(_f32(1.0), "one"), b.const(_f32(-1.0), "minus_one")
    b.op("Where", positive, one, minus_one, out=node.output[0])
    return True


# -- SVMClassifier ----------------------------------------------------------------------------
def _labels(node: NodeProto) -> tuple[list, bool]:
    strings = _attr(node, "classlabels_strings")
    return (strings, True) if strings else (list(_attr(node, "classlabels_ints", [])), False)


def _pairs(n_classes: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(n_classes) for j in range(i + 1, n_classes)]


@_refusals("SVMRegressor", "SVMClassifier")
def svm_refusal(node: NodeProto) -> str | None:
    """Why :func:`onnxgrad.lower_ml_operators` leaves this ``SVMRegressor`` or
    ``SVMClassifier`` as it is (the attribute and its value), or ``None``."""
    transform = _attr(node, "post_transform", "NONE")
    if node.op_type == "SVMClassifier" and transform == "PROBIT":
        return _PROBIT
    coefficients = len(_attr(node, "coefficients", []))
    vectors = len(_attr(node, "support_vectors", []))
    if node.op_type == "SVMRegressor":
        n_supports = _attr(node, "n_supports", 0)
        if n_supports > 0 and (vectors % n_supports or coefficients < n_supports):
            return (
                f"support_vectors ({vectors} values) or coefficients ({coefficients}) do "
                f"not fit n_supports {n_supports}"
            )
        return None
    labels, _ = _labels(node)
    n_classes, n_pairs = len(labels), len(labels) * (len(labels) - 1) // 2
    if n_classes < 2:
        return f"{n_classes} class label(s) (classlabels_ints / classlabels_strings)"
    per_class = _attr(node, "vectors_per_class", [])
    n_vectors = sum(per_class)
    rho, prob_a = len(_attr(node, "rho", [])), len(_attr(node, "prob_a", []))
    if prob_a != len(_attr(node, "prob_b", [])):
        return "prob_a and prob_b differ in size"
    if n_vectors == 0:
        if coefficients % n_classes or not rho:
            return f"coefficients ({coefficients}) do not fit {n_classes} classes, or no rho"
        return None
    if len(per_class) != n_classes or vectors % n_vectors:
        return (
            f"vectors_per_class {list(per_class)} does not fit {n_classes} classes and "
            f"{vectors} support_vectors values"
        )
    if coefficients < (n_classes - 1) * n_vectors or rho < n_pairs or 0 < prob_a < n_pairs:
        return (
            f"coefficients ({coefficients} values), rho ({rho}) or prob_a ({prob_a}) too "
            f"short for {n_classes} classes and {n_vectors} vectors"
        )
    return None


@_lowers("SVMClassifier")
def _svm_classifier(c: _Context, node: NodeProto) -> bool:
    if svm_refusal(node) or c.rank(node.input[0]) is None:
        return False
    labels, strings = _labels(node)
    x = c.as_rows(c.to_float(node.input[0]))
    if sum(_attr(node, "vectors_per_class", [])) == 0:
        return _liblinear_classifier(c, node, x, labels, strings)
    b = c.b
    scores = _pair_scores(c, node, x, len(labels))
    _class_lookup(c, node, strings, labels, _most_voted(c, scores, len(labels)))
    if len(node.output) < 2 or not node.output[1]:
        return True
    transform = _attr(node, "post_transform", "NONE")
    if _attr(node, "prob_a", []):
        probabilities = _coupled(c, _pair_probabilities(c, node, scores), len(labels))
        _post_transform(c, probabilities, transform, node.output[1])
    elif len(labels) == 2:
        b.op("Concat", *_two_columns(c, scores, transform), out=node.output[1], axis=1)
    else:
        _post_transform(c, scores, transform, node.output[1])
    return True


def _two_columns(c: _Context, s: str, transform: str) -> tuple[str, str]:
    """The two columns onnxruntime writes for one pair score ``s``: ``[-s, s]`` (``NONE``),
    ``[logistic(-s), logistic(s)]`` (``LOGISTIC``, as onnxruntime 1.32 computes it; 1.19
    writes ``[1 - s, s]``), ``[1 - s, s]`` (``SOFTMAX``, ``SOFTMAX_ZERO``)."""
    b = c.b
    if transform == "NONE":
        return b.op("Neg", s), s
    if transform == "LOGISTIC":
        return b.op("Sigmoid", b.op("Neg", s)), b.op("Sigmoid", s)
    return b.op("Sub", _one(c), s), s


def _one(c: _Context) -> str:
    return c.b.const(_f32(1.0), "one")


def _pair_scores(c: _Context, node: NodeProto, x: str, n_classes: int) -> str:
    """``s = K(x, V) W + rho``, ``[N, P]``, where column ``(i, j)`` of ``W`` gathers the dual
    coefficients of the vectors of classes ``i`` and ``j`` (zeros elsewhere)."""
    b = c.b
    per_class = [int(v) for v in _attr(node, "vectors_per_class")]
    n_vectors, pairs = sum(per_class), _pairs(n_classes)
    vectors = _f32(_attr(node, "support_vectors")).reshape(n_vectors, -1)
    coefficients = _f32(_attr(node, "coefficients"))[: (n_classes - 1) * n_vectors]
    kernel = _kernel(c, node, x, vectors)
    starts = np.cumsum([0, *per_class])
    index = np.zeros((n_vectors, len(pairs)), np.int64)
    mask = np.zeros((n_vectors, len(pairs)), bool)
    for k, (i, j) in enumerate(pairs):
        for owner, row in ((i, j - 1), (j, i)):
            rows = np.arange(starts[owner], starts[owner + 1])
            index[rows, k] = row * n_vectors + rows
            mask[rows, k] = True
    dual = b.initializer(coefficients.reshape(n_classes - 1, n_vectors), "coefficients")
    flat = b.op("Reshape", dual, b.const(np.array([-1], np.int64), "flat"))
    pair_weights = b.op(
        "Mul",
        b.op("Gather", flat, b.const(index, "pair_index"), axis=0),
        b.op("Cast", b.const(mask, "pair_mask"), to=TensorProto.FLOAT),
    )
    rho = b.initializer(_f32(_attr(node, "rho"))[: len(pairs)], "rho")
    double = [b.op("Cast", v, to=TensorProto.DOUBLE) for v in (kernel, pair_weights, rho)]
    scores = b.op("Add", b.op("MatMul", double[0], double[1]), double[2])
    return b.op("Cast", scores, to=TensorProto.FLOAT, hint="pair_scores")


def _most_voted(c: _Context, scores: str, n_classes: int) -> str:
    """``argmax_c votes_c`` (first on ties), pair ``(i, j)`` voting ``i`` when ``s_ij > 0``:
    ``votes = [s > 0] D + base`` with ``D[(i, j)] = e_i - e_j``, ``base_c = #{(i, c)}``."""
    b = c.b
    towards = np.zeros((len(_pairs(n_classes)), n_classes), np.float32)
    base = np.zeros(n_classes, np.float32)
    for k, (i, j) in enumerate(_pairs(n_classes)):
        towards[k, i], towards[k, j] = 1, -1
        base[j] += 1
    positive = b.op("Greater", scores, b.const(_f32(0.0), "zero"))
    wins = b.op(
        "MatMul", b.op("Cast", positive, to=TensorProto.FLOAT), b.const(towards, "votes_for")
    )
    votes = b.op("Add", wins, b.const(base, "votes_base"), hint="votes")
    return b.op("ArgMax", votes, hint="class_index", axis=1, keepdims=0)


def _pair_probabilities(c: _Context, node: NodeProto, scores: str) -> str:
    """``r = clip(1 - logistic(A s + B), 1e-7, 1 - 1e-7)`` with onnxruntime's logistic
    ``l(v) = 1 / (1 + exp(-|v|))`` for ``v >= 0``, ``1 - l(v)`` below."""
    b = c.b
    n_pairs = len(_pairs(len(_labels(node)[0])))
    a = b.initializer(_f32(_attr(node, "prob_a"))[:n_pairs], "prob_a")
    platt = b.op(
        "Add",
        b.op("Mul", scores, a),
        b.initializer(_f32(_attr(node, "prob_b"))[:n_pairs], "prob_b"),
    )
    one = _one(c)
    half = b.op("Div", one, b.op("Add", one, b.op("Exp", b.op("Neg", b.op("Abs", platt)))))
    negative = b.op("Less", platt, b.const(_f32(0.0), "zero"))
    logistic = b.op("Where", negative, b.op("Sub", one, half), half)
    r = b.op("Sub", one, logistic)
    low, high = _PROBABILITY_FLOOR, np.float32(1) - _PROBABILITY_FLOOR
    r = b.op("Max", r, b.const(low, "floor"))
    return b.op("Min", r, b.const(high, "ceiling"), hint="pair_probabilities")


# -- pairwise coupling ------------------------------------------------------------------------
def _coupling_matrix(c: _Context, r: str, n_classes: int) -> tuple[str, str]:
    """``Q`` (``[N, C, C]``) and its diagonal (``[N, C]``) from the pairwise probabilities:
    ``Q_ij = -r_ji r_ij`` (``i != j``), ``Q_ii = sum_{j != i} r_ji^2`` summed in ``j`` order."""
    b = c.b
    pairs = _pairs(n_classes)
    n_pairs = len(pairs)
    column = {pair: k for k, pair in enumerate(pairs)}
    r_minus = b.op("Sub", _one(c), r)
    squares = b.op("Concat", b.op("Mul", r, r), b.op("Mul", r_minus, r_minus), axis=1)

    def square_of(j: int, i: int) -> int:  # the column of r_ji^2 in ``squares``
        return column[(j, i)] if j < i else n_pairs + column[(i, j)]

    diagonal = None
    for step in range(n_classes - 1):
        others = [[j for j in range(n_classes) if j != i][step] for i in range(n_classes)]
        index = np.array([square_of(j, i) for i, j in enumerate(others)], np.int64)
        term = b.op("Gather", squares, b.const(index, "square_index"), axis=1)
        diagonal = term if diagonal is None else b.op("Add", diagonal, term)
    table = b.op("Concat", b.op("Neg", b.op("Mul", r_minus, r)), diagonal, axis=1)
    index = np.array(
        [
            [n_pairs + i if i == j else column[(min(i, j), max(i, j))] for j in range(n_classes)]
            for i in range(n_classes)
        ],
        np.int64,
    )
    return b.op("Gather", table, b.const(index, "q_index"), axis=1, hint="q"), diagonal


def _coupled(c: _Context, r: str, n_classes: int) -> str:
    """Class probabilities ``p`` from the pairwise ``r`` by onnxruntime's iteration: from
    ``p = 1 / C``, each sweep stops a row when ``max_i |(Qp)_i - p^T Q p| < 0.005 / C``,
    else updates ``p_i += ((p^T Q p) - (Qp)_i) / Q_ii`` for ``i = 0..C-1`` in turn,
    renormalising ``p``, ``Qp`` and ``p^T Q p`` after each; at most ``max(100, C)`` sweeps
    (``Loop``)."""
    b = c.b
    q, diagonal = _coupling_matrix(c, r, n_classes)
    rows = b.op("Gather", b.op("Shape", q), b.const(np.array([0, 1], np.int64), "n_c"), axis=0)
    uniform = np.array([1 / np.float32(n_classes)], np.float32)
    start = b.op(
        "ConstantOfShape",
        rows,
        value=helper.make_tensor("uniform", TensorProto.FLOAT, [1], uniform),
    )
    body = helper.make_graph([], f"{b.prefix}_coupling_sweep", [], [])
    sweep = b.nested(body)
    names = [sweep.fresh(hint) for hint in ("sweep", "running", "p")]
    done, p = _coupling_sweep(sweep, q, diagonal, names[2], n_classes)
    unfinished = sweep.op("Cast", sweep.op("Not", done), to=TensorProto.FLOAT)
    keep_going = sweep.op(
        "Greater",
        sweep.reduce("ReduceSum", unfinished, None, keepdims=0),
        sweep.const(_f32(0.0), "zero"),
    )
    shape = [None, n_classes]
    body.input.extend(
        [
            helper.make_tensor_value_info(names[0], TensorProto.INT64, []),
            helper.make_tensor_value_info(names[1], TensorProto.BOOL, []),
            helper.make_tensor_value_info(names[2], TensorProto.FLOAT, shape),
        ]
    )
    body.output.extend(
        [
            helper.make_tensor_value_info(keep_going, TensorProto.BOOL, []),
            helper.make_tensor_value_info(p, TensorProto.FLOAT, shape),
        ]
    )
    sweeps = b.const(np.array(max(_COUPLING_SWEEPS, n_classes), np.int64), "max_sweeps")
    return b.op("Loop", sweeps, b.const(np.array(True), "true"), start, hint="coupled", body=body)


def _coupling_sweep(b, q: str, diagonal: str, p: str, n_classes: int) -> tuple[str, str]:
    """One sweep of :func:`_coupled` on ``p`` (``[N, C]``): ``(done [N, 1], p')``, ``p' = p``
    on the rows already done. Sums run in onnxruntime's order, so each row takes as many
    sweeps as there."""
    at = [b.const(np.array(i, np.int64), f"at{i}") for i in range(n_classes)]
    cols = [b.const(np.array([i], np.int64), f"col{i}") for i in range(n_classes)]

    def column(value: str, i: int) -> str:
        return b.op("Gather", value, cols[i], axis=1)

    qp = pqp = None
    for j in range(n_classes):
        term = b.op("Mul", b.op("Gather", q, at[j], axis=2), column(p, j))
        qp = term if qp is None else b.op("Add", qp, term)
    for i in range(n_classes):
        term = b.op("Mul", column(p, i), column(qp, i))
        pqp = term if pqp is None else b.op("Add", pqp, term)
    error = b.reduce("ReduceMax", b.op("Abs", b.op("Sub", qp, pqp)), [1], keepdims=1)
    tolerance = np.float32(0.005) / np.float32(n_classes)
    done = b.op("Less", error, b.const(tolerance, "tolerance"), hint="done")
    one, two = b.const(_f32(1.0), "one"), b.const(_f32(2.0), "two")
    new_p = p
    for i in range(n_classes):
        q_ii, qp_i = column(diagonal, i), column(qp, i)
        diff = b.op("Div", b.op("Sub", pqp, qp_i), q_ii, hint="diff")
        only_i = b.const(np.arange(n_classes) == i, f"only{i}")
        new_p = b.op("Where", only_i, b.op("Add", new_p, diff), new_p)
        scale = b.op("Add", one, diff)
        growth = b.op("Mul", diff, b.op("Add", b.op("Mul", diff, q_ii), b.op("Mul", two, qp_i)))
        pqp = b.op("Div", b.op("Div", b.op("Add", pqp, growth), scale), scale)
        qp = b.op(
            "Div", b.op("Add", qp, b.op("Mul", diff, b.op("Gather", q, at[i], axis=1))), scale
        )
        new_p = b.op("Div", new_p, scale)
    return done, b.op("Where", done, p, new_p, hint="p")


# -- liblinear layout -------------------------------------------------------------------------
def _liblinear_classifier(
    c: _Context, node: NodeProto, x: str, labels: list, strings: bool
) -> bool:
    """Scores ``x a^T + rho_0`` (``C`` columns); see the module docstring for the label."""
    b = c.b
    n_classes = len(labels)
    coefficients = _f32(_attr(node, "coefficients")).reshape(n_classes, -1)
    weights = b.initializer(coefficients.T.copy(), "coefficients")
    rho = b.initializer(_f32(_attr(node, "rho"))[:1], "rho")
    scores = b.op("Add", b.op("MatMul", x, weights), rho, hint="scores")
    index = b.op("ArgMax", scores, hint="class_index", axis=1, keepdims=0)
    if n_classes == 2 and not _attr(node, "prob_a", []):
        best = b.reduce("ReduceMax", scores, [1], keepdims=0)
        positive = bool((coefficients >= 0).all())
        threshold = b.const(_f32(0.5 if positive else 0.0), "threshold")
        if not positive:
            second = b.op("Greater", best, threshold)
        else:
            second = b.op("Not", b.op("Less", best, threshold))
        index = b.op("Where", second, b.const(np.array(1, np.int64), "second"), index)
    _class_lookup(c, node, strings, labels, index)
    if len(node.output) > 1 and node.output[1]:
        _post_transform(c, scores, _attr(node, "post_transform", "NONE"), node.output[1])
    return True
