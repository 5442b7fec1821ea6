"""Rule table entries: MatMul (1-D, batched, broadcast; operands of unknown rank too), Gemm
(transposes, alpha, beta, C), Einsum (contractions, implicit output, diagonals, summed
letters, ellipsis broadcasting)."""

import numpy as np
from onnx import helper, numpy_helper

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(5)


def r(*shape):
    return rng.standard_normal(shape)


MATMUL_SHAPES = [
    ((2, 3), (3, 4), 13),
    ((3,), (3, 4), 13),
    ((2, 3), (3,), 18),
    ((3,), (3,), 13),
    ((3,), (2, 3, 2), 18),
    ((2, 2, 3), (3,), 13),
    ((2, 2, 3), (3, 2), 13),
    ((2, 3), (2, 3, 2), 18),
    ((2, 2, 3), (2, 3, 2), 21),
    ((2, 1, 2, 3), (3, 3, 2), 13),
    ((1, 2, 3), (2, 3, 2), 18),
]

GEMM_SETTINGS = [
    # (A shape, B shape, C shape or None, attributes, opset)
    ((2, 3), (3, 4), (4,), {}, 13),
    ((3, 2), (3, 4), (2, 1), {"transA": 1}, 13),
    ((2, 3), (4, 3), (), {"transB": 1, "alpha": 0.5}, 18),
    ((3, 2), (4, 3), (2, 4), {"transA": 1, "transB": 1, "beta": 2.0}, 21),
    ((2, 3), (3, 4), None, {"alpha": -1.5}, 13),
    ((2, 3), (3, 4), (1, 4), {"alpha": 2.0, "beta": 0.25}, 18),
]

EINSUM_SETTINGS = [
    # (equation, operand shapes, opset)
    ("ij,jk->ik", [(2, 3), (3, 4)], 13),
    ("ij,jk", [(2, 3), (3, 2)], 18),
    ("bij,bjk->bik", [(2, 2, 3), (2, 3, 2)], 13),
    ("ij,ij->i", [(2, 3), (2, 3)], 18),
    ("i,i", [(4,), (4,)], 13),
    ("i,j->ij", [(2,), (3,)], 21),
    ("ijk->kji", [(2, 3, 2)], 13),
    ("ba", [(2, 3)], 18),
    ("ij->", [(2, 3)], 13),
    ("ijk,j->k", [(2, 3, 2), (3,)], 18),
    ("ii->i", [(3, 3)], 13),
    ("ii", [(3, 3)], 18),
    ("iij,jk->ik", [(2, 2, 3), (3, 2)], 21),
    ("ij,ji->", [(2, 3), (3, 2)], 13),
    ("...ij,...jk->...ik", [(2, 2, 3), (2, 3, 2)], 18),
    ("...ij,jk->...ik", [(2, 1, 2, 3), (3, 2)], 13),
    ("...i,...i->...", [(1, 3), (2, 3)], 18),
    ("i...,i->...", [(3, 2, 2), (3,)], 21),
    ("...,...->...", [(2, 1), (1, 3)], 18),
]


def hidden_rank_matmul(out_shape):
    """``MatMul(a, b)`` on operands whose rank shape inference cannot find (reshaped to
    their own shape, read through a Compress), as values inside function bodies can be;
    the product is reshaped to its known shape for the graph output."""

    def graph(inputs, outputs):
        nodes, hidden = [], []
        for name in inputs:
            nodes += [
                helper.make_node("Shape", [name], [f"{name}_dims"]),
                helper.make_node("Greater", [f"{name}_dims", "minus_one"], [f"{name}_keep"]),
                helper.make_node("Compress", [f"{name}_dims", f"{name}_keep"], [f"{name}_s"]),
                helper.make_node("Reshape", [name, f"{name}_s"], [f"{name}_h"]),
            ]
            hidden.append(f"{name}_h")
        constants = [
            helper.make_node("Constant", [], ["minus_one"], value_int=-1),
            helper.make_node(
                "Constant", [], ["out_shape"], value=numpy_helper.from_array(np.int64(out_shape))
            ),
        ]
        product = [
            helper.make_node("MatMul", hidden, ["product"]),
            helper.make_node("Reshape", ["product", "out_shape"], outputs),
        ]
        return [*constants, *nodes, *product]

    return graph


