"""MaxPool whose square windows tile the input (kernel = strides, no pads): the gradient
goes to the first maximum of each window, as MaxPool's ``Indices`` (and PyTorch) route it,
without asking the forward pool for ``Indices``."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

from onnxgrad import onnx_derivative
from tests.derivative.autodiff.test_rules_extra import run_ort, single_node_model


def first_maximum_routing(x: np.ndarray, g: np.ndarray, k: int) -> np.ndarray:
    """numpy oracle: each ``k x k`` window's gradient to its first maximum (row-major)."""
    n, c, h, w = x.shape
    windows = x.reshape(n, c, h // k, k, w // k, k).transpose(0, 1, 2, 4, 3, 5)
    first = windows.reshape(n, c, h // k, w // k, k * k).argmax(axis=-1)
    routed = np.zeros((n, c, h // k, w // k, k * k), x.dtype)
    np.put_along_axis(routed, first[..., None], g[..., None], axis=-1)
    routed = routed.reshape(n, c, h // k, w // k, k, k).transpose(0, 1, 2, 4, 3, 5)
    return routed.reshape(x.shape)


def tied_input(shape, seed=0) -> np.ndarray:
    """ReLU-like values: most windows tie at 0, some at a repeated positive value."""
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    x[..., ::3, 1::2] = x[..., ::3, ::2]  # ties between horizontal neighbours
    return x


@pytest.mark.parametrize("k, shape", [(2, (3, 4, 8, 6)), (3, (2, 2, 9, 6))])
@pytest.mark.parametrize("run", ["onnxruntime", "reference"])
def test_tiled_max_pool_routes_ties_to_the_first_maximum(k, shape, run):
    model = single_node_model("MaxPool", {"x": list(shape)}, kernel_shape=[k, k], strides=[k, k])
    grad_model = onnx_derivative(model, weights=[], backend="onnx")
    indices = [n.name for n in grad_model.graph.node if n.op_type == "MaxPool" and n.output[1:]]
    assert not indices, "no pool computes Indices"
    x = tied_input(shape)
    g = (
        np.random.default_rng(1)
        .standard_normal((shape[0], shape[1], shape[2] // k, shape[3] // k))
        .astype(np.float32)
    )
    feeds = {"x": x, "y_grad": g}
    if run == "onnxruntime":
        got = run_ort(grad_model, feeds)["x_grad"]
    else:
        got = ReferenceEvaluator(grad_model).run(["x_grad"], feeds)[0]
    np.testing.assert_array_equal(got, first_maximum_routing(x, g, k))


def test_tiled_max_pool_agrees_with_the_pools_own_indices():
    """The same routing as the rule takes through ``Indices`` where the windows do not tile
    the input (one row more: the last row is read by no window with ceil_mode=0)."""
    shape, k = (2, 3, 6, 8), 2
    x = tied_input((2, 3, 7, 8), seed=3)
    g = np.random.default_rng(2).standard_normal((2, 3, 3, 4)).astype(np.float32)
    tiled = single_node_model("MaxPool", {"x": list(shape)}, kernel_shape=[k, k], strides=[k, k])
    untiled = single_node_model("MaxPool", {"x": [2, 3, 7, 8]}, kernel_shape=[k, k], strides=[k, k])
    by_tiles = run_ort(onnx_derivative(tiled, weights=[], backend="onnx"),
                       {"x": x[:, :, :6], "y_grad": g})["x_grad"]  # fmt: skip
    by_indices = run_ort(onnx_derivative(untiled, weights=[], backend="onnx"),
                         {"x": x, "y_grad": g})["x_grad"]  # fmt: skip
    np.testing.assert_array_equal(by_tiles, by_indices[:, :, :6])
    np.testing.assert_array_equal(by_indices[:, :, 6], 0)
