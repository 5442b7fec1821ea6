"""Quantized codes moved by layout operators before the node that rescales them
(``ConvInteger(Reshape(Transpose(DynamicQuantizeLinear(x))))``, Segformer's int8 file): the
straight-through gradient is float64 central differences of the file with its rounding frozen
(:mod:`tests.normalize.unrounded`), the ``exact`` one central differences of the file itself,
at a point whose codes sit a third of a step from every rounding boundary."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import onnx_derivative
from onnxgrad.normalize import normalized_model
from tests.derivative.fd import onnx_numerical_vjp
from tests.normalize.kernels import run
from tests.normalize.unrounded import with_frozen_rounding

RNG = np.random.default_rng(41)
OPSET = 19


def _ints(name: str, values) -> onnx.TensorProto:
    """``values`` as int64, or in their own type where they are an array (codes)."""
    typed = values if isinstance(values, np.ndarray) else np.asarray(values, np.int64)
    return numpy_helper.from_array(typed, name)


#: ``name: (shape of x, the nodes from codes "q" to "m", their constants, K of "m")``
MOVES = {
    "identity": ((4, 6), [helper.make_node("Identity", ["q"], ["m"])], []),
    "transpose": ((6, 4), [helper.make_node("Transpose", ["q"], ["m"], perm=[1, 0])], []),
    "reshape": ((3, 8), [helper.make_node("Reshape", ["q", "shape"], ["m"])], [("shape", [4, 6])]),
    "flatten": ((4, 2, 3), [helper.make_node("Flatten", ["q"], ["m"], axis=1)], []),
    "squeeze": ((4, 1, 6), [helper.make_node("Squeeze", ["q", "axes"], ["m"])], [("axes", [1])]),
    "unsqueeze": (
        (4, 6),
        [helper.make_node("Unsqueeze", ["q", "axes"], ["m"])],
        [("axes", [0])],
    ),
    "slice": (
        (4, 8),
        [helper.make_node("Slice", ["q", "starts", "ends", "axes"], ["m"])],
        [("starts", [1]), ("ends", [7]), ("axes", [1])],
    ),
    "gather": (
        (4, 9),
        [helper.make_node("Gather", ["q", "indices"], ["m"], axis=1)],
        [("indices", [0, 2, 3, 5, 7, 8])],
    ),
    "concat": (
        (4, 3),
        [
            helper.make_node("Transpose", ["q"], ["t"], perm=[0, 1]),
            helper.make_node("Concat", ["q", "t"], ["m"], axis=1),
        ],
        [],
    ),
    "concat_constant": (
        (4, 4),
        [helper.make_node("Concat", ["q", "joined"], ["m"], axis=1)],
        [("joined", np.arange(60, 68, dtype=np.uint8).reshape(4, 2))],
    ),
    "pad": (
        (4, 4),
        [helper.make_node("Pad", ["q", "pads", "z"], ["m"])],
        [("pads", [0, 1, 0, 1])],
    ),
    "transpose_reshape": (
        (2, 6, 2),
        [
            helper.make_node("Transpose", ["q"], ["t"], perm=[1, 0, 2]),
            helper.make_node("Reshape", ["t", "shape"], ["m"]),
        ],
        [("shape", [6, 4])],
    ),
}
#: the inner size of ``m`` per move (its last axis)
INNER = {"transpose_reshape": 4}
#: the moves whose file derivative (rounding held) is checked too: one of each kind of
#: replay (a chain, a padding constant, two readers of the codes)
EXACT_CHECKED = ("transpose_reshape", "pad", "concat")


def _point(shape) -> np.ndarray:
    """Codes a third of a step from every boundary, range ``[-2, 3.1]`` (scale 0.02, zero
    point 100)."""
    x = (RNG.integers(-90, 140, shape) + 1 / 3) * (5.1 / 255)
    flat = x.reshape(-1)
    flat[0], flat[-1] = -2.0, 3.1
    return x.astype(np.float32)


def _moved_product(move: str, product: str) -> tuple[onnx.ModelProto, dict]:
    """``y = Cast(P(m, B)) (s_x s_B)``, ``m`` the codes of ``x`` moved, ``P`` a
    ``MatMulInteger`` or (over ``m`` as a 1-channel image) a ``ConvInteger``, as
    ``quantize_dynamic`` writes them."""
    shape, moves, constants = MOVES[move]
    k = INNER.get(move, 6)
    if product == "MatMulInteger":
        codes = RNG.integers(0, 256, (k, 3)).astype(np.uint8)
        extra = []
        reads = "m"
    else:
        codes = RNG.integers(0, 256, (2, 1, 2, 3)).astype(np.uint8)
        extra = [helper.make_node("Unsqueeze", ["m", "image_axes"], ["image"])]
        constants = [*constants, ("image_axes", [1] if move == "unsqueeze" else [0, 1])]
        reads = "image"
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
        *moves,
        *extra,
        helper.make_node(product, [reads, "B", "z", "zB"], ["p"]),
        helper.make_node("Cast", ["p"], ["pf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["s", "sB"], ["ss"]),
        helper.make_node("Mul", ["pf", "ss"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        f"{move}_{product}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(codes, "B"),
            numpy_helper.from_array(np.array(131, np.uint8), "zB"),
            numpy_helper.from_array(np.array(0.013, np.float32), "sB"),
            *(_ints(name, values) for name, values in constants),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    return model, {"x": _point(shape)}


def _gradient(model, feeds, seed, mode):
    gradient = onnx_derivative(model, inputs=["x"], weights=[], quantized_activations=mode)
    return run(gradient, {**feeds, "y_grad": seed})[0]


#: every move before a ``MatMulInteger``; before a ``ConvInteger`` (the same rewrite), one of
#: each kind of replay
PRODUCT_CASES = [(move, "MatMulInteger") for move in sorted(MOVES)] + [
    (move, "ConvInteger") for move in ("transpose_reshape", "pad", "concat", "gather")
]


def _assert_straight_through(model, feeds, value_tolerance: float) -> np.ndarray:
    """The normalised model computes the file's values (within ``value_tolerance``: a float
    product's accumulation) and its straight-through gradient is the frozen file's central
    differences; returns the seed."""
    y = run(model, feeds)[0]
    seed = RNG.standard_normal(y.shape).astype(np.float32)
    tolerance = {"rtol": value_tolerance, "atol": value_tolerance}
    np.testing.assert_allclose(run(normalized_model(model), feeds)[0], y, **tolerance)
    frozen = with_frozen_rounding(model, feeds)
    expected = onnx_numerical_vjp(frozen, feeds, ["x"], [seed], eps=1e-3)["x"]
    got = _gradient(model, feeds, seed, "straight_through")
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    return seed


@pytest.mark.parametrize(("move", "product"), PRODUCT_CASES)
def test_moved_codes_read_straight_through(move, product):
    model, feeds = _moved_product(move, product)
    seed = _assert_straight_through(model, feeds, value_tolerance=1e-5)
    if move not in EXACT_CHECKED:
        return
    exact = onnx_numerical_vjp(model, feeds, ["x"], [seed], eps=1e-3)["x"]
    assert np.count_nonzero(exact) <= 2  # codes held: the scale reads the range's two ends
    got = _gradient(model, feeds, seed, "exact")
    np.testing.assert_allclose(got, exact, rtol=1e-3, atol=1e-4)


def _moved_dequantized(move: str, quantizer: str) -> tuple[onnx.ModelProto, dict]:
    """``y = DequantizeLinear(m, s, z)``, ``m`` the codes of ``x`` moved, ``(q, s, z)`` from a
    ``DynamicQuantizeLinear`` or a static ``QuantizeLinear`` (scale 0.02, zero point 100)."""
    shape, moves, constants = MOVES[move]
    initializers = [_ints(name, values) for name, values in constants]
    if quantizer == "dynamic":
        quantize = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])
    else:
        quantize = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])
        initializers += [
            numpy_helper.from_array(np.array(5.1 / 255, np.float32), "s"),
            numpy_helper.from_array(np.array(100, np.uint8), "z"),
        ]
    graph = helper.make_graph(
        [quantize, *moves, helper.make_node("DequantizeLinear", ["m", "s", "z"], ["y"])],
        f"{move}_{quantizer}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
    return model, {"x": _point(shape)}


@pytest.mark.parametrize("quantizer", ["dynamic", "static"])
@pytest.mark.parametrize("move", sorted(MOVES))
def test_moved_codes_dequantized_straight_through(move, quantizer):
    """Every code in range: the straight-through gradient is the moves' own (their transpose
    applied to the seed); rounding held, the file's (zero for a static scale)."""
    model, feeds = _moved_dequantized(move, quantizer)
    seed = _assert_straight_through(model, feeds, value_tolerance=0.0)
    if move not in EXACT_CHECKED:
        return
    exact = onnx_numerical_vjp(model, feeds, ["x"], [seed], eps=1e-3)["x"]
    if quantizer == "static":  # codes and scale constant: no derivative, said so
        assert not np.any(exact)
        with pytest.raises(NotImplementedError, match="not differentiable with respect to"):
            _gradient(model, feeds, seed, "exact")
        return
    assert np.count_nonzero(exact) == 2
    got = _gradient(model, feeds, seed, "exact")
    np.testing.assert_allclose(got, exact, rtol=1e-3, atol=1e-4)


