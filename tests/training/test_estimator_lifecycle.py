"""Early stopping against scikit-learn's MLP rule; partial_fit against a full fit; pickling,
float64 features and reproducibility of the regressors."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from sklearn.neural_network import MLPRegressor

from onnxgrad import OrtGradientOptimizer, add_loss_output
from onnxgrad.training import LearningRateSGDNesterov
from tests.models import linear_regression_model
from tests.training.test_estimators import linear_data, linear_estimator


def sklearn_stop(scores, tol, n_iter_no_change):
    """The epoch at which scikit-learn's MLP stops on these validation scores (its own
    ``_update_no_improvement_count``), and its best score."""
    mlp = MLPRegressor(early_stopping=True, tol=tol, n_iter_no_change=n_iter_no_change)
    mlp.validation_scores_, mlp.best_validation_score_ = [], -np.inf
    mlp._no_improvement_count, mlp.coefs_, mlp.intercepts_ = 0, [], []
    for epoch, score in enumerate(scores, start=1):
        mlp._score = lambda X, y, sample_weight=None, s=score: s
        mlp._update_no_improvement_count(True, None, None, None)
        if mlp._no_improvement_count > mlp.n_iter_no_change:
            return epoch, mlp.best_validation_score_
    return None, mlp.best_validation_score_


@pytest.mark.parametrize(("tol", "patience"), [(1e-3, 2), (1e-2, 4)])
def test_early_stopping_stops_where_sklearns_rule_says(tol, patience):
    X, y = linear_data(n=150)
    y = y + np.random.default_rng(5).normal(0, 0.5, y.shape).astype(np.float32)
    est = linear_estimator(
        max_iter=300, early_stopping=True, tol=tol, n_iter_no_change=patience,
        validation_fraction=0.2, random_state=1,
    )  # fmt: skip
    est.fit(X, y)
    stop, best = sklearn_stop(est.validation_scores_, tol, patience)
    assert stop is not None and stop == est.n_iter_ == len(est.validation_scores_) < 300
    assert est.best_validation_score_ == best
    # the weights kept are the best epoch's: the held-out score equals the best
    held = np.sort(np.random.default_rng(1).permutation(150)[:30])
    assert est.score(X[held], y[held]) == pytest.approx(best, rel=1e-5)


def test_without_early_stopping_every_epoch_runs():
    X, y = linear_data()
    est = linear_estimator(max_iter=12).fit(X, y)
    assert est.n_iter_ == 12 and est.validation_scores_ == []


def test_partial_fit_epochs_equal_a_fit_of_as_many_epochs():
    X, y = linear_data()
    full = linear_estimator(max_iter=3).fit(X, y)
    parts = linear_estimator()
    for _ in range(3):
        parts.partial_fit(X, y)
    assert parts.n_iter_ == 3
    np.testing.assert_allclose(parts.train_losses_, full.train_losses_, rtol=1e-6)
    np.testing.assert_array_equal(parts.get_state()["coefs"], full.get_state()["coefs"])


def test_float64_features_are_cast_to_the_model_float32():
    X, y = linear_data()
    est32 = linear_estimator(max_iter=2).fit(X, y)
    est64 = linear_estimator(max_iter=2).fit(X.astype(np.float64), y.astype(np.float64))
    np.testing.assert_array_equal(est64.get_state()["coefs"], est32.get_state()["coefs"])
    np.testing.assert_array_equal(est64.predict(X.astype(np.float64)), est32.predict(X))


def with_loss_estimator(**params):
    model = add_loss_output(linear_regression_model(np.zeros((1, 3)), np.zeros(1)))
    lr = LearningRateSGDNesterov(eta0=0.02)
    return OrtGradientOptimizer(
        model, ["coefs", "intercept"], max_iter=4, batch_size=8, learning_rate=lr, **params
    )


@pytest.mark.parametrize("make", [linear_estimator, with_loss_estimator])
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_fitted_regressors_round_trip_bit_for_bit(make, how):
    X, y = linear_data()
    est = make(random_state=4).fit(X, y)
    clone = pickle.loads(pickle.dumps(est)) if how == "pickle" else copy.deepcopy(est)
    assert "runner_" not in clone.__dict__  # sessions are rebuilt on first use
    if est.predictor_ is not None:
        np.testing.assert_array_equal(clone.predict(X), est.predict(X))
    assert clone.score(X, y) == est.score(X, y)
    np.testing.assert_array_equal(clone.get_full_state()["coefs"], est.get_full_state()["coefs"])
    for fitted in (est, clone):
        fitted.partial_fit(X, y)
    np.testing.assert_array_equal(clone.get_state()["coefs"], est.get_state()["coefs"])
    unfitted = pickle.loads(pickle.dumps(make()))
    assert not unfitted.__sklearn_is_fitted__()


def test_random_state_reproduces_the_fit():
    X, y = linear_data()
    first = linear_estimator(random_state=11, early_stopping=True, n_iter_no_change=2).fit(X, y)
    again = linear_estimator(random_state=11, early_stopping=True, n_iter_no_change=2).fit(X, y)
    assert first.validation_scores_ == again.validation_scores_
    np.testing.assert_array_equal(first.get_state()["coefs"], again.get_state()["coefs"])


def test_a_second_fit_keeps_the_sessions_and_starts_again_from_the_model():
    X, y = linear_data()
    est = linear_estimator(max_iter=4, random_state=3).fit(X, y)
    session = est.runner_.session
    est.fit(X, y)
    fresh = linear_estimator(max_iter=4, random_state=3).fit(X, y)
    assert est.runner_.session is session
    assert est.train_losses_ == fresh.train_losses_
    np.testing.assert_array_equal(est.get_state()["coefs"], fresh.get_state()["coefs"])
    est.set_params(learning_rate=LearningRateSGDNesterov(eta0=1e-3)).fit(X, y)
    assert est.runner_.session is not session
