"""The estimators: converted scikit-learn networks, warm start, state, clone, bad input."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from skl2onnx import to_onnx
from sklearn.base import clone
from sklearn.datasets import make_classification, make_regression
from sklearn.exceptions import ConvergenceWarning, NotFittedError
from sklearn.linear_model import LinearRegression
from sklearn.metrics import log_loss, r2_score
from sklearn.model_selection import GridSearchCV, KFold, train_test_split
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.utils.validation import check_is_fitted

from onnxgrad import ConvergenceError, add_loss_output, select_model_inputs_outputs
from onnxgrad.training import (
    CrossEntropyLearningLoss,
    ElasticLearningPenalty,
    LearningRateAdam,
    LearningRateSGD,
    LearningRateSGDNesterov,
    NegLogLearningLoss,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
    SquareLearningLoss,
)
from tests.models import linear_regression_model


def initial_network(estimator, X, y):
    """A scikit-learn network holding its initial weights (one step at a tiny rate)."""
    init = clone(estimator).set_params(max_iter=1, learning_rate_init=1e-30, batch_size=len(X))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        init.fit(X, y)
    trained = copy.deepcopy(init)
    trained.set_params(**{**estimator.get_params(), "warm_start": True})
    return init, trained


def fit_quietly(estimator, X, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return estimator.fit(X, y)


def run_onnx(model, X, exact_kernels=False):
    """Run ``model`` on ``X``; ``exact_kernels``: no graph rewrite, no weight prepacking, so
    constant weights go through the kernels that weights fed as inputs use."""
    options = ort.SessionOptions()
    if exact_kernels:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.add_session_config_entry("session.disable_prepacking", "1")
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, {session.get_inputs()[0].name: X})


@pytest.fixture(scope="module")
def regression():
    X, y = make_regression(400, n_features=10, noise=5.0, random_state=0)
    X, y = X.astype(np.float32), (y / y.std()).astype(np.float32)
    return train_test_split(X, y, random_state=0)


def test_mlp_regressor_reaches_sklearn_r2(regression):
    X_train, X_test, y_train, y_test = regression
    skl = MLPRegressor(
        hidden_layer_sizes=(16,),
        solver="sgd",
        batch_size=20,
        max_iter=30,
        learning_rate="constant",
        learning_rate_init=0.01,
        momentum=0.9,
        nesterovs_momentum=True,
        alpha=0.0,
        n_iter_no_change=1000,
        random_state=0,
    )
    init, skl = initial_network(skl, X_train, y_train)
    fit_quietly(skl, X_train, y_train)
    expected = r2_score(y_test, skl.predict(X_test))

    onx = to_onnx(init, X_train[:1], target_opset=15)
    # scikit-learn minimises half the squared error: half its rate gives the same steps
    est = OrtGradientForwardBackwardOptimizer(
        onx,
        max_iter=30,
        batch_size=20,
        learning_rate=LearningRateSGDNesterov(eta0=0.005, learning_rate="constant"),
        random_state=0,
    )
    est.fit(X_train, y_train)
    got = r2_score(y_test, est.predict(X_test).ravel())
    assert expected > 0.9
    assert abs(got - expected) < 0.02
    assert len(est.train_losses_) == 30 and est.n_iter_ == 30
    assert est.train_losses_[-1] < est.train_losses_[0] / 5

    trained = est.get_trained_onnx()
    onnx.checker.check_model(trained, full_check=True)
    assert trained.ir_version <= 10
    # the deployable model predicts exactly what the final state predicts
    np.testing.assert_array_equal(run_onnx(trained, X_test, True)[0], est.predict(X_test))
    for name, value in est.trained_coef_.items():
        np.testing.assert_array_equal(value, est.get_state()[name])


@pytest.fixture(scope="module")
def classification():
    X, y = make_classification(
        300, n_features=6, n_informative=4, n_classes=3, n_clusters_per_class=1, random_state=1
    )
    return train_test_split(X.astype(np.float32), y, random_state=0)


def test_mlp_classifier_learns_with_cross_entropy(classification):
    X_train, X_test, y_train, y_test = classification
    init = MLPClassifier(hidden_layer_sizes=(12,), random_state=0)
    init, _ = initial_network(init, X_train, y_train)
    onx = to_onnx(init, X_train[:1], target_opset=15, options={"zipmap": False})
    est = OrtGradientForwardBackwardOptimizer(
        onx,
        output="probabilities",
        learning_loss=CrossEntropyLearningLoss(probability_function=None, reduction="mean"),
        learning_rate=LearningRateSGDNesterov(eta0=0.05, learning_rate="constant"),
        max_iter=25,
        batch_size=16,
        random_state=0,
    )
    before = log_loss(y_test, run_onnx(onx, X_test)[1], labels=[0, 1, 2])
    est.fit(X_train, y_train)
    probabilities = run_onnx(est.get_trained_onnx(), X_test)[1]
    after = log_loss(y_test, probabilities, labels=[0, 1, 2])
    assert after < before / 2
    assert (probabilities.argmax(axis=1) == y_test).mean() > 0.8
    # score is the opposite of the mean loss, here scikit-learn's log loss
    assert -est.score(X_test, y_test) == pytest.approx(after, rel=1e-4)


def test_binary_mlp_classifier_learns_with_neg_log_on_logits():
    X, y = make_classification(200, n_features=5, random_state=2)
    X = X.astype(np.float32)
    init = MLPClassifier(hidden_layer_sizes=(8,), random_state=0)
    init, _ = initial_network(init, X, y)
    onx = to_onnx(init, X[:1], target_opset=15, options={"zipmap": False})
    logits = select_model_inputs_outputs(onx, outputs=["add_result1"])
    weights = ["coefficient", "intercepts", "coefficient1", "intercepts1"]
    est = OrtGradientForwardBackwardOptimizer(
        logits,
        weights_to_train=weights,
        learning_loss=NegLogLearningLoss(reduction="mean"),
        learning_rate=LearningRateSGDNesterov(eta0=0.05, learning_rate="constant"),
        max_iter=20,
        batch_size=10,
        random_state=0,
    )
    est.fit(X, y)
    scores = run_onnx(est.get_trained_onnx(), X)[0].ravel().astype(np.float64)
    probability = 1 / (1 + np.exp(-scores))
    assert log_loss(y, probability) == pytest.approx(-est.score(X, y), rel=1e-3)
    assert log_loss(y, probability) < 0.4
    assert ((probability > 0.5) == y).mean() > 0.85


def linear_data(n=60, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 3)).astype(np.float32)
    y = (X @ np.array([1.5, -2.0, 0.5]) + 0.3).astype(np.float32)
    return X, y


def linear_estimator(**kwargs):
    """The mean squared error (``reduction='mean'``): the references below are means."""
    params = {
        "learning_loss": SquareLearningLoss(reduction="mean"),
        "max_iter": 10,
        "batch_size": 8,
        "learning_rate": LearningRateSGDNesterov(eta0=0.02, learning_rate="constant"),
        "random_state": 3,
    }
    params.update(kwargs)
    return OrtGradientForwardBackwardOptimizer(
        linear_regression_model(np.zeros((1, 3)), np.zeros(1)), **params
    )


def test_warm_start_continues_where_it_stopped():
    X, y = linear_data()
    once = linear_estimator(max_iter=10).fit(X, y)
    twice = linear_estimator(max_iter=5, warm_start=True).fit(X, y).fit(X, y)
    for name, value in once.get_full_state().items():
        np.testing.assert_allclose(twice.get_full_state()[name], value, rtol=1e-6)
    assert twice.train_losses_ == pytest.approx(once.train_losses_, rel=1e-5)
    cold = linear_estimator(max_iter=5).fit(X, y)
    cold.fit(X, y)
    # a cold fit starts again: same initial weights, same shuffling
    assert cold.train_losses_ == pytest.approx(once.train_losses_[:5], rel=1e-6)


def mse_gradient(X, y, w):
    """The gradient of ``mean((X w[:-1] + w[-1] - y)^2)``."""
    residual = X @ w[:-1] + w[-1] - y
    return np.r_[2 * X.T @ residual / len(X), 2 * residual.mean()]


def adam_steps(X, y, w, steps, eta0, moments=None):
    """``steps`` Adam updates (torch's formula) from ``moments = (m, v, k)``."""
    m, v, k = moments or (np.zeros_like(w), np.zeros_like(w), 0)
    for _ in range(steps):
        k += 1
        g = mse_gradient(X, y, w)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        w = w - eta0 * (m / (1 - 0.9**k)) / (np.sqrt(v / (1 - 0.999**k)) + 1e-8)
    return w, (m, v, k)


def test_warm_start_switches_optimizer_and_trained_weights():
    """SGD on ``coefs`` only, then Adam on every weight (fresh moments, the intercept from
    the model), then Adam with another rate (its moments and step count carried over)."""
    X, y = linear_data(n=20)
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    est = linear_estimator(
        max_iter=3,
        batch_size=20,
        weights_to_train=["coefs"],
        learning_rate=LearningRateSGD(eta0=0.05, learning_rate="constant"),
        warm_start=True,
    )
    est.fit(X, y)
    w = np.zeros(4)
    for _ in range(3):
        w[:3] -= 0.05 * mse_gradient(X64, y64, w)[:3]
    est.set_params(weights_to_train=None, learning_rate="Adam").fit(X, y)
    w, moments = adam_steps(X64, y64, w, 3, 0.001)
    state = est.get_full_state()
    assert state["step"].tolist() == [3]
    np.testing.assert_allclose(state["coefs"].ravel(), w[:3], rtol=1e-4)
    est.set_params(learning_rate=LearningRateAdam(eta0=0.01)).fit(X, y)
    w, _ = adam_steps(X64, y64, w, 3, 0.01, moments)
    state = est.get_full_state()
    assert state["step"].tolist() == [6] and est.n_iter_ == 9
    np.testing.assert_allclose(state["coefs"].ravel(), w[:3], rtol=1e-4)
    np.testing.assert_allclose(state["intercept"], w[3:], rtol=1e-4)
    est.set_params(learning_rate="Nesterov").fit(X, y)
    velocity = {"coefs_velocity", "intercept_velocity"}
    assert set(est.get_full_state()) == {"coefs", "intercept", *velocity}


@pytest.mark.ort_training
def test_both_gradient_backends_train_the_same_weights():
    X, y = linear_data()
    native = linear_estimator(max_iter=4).fit(X, y)
    builder = linear_estimator(max_iter=4, backend="ort").fit(X, y)
    for name, value in native.get_full_state().items():
        np.testing.assert_allclose(builder.get_full_state()[name], value, rtol=1e-5, atol=1e-6)


def test_ort_gradient_optimizer_solves_least_squares():
    X, y = linear_data(n=80)
    reference = LinearRegression().fit(X, y)
    model = add_loss_output(linear_regression_model(np.zeros((1, 3)), np.zeros(1)))
    est = OrtGradientOptimizer(
        model,
        ["coefs", "intercept"],
        max_iter=60,
        batch_size=10,
        learning_rate=LearningRateSGD(eta0=0.02, learning_rate="constant"),
        random_state=0,
    )
    est.fit(X, y)
    state = est.get_state()
    np.testing.assert_allclose(state["coefs"].ravel(), reference.coef_, atol=1e-3)
    np.testing.assert_allclose(state["intercept"], [reference.intercept_], atol=1e-3)
    np.testing.assert_allclose(est.predict(X).ravel(), reference.predict(X), atol=1e-2)


def test_sample_weights_and_penalty():
    X, y = linear_data(n=40)
    weights = np.random.default_rng(1).uniform(0, 2, len(X))
    est = linear_estimator(
        max_iter=200,
        batch_size=40,
        learning_penalty=ElasticLearningPenalty(l1=0.0, l2=0.1),
        learning_rate=LearningRateSGD(eta0=0.05, learning_rate="constant"),
    )
    est.fit(X, y, sample_weight=weights)
    # minimiser of sum w (x.c + b - y)^2 / sum w + 0.1 (|c|^2 + b^2): ridge normal equations
    A = np.hstack([X, np.ones((len(X), 1))]).astype(np.float64)
    W = weights / weights.sum()
    solution = np.linalg.solve(A.T @ (W[:, None] * A) + 0.1 * np.eye(4), A.T @ (W * y))
    got = np.concatenate([est.trained_coef_["coefs"].ravel(), est.trained_coef_["intercept"]])
    np.testing.assert_allclose(got, solution, atol=2e-3)


def test_zero_sample_weights_skip_their_rows():
    """Batches of one row: plain SGD on the rows of positive weight, in the shuffled order
    (a zero-weight batch is a no-op, not a 0 / 0 divergence)."""
    X, y = linear_data(n=12)
    weights = np.tile([0.0, 2.0, 0.0, 1.0], 3)
    est = linear_estimator(
        max_iter=3,
        batch_size=1,
        learning_rate=LearningRateSGD(eta0=0.05, learning_rate="constant"),
        random_state=4,
    )
    est.fit(X, y, sample_weight=weights)
    coefs, intercept = np.zeros(3), 0.0
    rng = np.random.default_rng(4)
    for _ in range(3):
        for row in rng.permutation(len(X)):
            if weights[row]:
                residual = X[row] @ coefs + intercept - y[row]
                coefs, intercept = coefs - 0.1 * residual * X[row], intercept - 0.1 * residual
    np.testing.assert_allclose(est.trained_coef_["coefs"].ravel(), coefs, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(est.trained_coef_["intercept"], [intercept], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.zeros(60), "sample_weight is all zeros"),
        (np.r_[np.ones(59), -1.0], r"sample_weight\[59\] is -1.0: weights must be >= 0"),
        (np.r_[np.nan, np.ones(59)], r"sample_weight holds nan at row 0"),
    ],
)
def test_bad_sample_weights_are_refused(weights, message):
    X, y = linear_data()
    est = linear_estimator()
    with pytest.raises(ValueError, match=message):
        est.fit(X, y, sample_weight=weights)
    assert not hasattr(est, "runner_")


