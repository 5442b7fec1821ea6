"""The split train step (gradient graph, then update graph) against numpy: the gradient of
the squared error of a linear model summed over the batch (the default reduction), and SGD
with an elastic penalty whose gradient the update graph adds once."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from onnxgrad.training import ElasticLearningPenalty, LearningRateSGD
from onnxgrad.training.step.split_step import make_split_step
from tests.models import linear_regression_model


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


@pytest.mark.parametrize("penalty", [None, ElasticLearningPenalty(l1=0.1, l2=0.2)])
def test_gradient_then_update_match_numpy(rng, penalty):
    coef = np.array([[0.5, -1.0, 2.0]], dtype=np.float32)
    intercept = np.array([0.25], dtype=np.float32)
    step = make_split_step(
        linear_regression_model(coef, intercept),
        learning_rate=LearningRateSGD(eta0=0.1, learning_rate="constant"),
        penalty=penalty,
    )
    X = rng.standard_normal((6, 3)).astype(np.float32)
    y = rng.standard_normal((6, 1)).astype(np.float32)
    W, b = coef.T.astype(np.float64), intercept.astype(np.float64)
    residual = X @ W + b - y
    grads = {"coefs": 2 * X.T @ residual, "intercept": 2 * residual.sum(0)}

    outputs = _run(step.gradient, {"X": X, step.label: y, "coefs": coef.T, "intercept": intercept})
    names = list(outputs)
    for name, weight in zip(names, step.weights):
        np.testing.assert_allclose(outputs[name], grads[weight], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs[names[-1]], (residual**2).sum(), rtol=1e-5)

    weights = {"coefs": coef.T, "intercept": intercept}
    feeds = {**step.weight_inputs(weights), **step.initial_state()}
    feeds.update({g: grads[w].astype(np.float32) for g, w in zip(step.gradients, step.weights)})
    feeds[step.learning_rate] = np.array(0.1, dtype=np.float32)
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in step.model.graph.input}}
    result = _run(step.model, feeds)
    new = step.unpack_weights(result)
    l1, l2 = (penalty.l1, penalty.l2) if penalty else (0.0, 0.0)
    for name, value in weights.items():
        w = value.astype(np.float64)
        expected = w - 0.1 * (grads[name] + l1 * np.sign(w) + 2 * l2 * w)
        np.testing.assert_allclose(new[name], expected, rtol=1e-5, atol=1e-6)
    expected_penalty = sum(
        l1 * np.abs(v).sum() + l2 * (v.astype(np.float64) ** 2).sum() for v in weights.values()
    )
    np.testing.assert_allclose(result[step.loss], expected_penalty, rtol=1e-5, atol=1e-7)


def test_split_step_updates_the_flat_vector_only():
    model = linear_regression_model(np.ones((1, 2), np.float32), np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="flat weight vector, not layout 'per_weight'"):
        make_split_step(model, layout="per_weight")
