"""Rule table entries: ReduceSum, ReduceMean, ReduceSumSquare, ReduceL1, ReduceL2,
ReduceLogSumExp, ReduceLogSum, ReduceMax, ReduceMin, ReduceProd, CumSum, CumProd.

Axes as attributes (ReduceSum before opset 13, the others before 18) and as inputs,
negative, omitted, empty with ``noop_with_empty_axes``, and computed at run time the way
the engine's unbroadcast computes them."""

import numpy as np
from onnx import helper

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(4)


def r(*shape):
    return rng.standard_normal(shape)


def away_from_zero(*shape):
    """Entries of magnitude in [0.5, 1.5] with random signs (|x| and ReduceL1 have a kink at 0)."""
    return rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)


def positive(*shape):
    return rng.uniform(0.5, 2.0, shape)


def distinct(*shape):
    """A permutation of well separated values (no ties for ReduceMax/ReduceMin)."""
    return rng.permutation(np.arange(np.prod(shape), dtype=np.float64)).reshape(shape) * 0.3


def _mean_of_reshaped(inputs, outputs):
    """ReduceMean of ``Reshape(x, [-1, 4])`` over its last axis: with unknown input dims
    only the reduced axis is known (the mean divides by a constant)."""
    shape = helper.make_tensor("four_columns", 7, [2], [-1, 4])
    return [
        helper.make_node("Constant", [], ["four_columns"], value=shape),
        helper.make_node("Reshape", [inputs[0], "four_columns"], ["reshaped"]),
        helper.make_node("ReduceMean", ["reshaped", *inputs[1:]], outputs),
    ]


def i64(*values):
    return np.array(values, dtype=np.int64)


def _reduce_sum_over_leading_axes(inputs, outputs):
    """``ReduceSum(x, range(rank(x) - 2), keepdims=0, noop_with_empty_axes=1)``: the axes
    are computed at run time and may be empty, as in the engine's dynamic unbroadcast. The
    result is flattened (a graph output needs a known rank)."""
    return [
        helper.make_node("Shape", [inputs[0]], ["shape"]),
        helper.make_node("Size", ["shape"], ["rank"]),
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", 7, [], [2])),
        helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("zero", 7, [], [0])),
        helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", 7, [], [1])),
        helper.make_node("Sub", ["rank", "two"], ["lead"]),
        helper.make_node("Range", ["zero", "lead", "one"], ["axes"]),
        helper.make_node(
            "ReduceSum", [inputs[0], "axes"], ["summed"], keepdims=0, noop_with_empty_axes=1
        ),
        helper.make_node("Constant", [], ["flat"], value=helper.make_tensor("flat", 7, [1], [-1])),
        helper.make_node("Reshape", ["summed", "flat"], outputs),
    ]


#: Rows with exactly two tied maxima: central differences give each 1/2, the equal split
#: the ReduceMax rule documents.
TIES = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, -2.0, 0.5, 2.0]])
WITH_ZEROS = np.array([[1.5, 0.0, -2.0], [0.0, 0.0, 1.2], [0.7, -1.1, 1.3]])