def test_validation_losses_and_losses():
    X, y = linear_data(n=50)
    est = linear_estimator(max_iter=10, validation_every=0.2)
    est.fit(X[:40], y[:40], X_val=X[40:], y_val=y[40:])
    assert len(est.validation_losses_) == 5
    coefs, intercept = est.trained_coef_["coefs"], est.trained_coef_["intercept"]
    residual = X[40:] @ coefs + intercept - y[40:, None]
    assert est.validation_losses_[-1] == pytest.approx(float((residual**2).mean()), rel=1e-4)
    np.testing.assert_allclose(est.losses(X[40:], y[40:]), (residual**2).ravel(), rtol=1e-4)


def test_train_and_validation_losses_are_the_same_objective():
    """Both include the penalty (score leaves it out): with one full batch an epoch, the
    train loss of an epoch is the objective of the weights the previous one ended with."""
    X, y = linear_data(n=50)
    X64, y64 = X.astype(np.float64), y.astype(np.float64)

    def mse(X, y, w):
        return float(((X @ w["coefs"] + w["intercept"] - y[:, None]) ** 2).mean())

    def objective(X, y, w):
        penalty = sum(0.1 * np.abs(v).sum() + 0.2 * (v**2).sum() for v in w.values())
        return mse(X, y, w) + penalty

    est = linear_estimator(
        max_iter=1,
        batch_size=40,
        validation_every=1,
        learning_penalty=ElasticLearningPenalty(l1=0.1, l2=0.2),
        learning_rate=LearningRateSGD(eta0=0.1, learning_rate="constant"),
        warm_start=True,
    )
    est.fit(X[:40], y[:40], X_val=X[40:], y_val=y[40:])
    first = {k: v.astype(np.float64) for k, v in est.trained_coef_.items()}
    assert est.validation_losses_ == [pytest.approx(objective(X64[40:], y64[40:], first))]
    est.fit(X[:40], y[:40])
    assert est.train_losses_[1] == pytest.approx(objective(X64[:40], y64[:40], first), rel=1e-5)
    now = {k: v.astype(np.float64) for k, v in est.trained_coef_.items()}
    assert -est.score(X[40:], y[40:]) == pytest.approx(mse(X64[40:], y64[40:], now), rel=1e-5)


