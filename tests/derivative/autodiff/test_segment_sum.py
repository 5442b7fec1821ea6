"""The gradients of Gather, GatherElements and GatherND below opset 16 (a sorted segment sum,
rules/_segment_sum.py, where ScatterElements cannot add): equal to the opset-16 path's
(ScatterND / ScatterElements with ``reduction='add'``) on many repeated and negative indices,
and built without a tensor of positions x elements, which the dense one-hot product they
replace needed. Their values against float64 finite differences: the ``*-opset11/13/15``
and ``*-segment-sum`` cases of the rule table (cases_indexing.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from onnxgrad import onnx_derivative

rng = np.random.default_rng(16)


def _model(op_type: str, data: np.ndarray, indices: np.ndarray, opset: int, **attrs):
    node = helper.make_node(op_type, ["data", "indices"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "gather",
        [
            helper.make_tensor_value_info("data", TensorProto.DOUBLE, list(data.shape)),
            helper.make_tensor_value_info("indices", TensorProto.INT64, list(indices.shape)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _session(model):
    return onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )


def _gradient(op_type, data, indices, opset, attrs) -> np.ndarray:
    """``data_bar`` for a fixed random ``y_bar``, run by onnxruntime in float64."""
    model = _model(op_type, data, indices, opset, **attrs)
    (y,) = _session(model).run(None, {"data": data, "indices": indices})
    g = np.random.default_rng(1).standard_normal(y.shape)
    gradient = onnx_derivative(model, weights=[], inputs=["data"], backend="onnx")
    feeds = {"data": data, "indices": indices, "y_grad": g}
    return _session(gradient).run(["data_grad"], feeds)[0]


def _indices(high: int, shape, low: int | None = None) -> np.ndarray:
    """Indices in ``[-high, high)`` (negative ones count from the end), many repeated."""
    return rng.integers(-high if low is None else low, high, shape).astype(np.int64)


CASES = [
    ("Gather", rng.standard_normal((7, 5)), _indices(7, (60,)), {}),
    ("Gather", rng.standard_normal((3, 6, 4)), _indices(6, (5, 9)), {"axis": 1}),
    ("Gather", rng.standard_normal((2, 3, 5)), _indices(5, (40,)), {"axis": -1}),
    ("GatherElements", rng.standard_normal((4, 6)), _indices(6, (4, 30)), {"axis": 1}),
    ("GatherElements", rng.standard_normal((5, 3, 2)), _indices(5, (25, 3, 2)), {"axis": 0}),
    ("GatherElements", rng.standard_normal((2, 3, 4)), _indices(4, (2, 3, 11)), {"axis": 2}),
    (
        "GatherND",
        rng.standard_normal((4, 5, 2)),
        np.stack([_indices(4, (30,)), _indices(5, (30,))], axis=-1),
        {},
    ),
    ("GatherND", rng.standard_normal((2, 6, 3)), _indices(6, (2, 20, 1)), {"batch_dims": 1}),
]


#: GatherND's rule starts at opset 12 (batch_dims)
PARAMS = [
    pytest.param(case, opset, id=f"{case[0]}-{case[1].ndim}d-{case[3]}-opset{opset}")
    for case in CASES
    for opset in (11, 13, 15)
    if case[0] != "GatherND" or opset >= 12
]


@pytest.mark.parametrize("case, opset", PARAMS)
def test_equals_the_scatter_add_of_opset_16(case, opset):
    op_type, data, indices, attrs = case
    low = _gradient(op_type, data, indices, opset, attrs)
    high = _gradient(op_type, data, indices, 16, attrs)
    assert low.shape == data.shape
    np.testing.assert_allclose(low, high, rtol=1e-12, atol=1e-12)


def _tensor_sizes(model: onnx.ModelProto, feeds: dict) -> dict[str, int]:
    """The element count of every value the graph computes, run by onnxruntime."""
    names = [o for node in model.graph.node for o in node.output if o]
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.output[:]
    exposed.graph.output.extend(helper.make_value_info(n, onnx.TypeProto()) for n in names)
    values = _session(exposed).run(None, feeds)
    return {n: int(np.size(v)) for n, v in zip(names, values)}


@pytest.mark.parametrize(
    "op_type, data_shape, index_shape, attrs",
    [
        ("Gather", (3000, 2), (2000,), {}),
        ("GatherElements", (2, 3000), (2, 2000), {"axis": 1}),
    ],
)
def test_no_tensor_of_positions_by_elements(op_type, data_shape, index_shape, attrs):
    """2000 positions into 3000 rows: a one-hot product holds 6 million entries (48 MB in
    float64); every tensor of the segment sum is linear in the positions and elements."""
    data = rng.standard_normal(data_shape)
    axis = attrs.get("axis", 0)
    indices = rng.integers(0, data_shape[axis], index_shape).astype(np.int64)
    model = _model(op_type, data, indices, 13, **attrs)
    gradient = onnx_derivative(model, weights=[], inputs=["data"], backend="onnx")
    (y,) = _session(model).run(None, {"data": data, "indices": indices})
    feeds = {"data": data, "indices": indices, "y_grad": np.ones_like(y)}
    sizes = _tensor_sizes(gradient, feeds)
    positions, elements = int(np.prod(index_shape)), int(np.prod(data_shape))
    linear = 2 * (y.size + data.size)
    assert max(sizes.values()) <= linear < positions * elements // 100, max(sizes.items())
    counts = np.zeros(data_shape)
    np.add.at(counts, (indices,) if op_type == "Gather" else (0, indices[0]), 1.0)
    if op_type == "GatherElements":
        np.add.at(counts, (1, indices[1]), 1.0)
    got = _session(gradient).run(["data_grad"], feeds)[0]
    np.testing.assert_array_equal(got, counts)
