"""The defaults code written for onnxcustom relies on: a sample weight that defaults to ones,
the penalty of weights of different shapes, a linear regression with a matrix intercept."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.functions import function_onnx_graph
from tests.functions.runtimes import RUNTIMES


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize(
    "name", ["square_error", "grad_loss_square_error", "grad_loss_absolute_error"]
)
def test_an_unfed_sample_weight_weighs_every_sample_one(name, runtime, rng):
    weighted = function_onnx_graph(name, dtype=np.float64, weight_name="weight")
    plain = function_onnx_graph(name, dtype=np.float64)
    feeds = {"X1": rng.standard_normal((6, 1)), "X2": rng.standard_normal((6, 1))}
    without = RUNTIMES[runtime](weighted, feeds)
    expected = RUNTIMES[runtime](plain, feeds)
    for key, value in expected.items():
        np.testing.assert_allclose(without[key], value, rtol=1e-12)
    w = np.linspace(0.5, 2, 6)
    error = (feeds["X1"] - feeds["X2"]).ravel()
    pointwise = np.abs(error) if name == "grad_loss_absolute_error" else error**2
    fed = RUNTIMES[runtime](weighted, {**feeds, "weight": w})
    np.testing.assert_allclose(fed["Y"], (w * pointwise).sum(), rtol=1e-12)


def test_a_weight_of_fixed_shape_defaults_to_ones_of_that_shape(rng):
    model = function_onnx_graph(
        "grad_loss_square_error", dtype=np.float64, weight_name="w", input_shapes={"w": (4,)}
    )
    default = next(i for i in model.graph.initializer if i.name == "w")
    assert list(default.dims) == [4]
    feeds = {"X1": rng.standard_normal((4, 2)), "X2": rng.standard_normal((4, 2))}
    got = RUNTIMES["onnxruntime"](model, feeds)["Y"]
    np.testing.assert_allclose(got, ((feeds["X1"] - feeds["X2"]) ** 2).sum(), rtol=1e-12)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_n_penalty_takes_weights_of_different_shapes_and_a_column_loss(runtime, rng):
    model = function_onnx_graph(
        "n_penalty_elastic_error",
        dtype=np.float64,
        n_tensors=2,
        l1_weight=0.1,
        l2_weight=0.9,
        weight_name="weight",  # accepted and ignored: a penalty has no per-sample term
    )
    assert [i.name for i in model.graph.input] == ["loss", "W0", "W1"]
    w0, w1 = rng.standard_normal((10, 1)), rng.standard_normal((5, 3))
    got = RUNTIMES[runtime](model, {"loss": np.array([[2.0]]), "W0": w0, "W1": w1})["Y"]
    expected = 2.0 + sum(0.1 * np.abs(w).sum() + 0.9 * (w**2).sum() for w in (w0, w1))
    assert got.shape == (1,)
    np.testing.assert_allclose(got, [expected], rtol=1e-12)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("b_shape", [(1, 2), (5, 2), (5, 1)])
def test_linear_regression_takes_a_matrix_intercept(b_shape, runtime, rng):
    model = function_onnx_graph("linear_regression", dtype=np.float64)
    feeds = {
        "X": rng.standard_normal((5, 3)),
        "A": rng.standard_normal((3, 2)),
        "B": rng.standard_normal(b_shape),
    }
    got = RUNTIMES[runtime](model, feeds)["Y"]
    np.testing.assert_allclose(got, feeds["X"] @ feeds["A"] + feeds["B"], rtol=1e-12)