def test_warm_starts_validate_on_the_total_epoch_count():
    """validation_every counts epochs across warm starts: three fits of one epoch with
    validation_every=2 validate once, after the second epoch."""
    X, y = linear_data(n=50)
    est = linear_estimator(max_iter=1, validation_every=np.int64(2), warm_start=True)
    for _ in range(3):
        est.fit(X[:40], y[:40], X_val=X[40:], y_val=y[40:])
        if est.n_iter_ == 2:
            residual = X[40:] @ est.trained_coef_["coefs"] + est.trained_coef_["intercept"]
            after_two = float(((residual - y[40:, None]) ** 2).mean())
    assert est.validation_losses_ == [pytest.approx(after_two, rel=1e-5)]
    fraction = linear_estimator(max_iter=4, validation_every=np.float32(0.5))
    fraction.fit(X[:40], y[:40], X_val=X[40:], y_val=y[40:])
    assert len(fraction.validation_losses_) == 2
    for bad in (np.nan, np.inf, -1, True):
        with pytest.raises(ValueError, match="validation_every must be a finite number"):
            linear_estimator(validation_every=bad).fit(X, y)


def test_clone_and_params():
    est = linear_estimator(max_iter=3, learning_penalty=ElasticLearningPenalty(0.1, 0.2))
    cloned = clone(est)
    assert not hasattr(cloned, "runner_")
    assert cloned.get_params()["learning_rate__eta0"] == 0.02
    assert cloned.get_params()["learning_penalty__l2"] == 0.2
    cloned.set_params(max_iter=4, learning_rate__eta0=0.05)
    assert cloned.max_iter == 4 and cloned.learning_rate.eta0 == 0.05
    assert est.learning_rate.eta0 == 0.02
    X, y = linear_data()
    cloned.fit(X, y)
    assert cloned.learning_rate.get_params()["eta0"] == 0.05
    with pytest.raises(ValueError, match="invalid parameter 'speed'"):
        cloned.set_params(speed=3)


