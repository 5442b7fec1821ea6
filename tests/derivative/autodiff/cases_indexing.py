"""Rule table entries: Slice, Gather, GatherElements, GatherND, ScatterElements, ScatterND
(every reduction), Trilu, TopK, Compress, ReverseSequence, TensorScatter. Indices repeat on
purpose where the op allows it (their gradients must add up)."""

import numpy as np
from onnx import helper

from tests.derivative.autodiff.gradcheck import OpCase, second_order

rng = np.random.default_rng(3)


def r(*shape):
    return rng.standard_normal(shape)


#: the below-16 cases' own generator (the others' values stay as they were)
rng_low = np.random.default_rng(33)


def low(*shape):
    return rng_low.standard_normal(shape)


def i64(*values):
    return np.array(values, dtype=np.int64)


def idx(values, dtype=np.int64):
    return np.array(values, dtype=dtype)


def _slice_with_runtime_steps(inputs, outputs):
    """Slice whose ``steps`` (2) are computed in the graph, unknown while building."""
    minus_two = helper.make_tensor("minus_two", 7, [1], [-2])
    return [
        helper.make_node("Constant", [], ["minus_two"], value=minus_two),
        helper.make_node("Neg", ["minus_two"], ["steps"]),
        helper.make_node("Slice", [*inputs, "steps"], outputs),
    ]


def _reverse_sequence_with_runtime_lengths(inputs, outputs):
    """ReverseSequence whose lengths ``min(lens, time)`` are computed in the graph."""
    x, lens = inputs
    return [
        helper.make_node("Shape", [x], ["time"], start=1, end=2),
        helper.make_node("Min", [lens, "time"], ["lens_rt"]),
        helper.make_node("ReverseSequence", [x, "lens_rt"], outputs, batch_axis=0, time_axis=1),
    ]


def _slice_of_reshaped(inputs, outputs):
    """Slice of ``Reshape(x, [-1, 6])``: with unknown input dims the sliced axis alone is
    known (the gradient pads it by constants, the dynamic axis untouched)."""
    shape = helper.make_tensor("six_columns", 7, [2], [-1, 6])
    return [
        helper.make_node("Constant", [], ["six_columns"], value=shape),
        helper.make_node("Reshape", [inputs[0], "six_columns"], ["reshaped"]),
        helper.make_node("Slice", ["reshaped", *inputs[1:]], outputs),
    ]


# fmt: off
SLICE = [
    OpCase("Slice", {"x": r(4, 5), "starts": i64(1, -4), "ends": i64(3, 100)}, opset=13,
           id="Slice-unit-steps-clamped"),
    OpCase("Slice", {"x": r(3, 4, 2), "starts": i64(-2), "ends": i64(-1), "axes": i64(-2)},
           opset=18, id="Slice-unit-steps-axes"),
    OpCase("Slice", {"x": r(3, 4), "starts": idx([5], np.int32), "ends": idx([1], np.int32),
                     "axes": idx([0], np.int32)}, opset=21, id="Slice-empty"),
    OpCase("Slice", {"x": r(5, 4), "starts": i64(-1, 0), "ends": i64(-100, 4),
                     "axes": i64(0, 1), "steps": i64(-2, 3)}, opset=13, id="Slice-negative-steps"),
    OpCase("Slice", {"x": r(2, 6), "starts": i64(1), "ends": i64(6), "axes": None,
                     "steps": i64(2)}, opset=18, id="Slice-steps-axes-omitted"),
    OpCase("Slice", {"x": r(3, 4), "starts": i64(0, 1), "ends": i64(2, 3)}, opset=11,
           id="Slice-opset11"),
    OpCase("Slice", {"x": r(3, 5), "starts": i64(0, 1), "ends": i64(2, -1), "axes": i64(0, 1),
                     "steps": i64(1, 1)}, opset=13, id="Slice-unit-steps-given"),
    OpCase("Slice", {"x": r(2, 7), "starts": i64(1), "ends": i64(7), "axes": i64(1)}, opset=18,
           graph=_slice_with_runtime_steps, id="Slice-runtime-steps"),
    OpCase("Slice", {"x": r(4, 3), "starts": i64(4), "ends": i64(2**63 - 1), "axes": i64(-1)},
           opset=18, graph=_slice_of_reshaped, id="Slice-known-axis-dynamic-batch"),
]

