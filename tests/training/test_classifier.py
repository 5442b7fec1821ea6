"""OrtGradientClassifier against scikit-learn: labels, probabilities, pickling, model selection."""

from __future__ import annotations

import copy
import pickle

import joblib
import numpy as np
import pytest
from skl2onnx import to_onnx
from sklearn.datasets import make_classification
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, log_loss
from sklearn.model_selection import GridSearchCV

from onnxgrad.training import (
    LearningRateSGDNesterov,
    OrtGradientClassifier,
    OrtGradientForwardBackwardOptimizer,
)
from tests.models import linear_regression_model

NAMES = np.array(["setosa", "versicolor", "virginica"])


@pytest.fixture(scope="module")
def data():
    X, y = make_classification(
        240, n_features=5, n_informative=4, n_redundant=0, n_classes=3, random_state=0
    )
    return X, NAMES[y]


def logits_model(n_features=5, n_classes=3):
    """``z = X W + b`` (logits), zero weights."""
    return linear_regression_model(np.zeros((n_classes, n_features)), np.zeros(n_classes))


def classifier(**params):
    defaults = {
        "learning_loss": "cross_entropy_logits",
        "learning_rate": LearningRateSGDNesterov(eta0=0.05, learning_rate="constant"),
        "max_iter": 15,
        "batch_size": 16,
        "random_state": 0,
    }
    return OrtGradientClassifier(logits_model(), **{**defaults, **params})


def test_string_labels_probabilities_and_accuracy(data):
    X, y = data
    est = classifier().fit(X, y)
    np.testing.assert_array_equal(est.classes_, NAMES)
    proba = est.predict_proba(X)
    np.testing.assert_allclose(proba.sum(axis=1), 1, rtol=1e-12)
    predicted = est.predict(X)
    assert predicted.dtype == y.dtype and set(predicted) <= set(NAMES)
    assert est.score(X, y) == pytest.approx(accuracy_score(y, predicted))
    assert est.score(X, y) > 0.7
    # the training objective is scikit-learn's log loss of predict_proba
    codes = np.searchsorted(NAMES, y)
    expected = log_loss(codes, proba, labels=[0, 1, 2])
    assert est.losses(X, y).mean() == pytest.approx(expected, rel=1e-4)


def test_probabilities_loss_on_a_converted_logistic_regression(data):
    X, y = data
    reference = LogisticRegression(max_iter=200).fit(X, y)
    onx = to_onnx(reference, X[:1].astype(np.float32), target_opset=15, options={"zipmap": False})
    est = OrtGradientClassifier(onx, output="probabilities", max_iter=1, learning_rate=1e-9)
    est.fit(X, y)
    np.testing.assert_array_equal(est.classes_, reference.classes_)
    proba = est.predict_proba(X)
    np.testing.assert_allclose(proba, reference.predict_proba(X), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(est.predict(X), reference.predict(X))


def test_an_output_of_logits_with_a_probabilities_loss_warns(data):
    X, y = data
    with pytest.warns(UserWarning, match="use learning_loss='cross_entropy_logits'"):
        classifier(learning_loss="cross_entropy", max_iter=1, learning_rate=1e-9).fit(X + 5, y)


@pytest.mark.parametrize("how", ["pickle", "joblib", "deepcopy"])
def test_a_fitted_classifier_round_trips_and_predicts_the_same(data, tmp_path, how):
    X, y = data
    est = classifier(max_iter=3).fit(X, y)
    if how == "pickle":
        clone = pickle.loads(pickle.dumps(est))
    elif how == "joblib":
        joblib.dump(est, tmp_path / "est.joblib")
        clone = joblib.load(tmp_path / "est.joblib")
    else:
        clone = copy.deepcopy(est)
    np.testing.assert_array_equal(clone.predict_proba(X), est.predict_proba(X))
    np.testing.assert_array_equal(clone.predict(X), est.predict(X))
    assert clone.train_losses_ == est.train_losses_
    # the optimizer state survives: both continue identically
    est.partial_fit(X, y)
    clone.partial_fit(X, y)
    np.testing.assert_array_equal(clone.get_state()["coefs"], est.get_state()["coefs"])


def test_grid_search_over_string_labels(data):
    X, y = data
    grid = {"max_iter": [1, 10]}
    search = GridSearchCV(classifier(), grid, cv=3).fit(X, y)
    assert search.best_params_ == {"max_iter": 10}
    assert set(search.predict(X)) <= set(NAMES)
    assert search.best_estimator_.predict_proba(X).shape == (len(X), 3)


def test_partial_fit_needs_classes_then_continues(data):
    X, y = data
    est = classifier()
    with pytest.raises(ValueError, match="classes must be given"):
        est.partial_fit(X, y)
    est.partial_fit(X[:100], y[:100], classes=NAMES)
    est.partial_fit(X[100:], y[100:])
    assert est.n_iter_ == 2 and len(est.train_losses_) == 2
    with pytest.raises(ValueError, match="y holds the label 'rose', not among the classes"):
        est.partial_fit(X[:3], np.array(["rose", "setosa", "setosa"]))


def test_not_fitted_error(data):
    X, _ = data
    for est in (classifier(), OrtGradientForwardBackwardOptimizer(logits_model())):
        with pytest.raises(NotFittedError, match="not fitted yet"):
            est.predict(X)
    with pytest.raises(NotFittedError):
        classifier().predict_proba(X)


def test_more_classes_than_columns_are_refused(data):
    X, y = data
    est = OrtGradientClassifier(logits_model(n_classes=2), learning_loss="cross_entropy_logits")
    with pytest.raises(ValueError, match=r"y has 3 classes .* 2 columns"):
        est.fit(X, y)


def test_more_columns_than_classes_are_refused(data):
    """predict_proba would have 4 columns for 3 classes_: fit refuses, naming both."""
    X, y = data
    output = logits_model(n_classes=4).graph.output[0].name
    est = OrtGradientClassifier(logits_model(n_classes=4), learning_loss="cross_entropy_logits")
    classes = r"\['setosa', 'versicolor', 'virginica'\]"
    match = rf"y has 3 classes {classes}, the model output '{output}' has 4 columns"
    with pytest.raises(ValueError, match=match):
        est.fit(X, y)
    with pytest.raises(ValueError, match=match):
        est.partial_fit(X, y, classes=NAMES)


def test_probabilities_of_a_float32_model_sum_to_one_in_float64(data):
    """The converted model's float32 softmax rows are off 1 by ~1e-8, which makes
    scikit-learn's log_loss warn; predict_proba renormalises them in float64."""
    import warnings

    X, y = data
    reference = LogisticRegression(max_iter=200).fit(X, y)
    onx = to_onnx(reference, X[:1].astype(np.float32), target_opset=15, options={"zipmap": False})
    est = OrtGradientClassifier(onx, output="probabilities", max_iter=1, learning_rate=1e-9)
    proba = est.fit(X, y).predict_proba(X)
    assert proba.dtype == np.float64
    assert np.abs(proba.sum(axis=1) - 1).max() <= 1e-15
    np.testing.assert_allclose(proba, reference.predict_proba(X), rtol=1e-4, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = log_loss(y, reference.predict_proba(X))
        assert log_loss(y, proba) == pytest.approx(expected, rel=1e-4)