def test_grid_search_and_check_is_fitted():
    X, y = linear_data()
    est = linear_estimator(max_iter=5)
    with pytest.raises(NotFittedError):
        check_is_fitted(est)
    grid = {"learning_rate": [LearningRateSGD(eta0=0.02, learning_rate="constant"), 1e-6]}
    search = GridSearchCV(est, grid, cv=2).fit(X, y)
    assert search.best_params_["learning_rate"] is grid["learning_rate"][0]
    check_is_fitted(search.best_estimator_)
    # the score GridSearchCV ranks by is the opposite of the mean squared error
    scores = []
    for train, test in KFold(2).split(X):
        fold = clone(est).set_params(**search.best_params_).fit(X[train], y[train])
        scores.append(-((fold.predict(X[test]).ravel() - y[test]) ** 2).mean())
    assert search.best_score_ == pytest.approx(np.mean(scores), rel=1e-5)


def test_the_model_is_never_modified(tmp_path):
    X, y = linear_data()
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    before = model.SerializeToString()
    est = OrtGradientForwardBackwardOptimizer(model, max_iter=2).fit(X, y)
    assert model.SerializeToString() == before
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    from_path = OrtGradientForwardBackwardOptimizer(str(path), max_iter=2).fit(X, y)
    assert from_path.get_trained_onnx().graph.initializer
    paths = est.save_onnx_graph(tmp_path / "graphs")
    for path in paths.values():
        onnx.checker.check_model(onnx.load(path), full_check=True)
    assert set(paths) == {"train_step", "train_step_indexed", "evaluation", "prediction"}