GATHER = [
    OpCase("Gather", {"data": r(4, 3), "indices": idx([[0, 3], [-1, 0]])}, opset=16,
           id="Gather-axis0-scatternd"),
    OpCase("Gather", {"data": r(2, 4, 3), "indices": idx([1, -1, 1])}, {"axis": 1}, opset=18,
           id="Gather-axis1"),
    OpCase("Gather", {"data": r(3, 4), "indices": idx(2)}, {"axis": -1}, opset=21,
           id="Gather-scalar-index"),
    OpCase("Gather", {"data": r(4, 3), "indices": idx([[0, 3], [-1, 0]], np.int32)}, opset=13,
           id="Gather-axis0-segment-sum"),
    OpCase("Gather", {"data": r(2, 3, 2), "indices": idx([[2], [-3]])}, {"axis": 1}, opset=13,
           id="Gather-axis1-segment-sum"),
    OpCase("GatherElements", {"data": r(2, 4), "indices": idx([[0, 2, 2, -1, 2], [1, 1, 0, 3, 0]])},
           {"axis": 1}, opset=18, id="GatherElements-axis1"),
    OpCase("GatherElements", {"data": r(3, 2), "indices": idx([[2, 0], [-1, 2]])},
           {"axis": 0}, opset=13, id="GatherElements-segment-sum"),
    OpCase("GatherElements", {"data": r(2, 3, 2), "indices": idx([[[1], [1], [-2]]] * 2)},
           {"axis": 2}, opset=16, id="GatherElements-last-axis"),
    OpCase("GatherND", {"data": r(3, 4), "indices": idx([[0, 1], [2, -1], [0, 1]])}, opset=18,
           id="GatherND-elements"),
    OpCase("GatherND", {"data": r(3, 2, 2), "indices": idx([[[1]], [[-1]]])}, opset=16,
           id="GatherND-slices"),
    OpCase("GatherND", {"data": r(2, 3, 2), "indices": idx([[[1], [1]], [[0], [2]]])},
           {"batch_dims": 1}, opset=18, id="GatherND-batch1"),
    OpCase("GatherND", {"data": r(2, 3, 4), "indices": idx([[[0, 1], [0, 1]], [[2, -1], [1, 0]]])},
           {"batch_dims": 1}, opset=13, id="GatherND-batch1-segment-sum"),
    OpCase("GatherND", {"data": r(3, 4), "indices": idx([[2], [0], [2]])}, opset=13,
           id="GatherND-segment-sum"),
    # below opset 16 (a sorted segment sum): repeated and negative indices, several axes
    OpCase("Gather", {"data": low(5, 3), "indices": idx([[0, 4, -1, 0], [2, -5, 4, 4]])},
           opset=11, id="Gather-dup-negative-opset11"),
    OpCase("Gather", {"data": low(2, 6, 3), "indices": idx([5, -1, 0, 0, 3, -6])},
           {"axis": -2}, opset=15, id="Gather-axis1-dup-opset15"),
    OpCase("Gather", {"data": low(3, 4, 2), "indices": idx([[1, -1], [1, 0]], np.int32)},
           {"axis": 2}, opset=13, id="Gather-last-axis-opset13"),
    OpCase("GatherElements", {"data": low(3, 4), "indices": idx(
        [[0, 3, 3, -1, 0], [2, 2, -2, 1, 1], [3, 0, -4, 0, 3]])}, {"axis": 1}, opset=11,
           id="GatherElements-axis1-dup-opset11"),
    OpCase("GatherElements", {"data": low(3, 2, 2), "indices": idx(
        [[[0, -1], [2, 2]], [[-3, 1], [2, 0]], [[0, 0], [-1, 2]], [[1, 1], [1, -2]]])},
           {"axis": 0}, opset=15, id="GatherElements-axis0-3d-opset15"),
    OpCase("GatherElements", {"data": low(2, 3, 4), "indices": idx(
        np.array([3, -1, 0, 0, 2, -4] * 6).reshape(2, 3, 6), np.int32)}, {"axis": 2},
           opset=13, id="GatherElements-last-axis-opset13"),
]

