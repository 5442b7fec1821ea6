"""Every catalogue graph against its numpy reference, float32 and float64, on both runtimes."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.functions import function_onnx_graph
from tests.functions.references import CASES, rows, sample_weight, square_loss
from tests.functions.runtimes import RUNTIMES, run_onnxruntime, tolerance

DTYPES = [np.float32, np.float64]


def assert_outputs(got: dict, expected: dict, dtype) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert got[name].dtype == np.dtype(dtype), name
        assert got[name].shape == np.shape(value), name
        np.testing.assert_allclose(got[name], value, **tolerance(dtype), err_msg=name)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_graph_matches_numpy(case, dtype, runtime, rng):
    model = function_onnx_graph(case.name, dtype=dtype, **case.options)
    feeds = case.feeds(rng, np.dtype(dtype))
    assert [i.name for i in model.graph.input] == list(feeds)
    assert_outputs(RUNTIMES[runtime](model, feeds), case.reference(feeds), dtype)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [c for c in CASES if c.weighted], ids=lambda c: c.id)
def test_weighted_graph_matches_numpy(case, dtype, runtime, rng):
    model = function_onnx_graph(case.name, dtype=dtype, weight_name="sample_weight", **case.options)
    feeds = case.feeds(rng, np.dtype(dtype))
    weight = sample_weight(rng, dtype, n=feeds["X2"].shape[0])
    assert [i.name for i in model.graph.input] == [*feeds, "sample_weight"]
    got = RUNTIMES[runtime](model, {**feeds, "sample_weight": weight})
    assert_outputs(got, case.reference(feeds, weight), dtype)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("shape", [(6,), (4, 2, 3)])
def test_sample_weight_broadcasts_over_rows_of_any_rank(shape, runtime, rng):
    model = function_onnx_graph(
        "grad_loss_square_error",
        dtype=np.float64,
        weight_name="w",
        input_shapes={"X1": shape, "X2": shape, "w": (shape[0],)},
    )
    feeds = {"X1": rng.standard_normal(shape), "X2": rng.standard_normal(shape)}
    weight = sample_weight(rng, np.float64, n=shape[0])
    got = RUNTIMES[runtime](model, {**feeds, "w": weight})
    assert_outputs(got, square_loss(feeds, weight), np.float64)


def test_sample_weight_declared_as_a_column_is_flattened(rng):
    model = function_onnx_graph(
        "grad_loss_square_error", dtype=np.float64, weight_name="w", input_shapes={"w": (5, 1)}
    )
    feeds = {"X1": rng.standard_normal((5, 2)), "X2": rng.standard_normal((5, 2))}
    weight = sample_weight(rng, np.float64)
    got = run_onnxruntime(model, {**feeds, "w": weight.reshape((5, 1))})
    assert_outputs(got, square_loss(feeds, weight), np.float64)


def test_unit_weights_give_the_unweighted_loss(rng):
    feeds = {"X1": rng.standard_normal((5, 2)), "X2": rng.standard_normal((5, 2))}
    weighted = function_onnx_graph("grad_loss_absolute_error", dtype=np.float64, weight_name="w")
    got = run_onnxruntime(weighted, {**feeds, "w": np.ones(5)})
    d = feeds["X1"] - feeds["X2"]
    np.testing.assert_allclose(got["Y"], np.abs(d).sum(), rtol=1e-12)
    np.testing.assert_allclose(got["Y_grad"], -np.sign(d) * rows(np.ones(5), d))


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("shape", [(7,), (2, 3, 4)])
@pytest.mark.parametrize("name", ["axpy", "axpyw2", "zero", "update_penalty_elastic_error"])
def test_updates_on_weights_of_any_rank(name, shape, runtime, rng):
    case = next(c for c in CASES if c.name == name)
    tensors = [i for i in ("X", "X1", "X2", "G") if i in case.feeds(rng, np.dtype(np.float64))]
    model = function_onnx_graph(
        name, dtype=np.float64, input_shapes=dict.fromkeys(tensors, shape), **case.options
    )
    feeds = case.feeds(rng, np.dtype(np.float64))
    feeds.update({k: rng.standard_normal(shape) for k in tensors})
    assert_outputs(RUNTIMES[runtime](model, feeds), case.reference(feeds), np.float64)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_zero_ignores_non_finite_values(runtime):
    model = function_onnx_graph("zero", dtype=np.float64, input_shapes={"X": (4,)})
    x = np.array([np.inf, -np.inf, np.nan, 2.0])
    got = RUNTIMES[runtime](model, {"X": x})["Y"]
    np.testing.assert_array_equal(got, np.zeros(4))


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_log_loss_stays_finite_on_saturated_scores(dtype, runtime):
    eps = 1e-5
    model = function_onnx_graph(
        "grad_sigmoid_neg_log_loss_error",
        dtype=dtype,
        eps=eps,
        input_shapes={"X1": (4,), "X2": (4,)},
    )
    labels = np.array([1, 0, 1, 0], dtype=np.int64)
    scores = np.array([-60.0, 60.0, 60.0, -60.0], dtype=dtype)
    got = RUNTIMES[runtime](model, {"X1": labels, "X2": scores})
    # Two confidently wrong scores cost -log(eps) each once clipped; the right ones about 0.
    np.testing.assert_allclose(got["Y"], -2 * np.log(eps), rtol=1e-4)
    np.testing.assert_allclose(got["Y_grad"], [-1.0, 1.0, 0.0, 0.0], atol=1e-6)


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_n_penalty_takes_weights_of_different_ranks(runtime, rng):
    shapes = {"W0": (3, 4), "W1": (5,), "W2": (2, 2, 2)}
    model = function_onnx_graph(
        "n_penalty_elastic_error",
        dtype=np.float64,
        n_tensors=3,
        l1_weight=0.5,
        l2_weight=0.25,
        loss_shape=(1,),
        input_shapes=shapes,
    )
    weights = {k: rng.standard_normal(s) for k, s in shapes.items()}
    got = RUNTIMES[runtime](model, {"loss": np.array([2.0]), **weights})["Y"]
    expected = 2.0 + sum(0.5 * np.abs(x).sum() + 0.25 * (x**2).sum() for x in weights.values())
    assert got.shape == (1,)
    np.testing.assert_allclose(got, [expected], rtol=1e-12)