def test_verbose_shows_loss_and_learning_rate(capsys):
    X, y = linear_data()
    linear_estimator(max_iter=3, verbose=1).fit(X, y)
    lines = capsys.readouterr().err.splitlines()  # no terminal: one plain line per epoch
    assert [line.split()[:2] for line in lines] == [["epoch", f"{k}/3"] for k in (1, 2, 3)]
    assert all(" loss " in line and " lr " in line for line in lines)


def test_divergence_raises_and_keeps_finite_weights():
    X, y = linear_data()
    X = X * 1000
    est = linear_estimator(
        max_iter=50, learning_rate=LearningRateSGD(eta0=10.0, learning_rate="constant")
    )
    with pytest.raises(ConvergenceError, match="diverged"):
        est.fit(X, y)
    assert all(np.isfinite(v).all() for v in est.get_state().values())
    assert all(np.isfinite(v).all() for v in est.trained_coef_.values())
    quiet = linear_estimator(
        max_iter=50, learning_rate=LearningRateSGD(eta0=10.0, learning_rate="constant"), exc=False
    )
    with pytest.warns(RuntimeWarning, match="diverged") as warned:
        quiet.fit(X, y)
    assert warned[0].filename == __file__
    assert all(np.isfinite(v).all() for v in quiet.get_state().values())