def _shape_id(shape):
    return "x".join(map(str, shape)) or "scalar"


def _attrs_id(attrs):
    return "-".join(f"{k}{v}" for k, v in attrs.items()) or "plain"


CASES = [
    OpCase(
        "MatMul", {"a": r(*sa), "b": r(*sb)}, opset=opset,
        id=f"MatMul-{_shape_id(sa)}-{_shape_id(sb)}-opset{opset}",
    )
    for sa, sb, opset in MATMUL_SHAPES
] + [
    OpCase(
        "MatMul", {"a": r(2, 3), "b": r(3, 2)}, wrt=("b",), opset=21, id="MatMul-right-only",
    ),
    OpCase(
        "MatMul", {"a": r(2, 2, 3), "b": r(2, 3, 2)}, wrt=("a",), opset=13, id="MatMul-left-only",
    ),
] + [
    OpCase(
        "MatMul", {"a": r(*sa), "b": r(*sb)}, opset=opset,
        graph=hidden_rank_matmul(np.matmul(np.ones(sa), np.ones(sb)).shape),
        id=f"MatMul-{_shape_id(sa)}-{_shape_id(sb)}-unknown-rank",
    )
    for sa, sb, opset in MATMUL_SHAPES if opset >= 13
] + [
    OpCase(
        "Gemm",
        {"a": r(*sa), "b": r(*sb), "c": None if sc is None else r(*sc)},
        attrs, opset=opset,
        id=f"Gemm-{_attrs_id(attrs)}-C{_shape_id(sc or ())}",
    )
    for sa, sb, sc, attrs, opset in GEMM_SETTINGS
] + [
    OpCase(
        "Gemm", {"a": r(2, 3), "b": r(3, 4), "c": r(4)}, {"beta": 3.0}, wrt=("c",), opset=18,
        id="Gemm-C-only",
    ),
] + [
    OpCase(
        "Einsum", {f"x{k}": r(*s) for k, s in enumerate(shapes)}, {"equation": eq},
        opset=opset, id=f"Einsum-{eq.replace('...', 'E').replace('->', '_to_') or 'scalar'}",
    )
    for eq, shapes, opset in EINSUM_SETTINGS
]  # fmt: skip

SECOND_ORDER_IDS = {
    "MatMul-2x3-3x4-opset13", "MatMul-3-3x4-opset13", "MatMul-2x3-3-opset18",
    "MatMul-3-3-opset13", "MatMul-3-2x3x2-opset18", "MatMul-2x2x3-3-opset13",
    "MatMul-2x2x3-3x2-opset13", "MatMul-2x3-2x3x2-opset18", "MatMul-2x1x2x3-3x3x2-opset13",
    "MatMul-3-2x3x2-unknown-rank", "MatMul-2x1x2x3-3x3x2-unknown-rank",
    "Gemm-transA1-C2x1", "Gemm-transA1-transB1-beta2.0-C2x4", "Gemm-transB1-alpha0.5-Cscalar",
    "Einsum-ij,jk_to_ik", "Einsum-ii_to_i", "Einsum-ij_to_", "Einsum-iij,jk_to_ik",
    "Einsum-Ei,Ei_to_E", "Einsum-ba",
}  # fmt: skip
SECOND_ORDER = [second_order(case) for case in CASES if case.id in SECOND_ORDER_IDS]
assert len(SECOND_ORDER) == len(SECOND_ORDER_IDS), "a second-order id names no case"
CASES += SECOND_ORDER

SINGULAR = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.5, -1.0, 2.0]])
# Det's rule needs the static matrix size: static shapes only
CASES += [
    OpCase("Det", {"x": r(3, 3)}, opset=13, dynamic_shapes=False, id="Det-3x3"),
    OpCase("Det", {"x": r(2, 3, 2, 2)}, opset=22, dynamic_shapes=False, id="Det-batched"),
    OpCase("Det", {"x": r(4, 1, 1)}, opset=18, dynamic_shapes=False, id="Det-1x1"),
    OpCase("Det", {"x": SINGULAR}, opset=18, dynamic_shapes=False, id="Det-singular"),
]