SCATTER = [
    OpCase("ScatterElements", {"data": r(3, 4), "indices": idx([[1, 0], [3, 2], [0, 1]]),
                               "updates": r(3, 2)}, {"axis": 1}, opset=13,
           id="ScatterElements-none"),
    OpCase("ScatterElements", {"data": r(3, 4), "indices": idx([[1, 0], [3, 2]]),
                               "updates": r(2, 2)}, {"axis": -1}, opset=13,
           id="ScatterElements-smaller-indices"),
    OpCase("ScatterElements", {"data": r(3, 4), "indices": idx([[1, 1, -1, 0]]),
                               "updates": r(1, 4)}, {"axis": 0, "reduction": "none"}, opset=18,
           constants=("data",), id="ScatterElements-updates-only"),
    OpCase("ScatterElements", {"data": r(3, 4), "indices": idx([[1, 1], [0, 1]]),
                               "updates": r(2, 2)}, {"axis": 1, "reduction": "add"}, opset=16,
           id="ScatterElements-add"),
    OpCase("ScatterElements", {"data": r(3, 4), "indices": idx([[1, 1], [0, -1]]),
                               "updates": r(2, 2)}, {"axis": 1, "reduction": "mul"}, opset=18,
           id="ScatterElements-mul"),
    OpCase("ScatterND", {"data": r(3, 4), "indices": idx([[1], [-1]]), "updates": r(2, 4)},
           opset=13, id="ScatterND-none"),
    OpCase("ScatterND", {"data": r(3, 2, 2), "indices": idx([[0, 1], [2, 0]]),
                         "updates": r(2, 2)}, {"reduction": "none"}, opset=18,
           id="ScatterND-none-18"),
    OpCase("ScatterND", {"data": r(4, 2), "indices": idx([[1], [1], [3]]), "updates": r(3, 2)},
           {"reduction": "add"}, opset=16, id="ScatterND-add"),
    OpCase("ScatterND", {"data": r(3, 3), "indices": idx([[0, 1], [0, 1], [2, 2]]),
                         "updates": r(3)}, {"reduction": "mul"}, opset=18, id="ScatterND-mul"),
]

TRILU = [
    OpCase("Trilu", {"x": r(3, 4), "k": i64(1)}, opset=14, id="Trilu-upper-k1"),
    OpCase("Trilu", {"x": r(2, 3, 3), "k": i64(-1)}, {"upper": 0}, opset=18, id="Trilu-lower"),
    OpCase("Trilu", {"x": r(4, 3)}, {"upper": 0}, opset=21, id="Trilu-lower-default-k"),
]
# fmt: on


def top_k(id, x, k, opset=18, check_ort=True, **attrs):
    """Only ``Values`` leaves the graph (``Indices`` is an integer output)."""

    def graph(inputs, outputs):
        return [helper.make_node("TopK", inputs, [outputs[0], "indices"], **attrs)]

    return OpCase(
        "TopK",
        {"x": x, "k": i64(k)},
        opset=opset,
        graph=graph,
        check_ort=check_ort,
        id=f"TopK-{id}",
    )


def reps(*shape):
    """Values with a repeat: ``max``/``min`` reductions must share among ties."""
    values = r(*shape)
    values.flat[1] = values.flat[0]
    return values