def with_value(shape, index, value) -> np.ndarray:
    array = np.zeros(shape, np.float32)
    array[index] = value
    return array


@pytest.mark.parametrize(
    ("X", "y", "error", "message"),
    [
        (np.zeros((5, 3), np.float32), np.zeros(4, np.float32), ValueError, "different numbers"),
        (
            np.zeros((5, 3), np.complex64),
            np.zeros(5, np.float32),
            TypeError,
            "X has dtype complex64",
        ),
        (np.zeros((5, 4), np.float32), np.zeros(5, np.float32), ValueError, "expects 3 values"),
        (np.zeros(5, np.float32), np.zeros(5, np.float32), ValueError, "expects 2 dimensions"),
        (np.zeros((5, 3), np.float32), np.zeros(5, complex), TypeError, "y has dtype complex128"),
        (with_value((5, 3), (3, 1), np.nan), np.zeros(5, np.float32), ValueError, "X holds nan"),
        (np.zeros((5, 3), np.float32), with_value(5, 2, -np.inf), ValueError, "y holds -inf"),
    ],
)
def test_bad_data_is_refused_before_training(X, y, error, message):
    est = linear_estimator()
    with pytest.raises(error, match=message):
        est.fit(X, y)
    assert not hasattr(est, "runner_")


def test_bad_parameters_are_refused_before_training():
    X, y = linear_data()
    with pytest.raises(ValueError, match=r"unknown weights \['coef'\]"):
        linear_estimator(weights_to_train=["coef"]).fit(X, y)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        linear_estimator(batch_size=0).fit(X, y)
    with pytest.raises(ValueError, match="sample_weight must be a vector of 60"):
        linear_estimator().fit(X, y, sample_weight=np.ones(3))
    with pytest.raises(ValueError, match="unknown learning_loss 'hinge'"):
        linear_estimator(learning_loss="hinge").fit(X, y)
    with pytest.raises(ValueError, match="not fitted"):
        linear_estimator().get_state()
    with pytest.raises(ValueError, match="give both X_val and y_val"):
        linear_estimator().fit(X, y, X_val=X)


def test_non_finite_data_is_named_not_taken_for_divergence():
    X, y = linear_data()
    bad = X.copy()
    bad[7, 2] = np.inf
    with pytest.raises(ValueError, match=r"X holds inf at row 7 \(X\[7, 2\]\)"):
        linear_estimator().fit(bad, y)
    with pytest.raises(ValueError, match=r"X_val holds inf at row 7"):
        linear_estimator().fit(X, y, X_val=bad, y_val=y)
    y_nan = y.copy()
    y_nan[4] = np.nan
    with pytest.raises(ValueError, match=r"y_val holds nan at row 4 \(y_val\[4\]\)"):
        linear_estimator().fit(X, y, X_val=X, y_val=y_nan)


def fitted_attributes(estimator) -> set[str]:
    return {name for name in vars(estimator) if name.endswith("_")}


def test_a_failed_fit_leaves_the_estimator_as_it_was():
    X, y = linear_data()
    bad_X_val = X[:, :2]
    est = linear_estimator(learning_rate="SGD")
    with pytest.raises(ValueError, match="X_val has shape"):
        est.fit(X, y, X_val=bad_X_val, y_val=y)
    assert fitted_attributes(est) == set()
    with pytest.raises(NotFittedError):
        check_is_fitted(est)

    est.fit(X, y)
    before = {name: getattr(est, name) for name in fitted_attributes(est)}
    weights = est.get_state()
    est.set_params(learning_rate="Adam", warm_start=True)
    with pytest.raises(ValueError, match="X_val has shape"):
        est.fit(X, y, X_val=bad_X_val, y_val=y)
    assert {name: getattr(est, name) for name in fitted_attributes(est)} == before
    assert isinstance(est.learning_rate_, LearningRateSGD)
    assert set(est.get_full_state()) == {"coefs", "intercept"}
    np.testing.assert_array_equal(est.get_state()["coefs"], weights["coefs"])