def _qoperator_pair() -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """``Transpose`` of static codes read by a ``QLinearMatMul`` (the QOperator form), and
    the same file written with ``DequantizeLinear``/``MatMul``/``QuantizeLinear`` (QDQ):
    the two compute the same values."""
    codes = RNG.integers(0, 256, (4, 3)).astype(np.uint8)
    parameters = {
        "s": np.array(5.1 / 255, np.float32),
        "z": np.array(100, np.uint8),
        "B": codes,
        "sB": np.array(0.01, np.float32),
        "zB": np.array(120, np.uint8),
        "sy": np.array(0.05, np.float32),
        "zy": np.array(128, np.uint8),
    }
    initializers = [numpy_helper.from_array(v, k) for k, v in parameters.items()]
    head = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("Transpose", ["q"], ["m"], perm=[1, 0]),
    ]
    tail = [helper.make_node("DequantizeLinear", ["p", "sy", "zy"], ["y"])]
    qoperator = [
        helper.make_node("QLinearMatMul", ["m", "s", "z", "B", "sB", "zB", "sy", "zy"], ["p"])
    ]
    qdq = [
        helper.make_node("DequantizeLinear", ["m", "s", "z"], ["a"]),
        helper.make_node("DequantizeLinear", ["B", "sB", "zB"], ["w"]),
        helper.make_node("MatMul", ["a", "w"], ["h"]),
        helper.make_node("QuantizeLinear", ["h", "sy", "zy"], ["p"]),
    ]
    models = []
    for middle in (qoperator, qdq):
        graph = helper.make_graph(
            [*head, *middle, *tail],
            "qoperator",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            initializers,
        )
        opsets = [helper.make_opsetid("", OPSET)]
        models.append(helper.make_model(graph, opset_imports=opsets, ir_version=9))
    return *models, {"x": _point((4, 5))}


def test_moved_codes_of_a_qlinear_product_read_straight_through():
    qoperator, qdq, feeds = _qoperator_pair()
    y = run(qoperator, feeds)[0]
    np.testing.assert_array_equal(run(qdq, feeds)[0], y)
    seed = RNG.standard_normal(y.shape).astype(np.float32)
    frozen = with_frozen_rounding(qdq, feeds)
    expected = onnx_numerical_vjp(frozen, feeds, ["x"], [seed], eps=1e-4)["x"]
    assert np.count_nonzero(expected) > expected.size // 2
    for model in (qoperator, qdq):
        got = _gradient(model, feeds, seed, "straight_through")
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
