"""float16 gradient graphs that onnxruntime's CPU provider runs: the scatter-adds of the
Gather family's gradients are computed in float32 there (no float16 kernel)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxgrad import onnx_derivative
from tests.normalize.kernels import run

RNG = np.random.default_rng(5)


def _gather_model(op: str, indices: np.ndarray, opset: int = 17, **attrs):
    graph = helper.make_graph(
        [helper.make_node(op, ["data", "idx"], ["y"], **attrs)],
        op,
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT16, [6, 4]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, list(indices.shape)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize(
    ("op", "indices", "attrs"),
    [
        ("Gather", np.array([[0, 2], [2, 5]]), {}),
        ("Gather", np.array([1, 1, 3]), {"axis": 1}),
        ("GatherND", np.array([[0], [0], [4]]), {}),
        ("GatherElements", np.array([[0, 1, 1, 3], [5, 5, 0, 2]]), {}),
    ],
)
def test_gather_family_gradient_in_float16(op, indices, attrs):
    data = RNG.standard_normal((6, 4)).astype(np.float16)
    model = _gather_model(op, indices, **attrs)
    y = run(model, {"data": data, "idx": indices})[0]
    seed = RNG.standard_normal(y.shape).astype(np.float16)
    gradient = onnx_derivative(model, inputs=["data"], weights=[])
    got = run(gradient, {"data": data, "idx": indices, "y_grad": seed})[0]
    assert got.dtype == np.float16
    expected = np.zeros((6, 4))
    if op == "Gather" and not attrs:
        np.add.at(expected, indices, seed.astype(np.float64))
    elif op == "Gather":
        np.add.at(expected.T, indices, np.moveaxis(seed.astype(np.float64), 1, 0))
    elif op == "GatherND":
        np.add.at(expected, indices[:, 0], seed.astype(np.float64))
    else:
        np.add.at(expected, (indices, np.arange(4)[None, :].repeat(2, 0)), seed.astype(np.float64))
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=2e-3, atol=2e-3)