# fmt: off
SELECTIONS = [
    top_k("largest-axis1", r(3, 5), 2, axis=1),
    top_k("smallest-axis0-opset11", r(4, 3), 3, axis=0, largest=0, opset=11),
    # unsorted: the order of the values is the runtime's, so is the meaning of each seed
    top_k("unsorted-negative-axis", r(2, 3, 4), 2, axis=-1, sorted=0, opset=21,
          check_ort=False),
    OpCase("Compress", {"x": r(3, 4), "c": np.array([True, False, True])}, {"axis": 0},
           opset=11, id="Compress-axis0"),
    OpCase("Compress", {"x": r(2, 5, 2), "c": np.array([False, True, True])}, {"axis": -2},
           opset=18, id="Compress-short-condition"),
    OpCase("Compress", {"x": r(2, 3), "c": np.array([1, 0, 0, 1, 1], bool)}, opset=21,
           id="Compress-flat"),
    OpCase("Compress", {"x": r(3, 4), "c": np.zeros(4, bool)}, {"axis": 1}, opset=11,
           id="Compress-nothing-selected"),
    OpCase("Compress", {"x": r(2, 3), "c": np.zeros(2, bool)}, opset=18,
           id="Compress-flat-nothing-selected"),
    OpCase("ReverseSequence", {"x": r(4, 3, 2), "lens": i64(4, 1, 3)},
           {"batch_axis": 1, "time_axis": 0}, opset=11, id="ReverseSequence-time-major"),
    OpCase("ReverseSequence", {"x": r(3, 4), "lens": i64(2, 4, 0)},
           {"batch_axis": 0, "time_axis": 1}, opset=18, id="ReverseSequence-batch-major"),
    OpCase("ReverseSequence", {"x": r(3, 4), "lens": i64(0, 3, 1)},
           graph=_reverse_sequence_with_runtime_lengths, opset=18,
           id="ReverseSequence-runtime-lengths"),
    OpCase("TensorScatter", {"cache": r(2, 5, 3), "update": r(2, 2, 3),
                             "write": idx([1, 3])}, {"axis": 1}, opset=24,
           id="TensorScatter-linear"),
    OpCase("TensorScatter", {"cache": r(2, 2, 4, 2), "update": r(2, 2, 3, 2),
                             "write": idx([3, 0])}, {"mode": "circular"}, opset=24,
           id="TensorScatter-circular"),
    OpCase("TensorScatter", {"cache": r(1, 4, 3), "update": r(1, 2, 3), "write": None},
           {"axis": -2}, opset=24, id="TensorScatter-no-write-indices"),
    OpCase("ScatterElements", {"data": reps(3, 4), "indices": idx([[1, 1], [0, 1]]),
                               "updates": reps(2, 2)}, {"axis": 1, "reduction": "max"},
           opset=18, id="ScatterElements-max"),
    OpCase("ScatterElements", {"data": r(3, 4), "indices": idx([[1, 1], [0, 1]]),
                               "updates": r(2, 2)}, {"axis": 1, "reduction": "max"},
           opset=18, id="ScatterElements-max-distinct"),
    OpCase("ScatterND", {"data": reps(4, 3), "indices": idx([[1], [1], [3]]),
                         "updates": r(3, 3)}, {"reduction": "min"}, opset=18,
           id="ScatterND-min"),
]
# fmt: on

CASES = SLICE + GATHER + SCATTER + TRILU + SELECTIONS

SECOND_ORDER_IDS = {
    "Slice-unit-steps-clamped", "Slice-unit-steps-axes", "Slice-negative-steps",
    "Slice-unit-steps-given", "Slice-known-axis-dynamic-batch",
    "Gather-axis0-scatternd", "Gather-axis1", "Gather-scalar-index", "GatherElements-axis1",
    "GatherND-elements", "GatherND-batch1", "Gather-axis0-segment-sum",
    "Gather-axis1-dup-opset15", "GatherElements-axis1-dup-opset11",
    "GatherElements-axis0-3d-opset15", "GatherND-batch1-segment-sum", "ScatterElements-none",
    "ScatterElements-add",
    "ScatterElements-mul", "ScatterND-none", "ScatterND-add", "ScatterND-mul", "Trilu-lower",
}  # fmt: skip
#: second-order graphs onnx's reference evaluator cannot run (its GatherElements takes at most
#: 64 values along the axis: the segment sum's ScatterElements writes into S slots)
ON_ONNXRUNTIME = {"Gather-axis1-dup-opset15"}
SECOND_ORDER = [
    second_order(case, **({"evaluator": "onnxruntime"} if case.id in ON_ONNXRUNTIME else {}))
    for case in CASES
    if case.id in SECOND_ORDER_IDS
]
assert len(SECOND_ORDER) == len(SECOND_ORDER_IDS), "a second-order id names no case"
CASES += SECOND_ORDER