def test_the_data_is_checked_before_the_derivative_is_built(monkeypatch):
    from onnxgrad.training.estimators import optimizers as estimators

    def no_derivative(*args, **kwargs):
        raise AssertionError("the train step is built before the data is checked")

    monkeypatch.setattr(estimators, "make_train_step", no_derivative)
    X, y = linear_data()
    with pytest.raises(TypeError, match="y has dtype complex128"):
        linear_estimator().fit(X, y.astype(np.complex128))
    with pytest.raises(ValueError, match="y_val has shape"):
        linear_estimator().fit(X, y, X_val=X, y_val=np.c_[y, y])
    with pytest.raises(TypeError, match="intra_op_num_threads must be an integer"):
        linear_estimator(intra_op_num_threads=True).fit(X, y)
    mixing = linear_regression_model(np.ones((1, 3)), np.zeros(1))
    mixing.graph.node[1].input[1] = "total"
    mixing.graph.node.insert(1, onnx.helper.make_node("ReduceSum", ["y1"], ["total"], keepdims=1))
    for info in (mixing.graph.input[0], mixing.graph.output[0]):
        info.type.tensor_type.shape.dim[0].dim_value = 1
    with pytest.raises(ValueError, match=r"fixed batch dimension 1 .* the model mixes rows"):
        OrtGradientForwardBackwardOptimizer(mixing, batch_size=8).fit(X, y)


def test_ort_gradient_optimizer_needs_the_loss_output():
    X, y = linear_data()
    model = linear_regression_model(np.zeros((1, 3)), np.zeros(1))
    with pytest.raises(ValueError, match="loss output 'loss' not found"):
        OrtGradientOptimizer(model, ["coefs"]).fit(X, y)
    with_loss = add_loss_output(model)
    with pytest.raises(ValueError, match="has no input 'weight'"):
        OrtGradientOptimizer(with_loss, ["coefs"]).fit(X, y, sample_weight=np.ones(len(X)))


def test_results_own_their_memory():
    """OrtValue.numpy() is a view that does not keep the tensor alive: results are copies."""
    X, y = linear_data()
    est = linear_estimator(max_iter=2).fit(X, y)
    first = est.predict(X[:5])
    expected = first.copy()
    for _ in range(3):
        est.predict(X[::-1] * 3)
        _ = [np.random.rand(1000) for _ in range(100)]
    np.testing.assert_array_equal(first, expected)


def test_cuda_without_the_provider_fails_before_training():
    from onnxgrad.training.running.devices import _cuda_provider_loads

    if _cuda_provider_loads(0):
        pytest.skip("CUDA works on this machine")
    X, y = linear_data()
    est = linear_estimator(device="cuda:0")
    with pytest.raises(ValueError, match="CUDAExecutionProvider"):
        est.fit(X, y)
    assert not hasattr(est, "runner_")


@pytest.mark.parametrize(
    ("y", "match"),
    [
        (np.array([0, 1, 3, 2] * 10), r"y holds the class label 3 .*valid range 0..2"),
        (np.array([0, 1, -1, 2] * 10), r"class label -1 .*valid range 0..2"),
        (np.array([0.0, 1.5, 1.0, 2.0] * 10), r"non-integer class label 1.5.*0..2"),
    ],
)
def test_class_labels_out_of_range_or_not_integers_are_refused(y, match):
    from onnxgrad.training import CrossEntropyLearningLoss

    rng = np.random.default_rng(0)
    X = rng.standard_normal((len(y), 3)).astype(np.float32)
    model = linear_regression_model(np.zeros((3, 3)), np.zeros(3))
    est = OrtGradientForwardBackwardOptimizer(
        model, learning_loss=CrossEntropyLearningLoss(probability_function="softmax"), max_iter=1
    )
    with pytest.raises(ValueError, match=match):
        est.fit(X, y)


def test_verbose_lines_even_with_a_notebook_kernel_module_imported(capsys):
    # another test (or library) importing ipykernel does not make this process a notebook
    pytest.importorskip("ipykernel")
    import ipykernel  # noqa: F401

    X, y = linear_data()
    linear_estimator(max_iter=2, verbose=1).fit(X, y)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[:2] for line in lines] == [["epoch", f"{k}/2"] for k in (1, 2)]
