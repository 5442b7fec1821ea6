"""Linear algebra: MatMul, Gemm, Einsum, Det (see :func:`det_grad`).

* ``C = A B`` (MatMul, numpy semantics): ``A_bar = C_bar B^T``, ``B_bar = A^T C_bar``, summed
  over the batch dimensions an operand was broadcast along; a 1-D operand is a row
  (left) or a column (right) vector whose added dimension is dropped again. Operands of
  unknown rank get the same formulas built on run-time shapes
  (:func:`_matmul_any_rank_grads`).
* ``Y = alpha A' B' + beta C`` (Gemm, ``A' = A^T`` if ``transA``, ``B' = B^T`` if ``transB``):
  ``A'_bar = alpha Y_bar B'^T``, ``B'_bar = alpha A'^T Y_bar``, ``C_bar = beta Y_bar`` summed
  back to ``C``'s shape. Each gradient is a single Gemm.
* Einsum: the gradient of an operand is the einsum of the output gradient with the other
  operands, producing that operand's subscripts; see :func:`einsum_operand_grad`.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
from onnx import numpy_helper

from onnxgrad._onnx_utils import np_dtype
from onnxgrad.derivative.autodiff.registry import register
from onnxgrad.derivative.autodiff.rules._shape_helpers import reshape_to


def _swap_last(b, x: str, rank: int) -> str:
    return b.op("Transpose", x, perm=[*range(rank - 2), rank - 1, rank - 2])


def _with_last(shape: tuple | None, rank: int, last) -> tuple:
    """``shape`` (rank ``rank``, dims unknown if ``shape`` is) with its last dim replaced."""
    dims = tuple(shape) if shape is not None and len(shape) == rank else (None,) * rank
    return (*dims[:-1], last)


def _with_last_two(shape: tuple | None, rank: int, first, last) -> tuple:
    dims = tuple(shape) if shape is not None and len(shape) == rank else (None,) * rank
    return (*dims[:-2], first, last)


def _last_dim(b, x: str):
    shape = b.shape(x)
    return None if not shape else shape[-1]


# -- MatMul -------------------------------------------------------------------------------


@register("MatMul", since=11)
def matmul_grad(b, node, grads, needs):
    (g,) = grads
    a, w = node.inputs
    rank_a, rank_w = b.rank(a), b.rank(w)
    if rank_a is None or rank_w is None:
        return _matmul_any_rank_grads(b, g, a, w, needs)
    out_shape = b.shape(node.outputs[0])
    ga = _matmul_left_grad(b, g, a, w, rank_a, rank_w, out_shape) if needs[0] else None
    gw = _matmul_right_grad(b, g, a, w, rank_a, rank_w, out_shape) if needs[1] else None
    return [ga, gw]


def _matmul_left_grad(b, g, a, w, rank_a, rank_w, out_shape):
    """``A_bar``: ``(..., M, N) x (..., N, K)`` then the batch sum, or a vector product."""
    if rank_a == 1 and rank_w == 1:
        return b.mul(g, w)
    if rank_a == 1:
        if rank_w == 2:
            return b.op("MatMul", w, g)
        column = b.op("MatMul", w, b.unsqueeze(g, [-1]))
        return b.reduce_sum(column, [*range(rank_w - 2), rank_w - 1], keepdims=False)
    if rank_w == 1:
        return b.mul(b.unsqueeze(g, [-1]), w)
    if rank_a == 2 and rank_w == 2:
        return b.op("Gemm", g, w, transB=1)
    product = b.op("MatMul", g, _swap_last(b, w, rank_w))
    if rank_w == 2:
        return product
    if rank_a == 2:
        return b.reduce_sum(product, list(range(rank_w - 2)), keepdims=False)
    rank = max(rank_a, rank_w)
    return b.unbroadcast(product, a, _with_last(out_shape, rank, _last_dim(b, a)))


def _matmul_right_grad(b, g, a, w, rank_a, rank_w, out_shape):
    """``B_bar``: ``(..., K, M) x (..., M, N)`` then the batch sum, or a vector product."""
    if rank_a == 1 and rank_w == 1:
        return b.mul(g, a)
    if rank_a == 1:
        return b.mul(b.unsqueeze(a, [-1]), b.unsqueeze(g, [-2]))
    if rank_w == 1:
        if rank_a == 2:
            return b.op("MatMul", g, a)
        rows = b.op("Flatten", a, axis=rank_a - 1)
        return b.op("MatMul", b.op("Reshape", g, b.ints([-1])), rows)
    if rank_w == 2:
        if rank_a == 2:
            return b.op("Gemm", a, g, transA=1)
        rows_a = b.op("Flatten", a, axis=rank_a - 1)
        rows_g = b.op("Flatten", g, axis=rank_a - 1)
        return b.op("Gemm", rows_a, rows_g, transA=1)
    product = b.op("MatMul", _swap_last(b, a, rank_a), g)
    if rank_a == 2:
        return product
    rank = max(rank_a, rank_w)
    w_shape = b.shape(w)
    rows = None if not w_shape else w_shape[-2]
    last = None if not out_shape else out_shape[-1]
    return b.unbroadcast(product, w, _with_last_two(out_shape, rank, rows, last))


def _matmul_any_rank_grads(b, g, a, w, needs):
    """Both gradients when shape inference cannot give an operand's rank (a value inside a
    function body or a loop body): built with run-time shapes, for every rank.

    A 1-D ``A`` becomes a row ``(1, N)`` and a 1-D ``B`` a column ``(N, 1)``; the output
    gradient gets the dims these add (:func:`_promoted_output_grad`). Then, with
    ``swap`` exchanging the last two axes (:func:`_swap_last_any_rank`),
    ``A_bar = unbroadcast(G B^T)`` and ``B_bar = unbroadcast(A^T G)``, the batch axes an
    operand was broadcast along summed by the engine's dynamic unbroadcast, and each result
    reshaped to its operand's shape. Slower than the static-rank path (Shape arithmetic,
    two extra Reshapes per operand), which is used whenever the ranks are known.
    """
    one = b.ints([1])
    rank_a = b.op("Size", b.shape_of(a))
    rank_w = b.op("Size", b.shape_of(w))
    pad_a = b.op("Max", b.op("Sub", b.ints(2), rank_a), b.ints(0))
    pad_w = b.op("Max", b.op("Sub", b.ints(2), rank_w), b.ints(0))
    ones_a = b.op("ConstantOfShape", b.op("Reshape", pad_a, one), value=_int64_tensor(1))
    ones_w = b.op("ConstantOfShape", b.op("Reshape", pad_w, one), value=_int64_tensor(1))
    a2 = reshape_to(b, a, b.op("Concat", ones_a, b.shape_of(a), axis=0), None)
    w2 = reshape_to(b, w, b.op("Concat", b.shape_of(w), ones_w, axis=0), None)
    g2 = _promoted_output_grad(b, g, rank_a, rank_w)
    ga = gw = None
    if needs[0]:
        full = b.op("MatMul", g2, _swap_last_any_rank(b, w2))
        ga = reshape_to(b, b.unbroadcast(full, a2, None), b.shape_of(a), a)
    if needs[1]:
        full = b.op("MatMul", _swap_last_any_rank(b, a2), g2)
        gw = reshape_to(b, b.unbroadcast(full, w2, None), b.shape_of(w), w)
    return [ga, gw]


def _int64_tensor(value: int):
    return numpy_helper.from_array(np.array([value], dtype=np.int64))


def _promoted_output_grad(b, g, rank_a: str, rank_w: str) -> str:
    """``G`` reshaped to ``batch + (M or 1, K or 1)``: the output of the product of the
    promoted operands. ``G`` has shape ``batch + [M if rank(A) > 1] + [K if rank(B) > 1]``."""
    dims = b.shape_of(g)
    rank_g = b.op("Size", dims)
    has_m = b.op("Min", b.op("Sub", rank_a, b.ints(1)), b.ints(1))
    has_k = b.op("Min", b.op("Sub", rank_w, b.ints(1)), b.ints(1))
    end_m = b.op("Sub", rank_g, has_k)
    start_m = b.op("Sub", end_m, has_m)
    one = b.ints([1])

    def dim_or_one(start, end):
        piece = b.op("Slice", dims, b.unsqueeze(start, [0]), b.unsqueeze(end, [0]))
        return b.op("Slice", b.op("Concat", piece, one, axis=0), b.ints([0]), one)

    batch = b.op("Slice", dims, b.ints([0]), b.unsqueeze(start_m, [0]))
    shape = b.op("Concat", batch, dim_or_one(start_m, end_m), dim_or_one(end_m, rank_g), axis=0)
    return reshape_to(b, g, shape)


def _swap_last_any_rank(b, x: str) -> str:
    """``x`` (rank >= 2, unknown) with its last two axes exchanged: viewed as
    ``(batch, R, C)``, transposed, and reshaped to ``batch dims + (C, R)``."""
    dims = b.shape_of(x)
    rows = b.op("Slice", dims, b.ints([-2]), b.ints([-1]))
    cols = b.op("Slice", dims, b.ints([-1]), b.ints([np.iinfo(np.int64).max]))
    batch = b.op("Slice", dims, b.ints([0]), b.ints([-2]))
    cube = b.op("Reshape", x, b.op("Concat", b.ints([-1]), rows, cols, axis=0))
    swapped = b.op("Transpose", cube, perm=[0, 2, 1])
    return reshape_to(b, swapped, b.op("Concat", batch, cols, rows, axis=0))


# -- Gemm ---------------------------------------------------------------------------------


@register("Gemm", since=11)
def gemm_grad(b, node, grads, needs):
    (g,) = grads
    a, w = node.inputs[:2]
    c = node.input(2)
    alpha = float(node.attr("alpha", 1.0))
    beta = float(node.attr("beta", 1.0))
    trans_a, trans_b = bool(node.attr("transA", 0)), bool(node.attr("transB", 0))
    ga = gw = gc = None
    if needs[0]:
        if trans_a:
            ga = _gemm(b, w, g, trans_b, True, alpha)
        else:
            ga = _gemm(b, g, w, False, not trans_b, alpha)
    if needs[1]:
        if trans_b:
            gw = _gemm(b, g, a, True, trans_a, alpha)
        else:
            gw = _gemm(b, a, g, not trans_a, False, alpha)
    if c is not None and needs[2]:
        gc = b.unbroadcast(g, c, b.shape(node.outputs[0]))
        if beta != 1.0:
            gc = b.mul(gc, b.const(beta, like=g))
    return [ga, gw, gc]


def _gemm(b, left: str, right: str, trans_left: bool, trans_right: bool, alpha: float) -> str:
    return b.op(
        "Gemm",
        left,
        right,
        transA=1 if trans_left else None,
        transB=1 if trans_right else None,
        alpha=None if alpha == 1.0 else alpha,
    )


# -- Einsum -------------------------------------------------------------------------------

ELLIPSIS = "..."


@dataclass(frozen=True)
class EinsumSpec:
    """An einsum equation with every subscript explicit: one letter per dimension.

    The dimensions an ellipsis stands for get fresh letters (``broadcast``), right-aligned
    across operands (ONNX requires every ellipsis to stand for as many dimensions). They are
    the only dimensions whose sizes may differ between operands (1 against n), so the
    equations built from a spec write them back as an ellipsis (:meth:`render`).
    """

    inputs: tuple[str, ...]
    output: str
    broadcast: str
    spare: str

    @classmethod
    def parse(cls, equation: str, ranks: list[int | None], where: str) -> EinsumSpec:
        text = equation.replace(" ", "")
        lhs, arrow, rhs = text.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(ranks):
            raise ValueError(
                f"{where}: equation {equation!r} has {len(terms)} operands, the node {len(ranks)}"
            )
        for term in [*terms, rhs]:
            if not set(term.replace(ELLIPSIS, "")) <= set(string.ascii_letters):
                raise ValueError(f"{where}: cannot parse the einsum equation {equation!r}")
        used = set(text) & set(string.ascii_letters)
        spare = [c for c in string.ascii_letters if c not in used]
        ellipsis_ranks = [_ellipsis_rank(t, r, equation, where) for t, r in zip(terms, ranks)]
        width = max(ellipsis_ranks)
        if width > len(spare):
            raise NotImplementedError(f"{where}: too many dimensions in einsum {equation!r}")
        fresh, spare = "".join(spare[:width]), "".join(spare[width:])
        inputs = tuple(
            t.replace(ELLIPSIS, fresh[width - n :]) for t, n in zip(terms, ellipsis_ranks)
        )
        if arrow:
            output = rhs.replace(ELLIPSIS, fresh)
        else:
            counts = "".join(inputs)
            output = fresh + "".join(
                sorted(c for c in set(counts) if c not in fresh and counts.count(c) == 1)
            )
        return cls(inputs, output, fresh, spare)

    def render(self, *terms: str) -> str:
        """The equation ``terms[0],...,terms[-2]->terms[-1]``, with the ellipsis put back."""
        return ",".join(map(self._render, terms[:-1])) + "->" + self._render(terms[-1])

    def _render(self, term: str) -> str:
        run = "".join(c for c in term if c in self.broadcast)
        return term.replace(run, ELLIPSIS) if run else term

    def fresh_letters(self, count: int, where: str) -> str:
        if count > len(self.spare):
            raise NotImplementedError(f"{where}: no letters left to differentiate the einsum")
        return self.spare[:count]


def _ellipsis_rank(term: str, rank: int | None, equation: str, where: str) -> int:
    if ELLIPSIS not in term:
        return 0
    if rank is None:
        raise NotImplementedError(
            f"{where}: einsum {equation!r} uses an ellipsis on an operand of unknown rank"
        )
    return rank - len(term.replace(ELLIPSIS, ""))


@register("Einsum", since=12)
def einsum_grad(b, node, grads, needs):
    (g,) = grads
    where = f"Einsum node {node.name or node.outputs[0]!r}"
    equation = node.attr("equation")
    if not equation:
        raise ValueError(f"{where} has no 'equation' attribute")
    spec = EinsumSpec.parse(equation, [b.rank(x) for x in node.inputs], where)
    return [
        einsum_operand_grad(b, spec, node.inputs, node.outputs[0], g, i, where) if need else None
        for i, need in enumerate(needs)
    ]


def einsum_operand_grad(
    b, spec: EinsumSpec, operands: list[str], output_name: str, g: str, i: int, where: str
) -> str:
    """Gradient of operand ``i``, in four steps:

    1. contract ``g`` (subscripts of the output) with the other operands into the distinct
       letters of operand ``i`` that occur elsewhere: ``'ik,jk->ij'`` for ``A`` in
       ``'ij,jk->ik'``;
    2. broadcast along the letters only operand ``i`` has (they were summed over): Unsqueeze
       and Expand, as in ``'ij->i'``;
    3. put a repeated letter back on a diagonal with identity matrices: ``'i,iJ->iJ'`` for
       ``'ii->i'``;
    4. sum the ellipsis dimensions operand ``i`` was broadcast along.
    """
    x, subscripts = operands[i], spec.inputs[i]
    distinct = "".join(dict.fromkeys(subscripts))
    others = [(name, s) for j, (name, s) in enumerate(zip(operands, spec.inputs)) if j != i]
    elsewhere = set(spec.output).union(*(s for _, s in others))
    kept = "".join(c for c in distinct if c in elsewhere)
    grad = _contract(b, spec, g, others, kept)
    if kept != distinct:
        missing = [k for k, c in enumerate(distinct) if c not in elsewhere]
        shape = _dims_at(b, x, [subscripts.index(c) for c in distinct])
        grad = b.op("Expand", b.unsqueeze(grad, missing), shape)
    if distinct != subscripts:
        grad = _embed_diagonals(b, spec, grad, x, subscripts, distinct, where)
    return _sum_broadcast(b, spec, grad, x, subscripts, output_name, others)


def _contract(b, spec: EinsumSpec, g: str, others: list[tuple[str, str]], target: str) -> str:
    output = spec.output
    if not others:
        if target == output:
            return g
        return b.op("Transpose", g, perm=[output.index(c) for c in target])
    inputs = [output, *(s for _, s in others)]
    summed = spec.broadcast if _drops_ellipsis(spec, inputs, target) else ""
    equation = spec.render(*inputs, summed + target)
    result = b.op("Einsum", g, *(name for name, _ in others), equation=equation)
    if summed:
        return b.reduce_sum(result, list(range(len(summed))), keepdims=False)
    return result


def _drops_ellipsis(spec: EinsumSpec, inputs: list[str], target: str) -> bool:
    """Whether ``target`` lacks the ellipsis of some input: onnxruntime refuses such an
    equation, so the ellipsis is kept in the result and summed by a ReduceSum."""
    letters = set(spec.broadcast)
    return bool(letters) and not letters & set(target) and any(letters & set(t) for t in inputs)


def _dims_at(b, x: str, positions: list[int]) -> str:
    """The sizes of ``x`` at ``positions``, as a 1-D int64 tensor."""
    shape = b.static_shape(x)
    if shape is not None:
        return b.ints([shape[p] for p in positions])
    dims = b.shape_of(x)
    if positions == list(range(len(positions))) and b.rank(x) == len(positions):
        return dims
    return b.op("Gather", dims, b.ints(positions), axis=0)


def _embed_diagonals(b, spec, grad, x, subscripts, distinct, where) -> str:
    """``out[.., a, .., a', ..] = grad[.., a, ..] delta(a, a')`` for each repeated letter."""
    fresh = iter(spec.fresh_letters(len(subscripts) - len(distinct), where))
    seen: set[str] = set()
    result, identities = [], []
    for letter in subscripts:
        if letter not in seen:
            seen.add(letter)
            result.append(letter)
            continue
        twin = next(fresh)
        result.append(twin)
        identities.append((letter + twin, _identity(b, x, subscripts.index(letter))))
    equation = spec.render(distinct, *(t for t, _ in identities), "".join(result))
    return b.op("Einsum", grad, *(e for _, e in identities), equation=equation)


def _identity(b, x: str, position: int) -> str:
    """The identity matrix of the size of dimension ``position`` of ``x``."""
    shape = b.shape(x)
    if shape is not None and isinstance(shape[position], int):
        return b.const(np.eye(shape[position]), like=x)
    size = _dims_at(b, x, [position])
    square = b.op("Concat", size, size, axis=0)
    zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(b.dtype(x))))
    return b.op("EyeLike", b.op("ConstantOfShape", square, value=zero))


def _sum_broadcast(b, spec, grad, x, subscripts, output_name, others) -> str:
    """Sum the dimensions where ``x`` has size 1 and the result of the contraction more."""
    x_shape = b.shape(x) or (None,) * len(subscripts)
    sizes = _letter_sizes(b, [(output_name, spec.output), *others])
    estimate, needed = [], False
    for letter, own in zip(subscripts, x_shape):
        size = _broadcast_dim(sizes[letter]) if letter in sizes else own
        estimate.append(size)
        if (own == 1 and size != 1) or (
            letter in spec.broadcast and (own is None or (not isinstance(own, int) and own != size))
        ):
            needed = True
    if not needed:
        return grad
    return b.unbroadcast(grad, x, tuple(estimate))


def _letter_sizes(b, terms: list[tuple[str, str]]) -> dict[str, list]:
    sizes: dict[str, list] = {}
    for name, subscripts in terms:
        shape = b.shape(name)
        for position, letter in enumerate(subscripts):
            dim = shape[position] if shape is not None and len(shape) == len(subscripts) else None
            sizes.setdefault(letter, []).append(dim)
    return sizes


def _broadcast_dim(dims: list):
    """The broadcast of several sizes: an int, a symbolic name, or ``None`` if unknown."""
    large = [d for d in dims if d != 1]
    if not large:
        return 1
    ints = [d for d in large if isinstance(d, int)]
    if ints:
        return ints[0]
    if None in large or len(set(large)) > 1:
        return None
    return large[0]


# -- Det ----------------------------------------------------------------------------------
@register("Det", since=11)
def det_grad(b, node, grads, needs):
    """``X_bar = g C`` with ``C`` the cofactor matrix, ``C_ij = (-1)^(i+j) det(X without row
    i and column j)``: ``M^2`` determinants of size ``M - 1`` (one batched Det), exact for
    singular matrices too, where ``det(X) X^-T`` is undefined (and ONNX has no inverse)."""
    (g,) = grads
    x = node.inputs[0]
    shape = b.shape(x)
    if shape is None or not isinstance(shape[-1], int):
        raise NotImplementedError(
            f"the gradient of Det node {node.name or '<unnamed>'!r} needs the static matrix "
            f"size of {x!r}"
        )
    rank, m = len(shape), shape[-1]
    seed = b.unsqueeze(g, [rank - 2, rank - 1])
    if m == 1:
        return [b.op("Expand", seed, b.shape_of(x))]
    others = np.array([[k for k in range(m) if k != i] for i in range(m)], dtype=np.int64)
    rows = b.op("Gather", x, b.const(others), axis=rank - 2)  # [..., i, m-1, m]
    minors = b.op("Gather", rows, b.const(others), axis=rank)  # [..., i, m-1, j, m-1]
    perm = [*range(rank - 2), rank - 2, rank, rank - 1, rank + 1]
    cofactors = b.op("Det", b.op("Transpose", minors, perm=perm))
    signs = (-1.0) ** np.add.outer(np.arange(m), np.arange(m))
    return [b.mul(b.mul(cofactors, b.const(signs, like=x)), seed)]