# fmt: off
SUM_MEAN = [
    OpCase("ReduceSum", {"x": r(2, 3, 2)}, {"axes": [0, -1], "keepdims": 0}, opset=11,
           id="ReduceSum-attr"),
    OpCase("ReduceSum", {"x": r(2, 3), "axes": i64(-1)}, {"keepdims": 0}, opset=13,
           id="ReduceSum-input-axes"),
    OpCase("ReduceSum", {"x": r(2, 3)}, {"keepdims": 0}, opset=13, id="ReduceSum-all"),
    OpCase("ReduceSum", {"x": r(2, 3), "axes": i64()}, {"noop_with_empty_axes": 1}, opset=18,
           id="ReduceSum-noop"),
    OpCase("ReduceSum", {"x": r(2, 3), "axes": i64()}, {"keepdims": 0}, opset=21,
           id="ReduceSum-empty-axes-all"),
    OpCase("ReduceSum", {"x": r(2, 3, 2)}, opset=13, graph=_reduce_sum_over_leading_axes,
           id="ReduceSum-runtime-axes"),
    OpCase("ReduceSum", {"x": r(3, 2)}, opset=13, graph=_reduce_sum_over_leading_axes,
           id="ReduceSum-runtime-empty-axes"),
    OpCase("ReduceMean", {"x": r(2, 3, 2)}, {"axes": [1]}, opset=13, id="ReduceMean-attr"),
    OpCase("ReduceMean", {"x": r(2, 3, 2), "axes": i64(0, 2)}, {"keepdims": 0}, opset=18,
           id="ReduceMean-input-axes"),
    OpCase("ReduceMean", {"x": r(4, 3)}, {"keepdims": 0}, opset=18, id="ReduceMean-all"),
    OpCase("ReduceMean", {"x": r(2, 3, 4), "axes": i64(-1)}, opset=18, id="ReduceMean-last-axis"),
    OpCase("ReduceMean", {"x": r(6, 4), "axes": i64(-1)}, opset=18, graph=_mean_of_reshaped,
           id="ReduceMean-known-axis-dynamic-batch"),
]

NORMS = [
    OpCase("ReduceSumSquare", {"x": r(2, 3)}, {"axes": [-1], "keepdims": 0}, opset=13,
           id="ReduceSumSquare-attr"),
    OpCase("ReduceSumSquare", {"x": r(2, 3), "axes": i64(0)}, opset=18,
           id="ReduceSumSquare-input-axes"),
    OpCase("ReduceL1", {"x": away_from_zero(2, 3)}, {"axes": [1]}, opset=13, id="ReduceL1-attr"),
    OpCase("ReduceL1", {"x": away_from_zero(2, 3)}, {"keepdims": 0}, opset=18,
           id="ReduceL1-all"),
    OpCase("ReduceL2", {"x": r(2, 3)}, {"axes": [0], "keepdims": 0}, opset=13,
           id="ReduceL2-attr"),
    OpCase("ReduceL2", {"x": np.array([[0.0, 0.0], [0.6, -0.8]]), "axes": i64(-1)}, opset=18,
           id="ReduceL2-zero-norm"),
    OpCase("ReduceLogSumExp", {"x": r(2, 3)}, {"axes": [1], "keepdims": 0}, opset=13,
           id="ReduceLogSumExp-attr"),
    OpCase("ReduceLogSumExp", {"x": r(2, 3, 2), "axes": i64(0, -1)}, opset=18,
           id="ReduceLogSumExp-input-axes"),
    OpCase("ReduceLogSum", {"x": positive(2, 3)}, {"axes": [0], "keepdims": 0}, opset=13,
           id="ReduceLogSum-attr"),
    OpCase("ReduceLogSum", {"x": positive(3, 2), "axes": i64(-1)}, opset=18,
           id="ReduceLogSum-input-axes"),
]

EXTREMA_PROD = [
    OpCase("ReduceMax", {"x": distinct(2, 3)}, {"axes": [1], "keepdims": 0}, opset=13,
           id="ReduceMax-attr"),
    OpCase("ReduceMax", {"x": distinct(2, 3, 2), "axes": i64(0, 2)}, opset=18,
           id="ReduceMax-input-axes"),
    OpCase("ReduceMax", {"x": TIES}, {"axes": [1]}, opset=13, id="ReduceMax-ties"),
    OpCase("ReduceMax", {"x": TIES, "axes": i64(-1)}, {"keepdims": 0}, opset=18,
           id="ReduceMax-ties-input-axes"),
    OpCase("ReduceMin", {"x": -TIES}, {"axes": [1], "keepdims": 0}, opset=11,
           id="ReduceMin-ties-opset11"),
    OpCase("ReduceMax", {"x": np.array([[0.3, -1.2, 0.9], [1.5, 0.1, -0.4]]), "axes": None},
           {"noop_with_empty_axes": 1}, opset=18, id="ReduceMax-noop"),
    OpCase("ReduceMin", {"x": distinct(3, 2)}, {"keepdims": 0}, opset=13, id="ReduceMin-all"),
    OpCase("ReduceMin", {"x": distinct(3, 2), "axes": i64(-2)}, {"keepdims": 0}, opset=20,
           id="ReduceMin-input-axes"),
    OpCase("ReduceProd", {"x": away_from_zero(2, 3)}, {"axes": [1]}, opset=13,
           id="ReduceProd-attr"),
    OpCase("ReduceProd", {"x": WITH_ZEROS, "axes": i64(1)}, {"keepdims": 0}, opset=18,
           id="ReduceProd-zeros"),
    OpCase("ReduceProd", {"x": away_from_zero(2, 2), "axes": None},
           {"noop_with_empty_axes": 1}, opset=18, id="ReduceProd-noop"),
]

