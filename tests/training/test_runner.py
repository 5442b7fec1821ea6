"""The runner refuses values that do not fit the train step before it runs anything."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.training import (
    LearningRateSGDNesterov,
    OrtDataLoader,
    TrainingRunner,
    check_device,
    make_train_step,
)
from tests.models import linear_regression_model


@pytest.fixture(scope="module", params=["per_weight", "flat"])
def step(request):
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    return make_train_step(model, learning_rate=LearningRateSGDNesterov(), layout=request.param)


def weights(coefs_shape=(3, 1), dtype=np.float32):
    return {"coefs": np.zeros(coefs_shape, dtype), "intercept": np.zeros(1, dtype)}


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        # the flat layout used to reshape a transposed weight silently
        (weights((1, 3)), ValueError, r"weight 'coefs' has shape \(1, 3\), the train step "),
        (weights(dtype=np.float64), TypeError, "weight 'coefs' has dtype float64"),
        ({"coefs": np.zeros((3, 1), np.float32)}, ValueError, r"no value for weight \['intercept"),
        ({**weights(), "bias": np.zeros(1)}, ValueError, r"unknown weight \['bias'\]"),
    ],
)
def test_weights_must_match_the_step(step, values, error, message):
    with pytest.raises(error, match=message):
        TrainingRunner(step, check_device("cpu"), values)


def test_state_must_match_the_step(step):
    state = step.initial_state()
    name = step.state[0]
    wrong_shape = {**state, name: np.zeros(state[name].size + 1, state[name].dtype)}
    with pytest.raises(ValueError, match=f"state '{name}' has shape"):
        TrainingRunner(step, check_device("cpu"), weights(), wrong_shape)
    wrong_type = {**state, name: state[name].astype(np.float64)}
    with pytest.raises(TypeError, match=f"state '{name}' has dtype float64"):
        TrainingRunner(step, check_device("cpu"), weights(), wrong_type)


def test_labels_of_shape_n_feed_a_label_of_shape_n_by_1(step):
    """The seeds' ``[N, 1]`` and scikit-learn's ``[N]``: the same losses."""
    X = np.arange(24, dtype=np.float32).reshape((8, 3)) / 10
    y = np.linspace(-1, 1, 8).astype(np.float32)
    losses = [
        TrainingRunner(step, check_device("cpu"), weights()).run_epoch(
            OrtDataLoader(X, labels, batch_size=4, random_state=0), 0.1
        )
        for labels in (y, y.reshape(-1, 1))
    ]
    np.testing.assert_array_equal(losses[0], losses[1])


def test_data_must_match_the_step(step):
    runner = TrainingRunner(step, check_device("cpu"), weights())
    X = np.zeros((8, 3), np.float32)
    with pytest.raises(ValueError, match=r"y has shape \(8, 2\), the model input 'label' expects"):
        runner.run_epoch(OrtDataLoader(X, np.zeros((8, 2), np.float32), batch_size=4), 0.1)
    with pytest.raises(TypeError, match="X has dtype float64"):
        runner.run_epoch(OrtDataLoader(X.astype(np.float64), np.zeros((8, 1), np.float32)), 0.1)
    np.testing.assert_array_equal(runner.get_weights()["coefs"], np.zeros((3, 1)))
