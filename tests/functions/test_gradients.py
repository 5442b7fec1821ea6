"""Y_grad outputs against central finite differences of Y, computed in float64."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime
import pytest

from onnxgrad.functions import function_onnx_graph
from tests.functions.references import CASES, GRADIENT_CASES, sample_weight
from tests.functions.runtimes import run_onnxruntime

STEP = 1e-6


def central_differences(f: Callable[[np.ndarray], float], x: np.ndarray) -> np.ndarray:
    """d f / d x by (f(x + h e_i) - f(x - h e_i)) / 2h, one element at a time."""
    grad = np.empty_like(x)
    for index in np.ndindex(x.shape):
        shift = np.zeros_like(x)
        shift[index] = STEP
        grad[index] = (f(x + shift) - f(x - shift)) / (2 * STEP)
    return grad


def loss_of(model: onnx.ModelProto, feeds: dict, wrt: str) -> Callable[[np.ndarray], float]:
    """x -> output Y of ``model`` fed with ``feeds`` and ``wrt = x`` (one session for all)."""
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    index = [o.name for o in session.get_outputs()].index("Y")
    return lambda x: float(session.run(None, {**feeds, wrt: x})[index].sum())


def _feeds(case, rng, weighted: bool) -> dict:
    feeds = case.feeds(rng, np.dtype(np.float64))
    if weighted:
        feeds["w"] = sample_weight(rng, np.float64, n=feeds["X2"].shape[0])
    return feeds


GRADIENT_VARIANTS = [(c, False) for c in GRADIENT_CASES] + [
    (c, True) for c in GRADIENT_CASES if c.weighted
]


@pytest.mark.parametrize(
    ("case", "weighted"),
    GRADIENT_VARIANTS,
    ids=[f"{c.id}-{'weighted' if w else 'unweighted'}" for c, w in GRADIENT_VARIANTS],
)
def test_gradient_output_matches_finite_differences(case, weighted, rng):
    model = function_onnx_graph(
        case.name, dtype=np.float64, weight_name="w" if weighted else None, **case.options
    )
    feeds = _feeds(case, rng, weighted)
    wrt = "X2" if "X2" in feeds else "X"
    grad = run_onnxruntime(model, feeds)["Y_grad"]
    expected = central_differences(loss_of(model, feeds, wrt), feeds[wrt])
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("weighted", [False, True])
def test_grad_square_error_is_the_gradient_of_square_error(weighted, rng):
    weight_name = "w" if weighted else None
    case = next(c for c in CASES if c.name == "square_error")
    loss = function_onnx_graph("square_error", dtype=np.float64, weight_name=weight_name)
    grad = function_onnx_graph("grad_square_error", dtype=np.float64, weight_name=weight_name)
    feeds = _feeds(case, rng, weighted)
    expected = central_differences(loss_of(loss, feeds, "X2"), feeds["X2"])
    got = run_onnxruntime(grad, feeds)["Y_grad"]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8)


def test_penalty_update_steps_along_minus_the_penalty_gradient(rng):
    l1, l2 = 0.1, 0.05
    penalty = function_onnx_graph(
        "grad_penalty_elastic_error", dtype=np.float64, l1_weight=l1, l2_weight=l2
    )
    update = function_onnx_graph("update_penalty_elastic_error", dtype=np.float64, l1=l1, l2=l2)
    x = rng.standard_normal((3, 4))
    expected = central_differences(loss_of(penalty, {}, "X"), x)
    step = x - run_onnxruntime(update, {"X": x})["Y"]
    np.testing.assert_allclose(step, expected, rtol=1e-6, atol=1e-8)


def test_n_penalty_adds_the_penalty_of_each_weight(rng):
    options = {"l1_weight": 0.2, "l2_weight": 0.3}
    single = function_onnx_graph("grad_penalty_elastic_error", dtype=np.float64, **options)
    several = function_onnx_graph(
        "n_penalty_elastic_error", dtype=np.float64, n_tensors=2, **options
    )
    weights = {"W0": rng.standard_normal((3, 4)), "W1": rng.standard_normal((5, 2))}
    total = run_onnxruntime(several, {"loss": np.zeros((1, 1)), **weights})["Y"]
    parts = [run_onnxruntime(single, {"X": x}) for x in weights.values()]
    np.testing.assert_allclose(total, sum(p["Y"] for p in parts), rtol=1e-12)
    for name, part in zip(weights, parts):
        dy = central_differences(
            loss_of(several, {"loss": np.zeros((1, 1)), **weights}, name), weights[name]
        )
        np.testing.assert_allclose(part["Y_grad"], dy, rtol=1e-6, atol=1e-8)