CUMSUM = [
    OpCase("CumSum", {"x": r(2, 4), "axis": np.array(1)}, opset=13, id="CumSum-inclusive"),
    OpCase("CumSum", {"x": r(3, 2), "axis": np.array(0)},
           {"exclusive": 1}, opset=13, id="CumSum-exclusive"),
    OpCase("CumSum", {"x": r(2, 3), "axis": np.array(-1)}, {"reverse": 1}, opset=14,
           id="CumSum-reverse"),
    OpCase("CumSum", {"x": r(4), "axis": np.array(0, dtype=np.int32)},
           {"exclusive": 1, "reverse": 1}, opset=21, id="CumSum-exclusive-reverse"),
]
# fmt: on


def with_zeros(*shape):
    values = r(*shape)
    values.flat[1] = 0.0
    return values


def _cumprod_runtime_axis(inputs, outputs):
    """CumProd whose axis (-1) is computed in the graph, unknown while building."""
    return [
        helper.make_node("Constant", [], ["one"], value_int=1),
        helper.make_node("Neg", ["one"], ["axis"]),
        helper.make_node("CumProd", [inputs[0], "axis"], outputs, reverse=1),
    ]


# fmt: off
CUMPROD = [
    OpCase("CumProd", {"x": with_zeros(2, 4), "axis": np.array(1)}, opset=26,
           id="CumProd-inclusive-zero"),
    OpCase("CumProd", {"x": r(3, 2), "axis": np.array(0)}, {"exclusive": 1}, opset=26,
           id="CumProd-exclusive"),
    OpCase("CumProd", {"x": with_zeros(2, 3, 2), "axis": np.array(-2)}, {"reverse": 1},
           opset=26, id="CumProd-reverse"),
    OpCase("CumProd", {"x": r(4), "axis": np.array(0, dtype=np.int32)},
           {"exclusive": 1, "reverse": 1}, opset=26,
           id="CumProd-exclusive-reverse"),
    OpCase("CumProd", {"x": with_zeros(3, 2, 3)}, opset=26, graph=_cumprod_runtime_axis,
           id="CumProd-runtime-axis"),
]
# fmt: on

CASES = SUM_MEAN + NORMS + EXTREMA_PROD + CUMSUM + CUMPROD

#: Not ReduceL2-zero-norm, ReduceMax-ties, ReduceProd-zeros: their gradients jump there.
SECOND_ORDER_IDS = {
    "ReduceSum-input-axes", "ReduceSum-all", "ReduceMean-input-axes",
    "ReduceSumSquare-attr", "ReduceL1-all", "ReduceL2-attr", "ReduceLogSumExp-input-axes",
    "ReduceLogSum-input-axes",
    "ReduceMax-input-axes", "ReduceMin-all", "ReduceProd-attr", "CumSum-exclusive-reverse",
}  # fmt: skip
SECOND_ORDER = [second_order(case) for case in CASES if case.id in SECOND_ORDER_IDS]
assert len(SECOND_ORDER) == len(SECOND_ORDER_IDS), "a second-order id names no case"
CASES += SECOND_ORDER
