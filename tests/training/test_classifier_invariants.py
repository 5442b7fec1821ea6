"""Fine-tuned converted classifiers stay classifiers.

Every scikit-learn classifier below (binary and three classes), converted by skl2onnx, is
fine-tuned with a log loss through each entry point: the estimator
(:class:`OrtGradientClassifier`), the command ``onnxgrad train`` and the on-device
artifacts run by plain onnxruntime. After training, its probability rows still sum to 1
(1e-5) and its held-out accuracy is within 0.03 of scikit-learn's own.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnxgrad.exceptions import BrokenDistributionError
from onnxgrad.training import OrtGradientClassifier, generate_artifacts, merge_checkpoint
from onnxgrad.training.artifacts.checkpoint import Checkpoint
from onnxgrad.training.step.learning_rate import LearningRateSGD
from onnxgrad.training.step.losses import select_learning_loss
from tests.cli.helpers import run_in_process, run_onnxgrad

skl2onnx = pytest.importorskip("skl2onnx")
from sklearn.datasets import make_classification  # noqa: E402
from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.linear_model import LogisticRegression, SGDClassifier  # noqa: E402
from sklearn.neural_network import MLPClassifier  # noqa: E402
from sklearn.pipeline import Pipeline, make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402
from sklearn.svm import SVC  # noqa: E402

ESTIMATORS = {
    "logistic": lambda: LogisticRegression(),
    "sgd_log": lambda: SGDClassifier(loss="log_loss", alpha=1e-3, random_state=0),
    "mlp": lambda: MLPClassifier((8,), max_iter=300, random_state=0),
    "svc": lambda: SVC(kernel="linear", probability=True, random_state=0),
    "pipeline": lambda: make_pipeline(StandardScaler(), LogisticRegression()),
}
LR, EPOCHS, BATCH = 1e-3, 3, 32
TOLERANCE, ACCURACY_SLACK = 1e-5, 0.03


@functools.cache
def converted(name: str, n_classes: int):
    """``(onnx model, X_train, y_train, X_test, y_test, scikit-learn's test accuracy)``."""
    X, y = make_classification(
        400, 4, n_informative=3, n_redundant=0, n_classes=n_classes, random_state=n_classes
    )
    X = X.astype(np.float32)
    X_train, y_train, X_test, y_test = X[:300], y[:300], X[300:], y[300:]
    estimator = ESTIMATORS[name]()
    final = estimator.steps[-1][1] if isinstance(estimator, Pipeline) else estimator
    options = {id(final): {"zipmap": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", FutureWarning)  # SVC's probA_, read by skl2onnx
        estimator.fit(X_train, y_train)
        model = skl2onnx.to_onnx(estimator, X[:1], target_opset=17, options=options)
    accuracy = float((estimator.predict(X_test) == y_test).mean())
    return model, X_train, y_train.astype(np.int64), X_test, y_test, accuracy


def _probabilities(model: onnx.ModelProto, X: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return session.run(None, {session.get_inputs()[0].name: X})[names.index("probabilities")]


def _loss(n_classes: int) -> str:
    return "log" if n_classes == 2 else "cross_entropy"


def _assert_still_a_classifier(proba, before, y_test, accuracy):
    np.testing.assert_allclose(proba.sum(axis=1), 1, atol=TOLERANCE)
    assert proba.min() >= -TOLERANCE and proba.max() <= 1 + TOLERANCE
    assert np.abs(proba - before).max() > 1e-6, "training did not change the model"
    assert float((proba.argmax(axis=1) == y_test).mean()) >= accuracy - ACCURACY_SLACK


CASES = [(name, n) for name in ESTIMATORS for n in (2, 3)]


@pytest.mark.parametrize(("name", "n_classes"), CASES)
def test_estimator_keeps_probabilities(name, n_classes):
    model, X, y, X_test, y_test, accuracy = converted(name, n_classes)
    clf = OrtGradientClassifier(
        model,
        max_iter=EPOCHS,
        batch_size=BATCH,
        learning_rate=LearningRateSGD(eta0=LR),
        learning_loss=select_learning_loss(_loss(n_classes), "mean"),
        random_state=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the rows sum to 1 before training
        clf.fit(X, y)
    proba = _probabilities(clf.get_trained_onnx(), X_test)
    _assert_still_a_classifier(proba, _probabilities(model, X_test), y_test, accuracy)
    np.testing.assert_allclose(clf.predict_proba(X_test), proba, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "n_classes"), CASES)
def test_artifacts_run_by_onnxruntime_keep_probabilities(name, n_classes, tmp_path):
    model, X, y, X_test, y_test, accuracy = converted(name, n_classes)
    artifacts = generate_artifacts(
        model,
        loss=select_learning_loss(_loss(n_classes), "mean"),
        optimizer="sgd",
        learning_rate=LR,
        artifact_directory=tmp_path,
    )
    step = artifacts.train_step
    session = ort.InferenceSession(
        str(artifacts.path("training_model.onnx")), providers=["CPUExecutionProvider"]
    )
    values = {**artifacts.checkpoint.weights, **artifacts.checkpoint.optimizer_state}
    outputs = [*step.new_weights, *step.new_state]
    rng = np.random.default_rng(0)
    for _ in range(EPOCHS):
        order = rng.permutation(len(X))
        for start in range(0, len(X), BATCH):
            rows = order[start : start + BATCH]
            feeds = {step.features[0]: X[rows], step.label: y[rows], **values}
            feeds[step.learning_rate] = np.array(LR, np.float32)
            new = session.run(outputs, feeds)
            values = dict(zip([*step.weights, *step.state], new))
    trained = Checkpoint({w: values[w] for w in step.weights}, {})
    merged = merge_checkpoint(artifacts.directory, trained)
    proba = _probabilities(merged, X_test)
    _assert_still_a_classifier(proba, _probabilities(model, X_test), y_test, accuracy)


@pytest.mark.parametrize(
    ("name", "runner"),
    [pytest.param(name, run_in_process, id=name) for name in ESTIMATORS]
    + [pytest.param("logistic", run_onnxgrad, marks=pytest.mark.slow, id="logistic-process")],
)
def test_command_line_train_keeps_probabilities(name, runner, tmp_path):
    """``onnxgrad train --loss log`` on the binary models (in this process, and once as a
    separate process, as a user runs it)."""
    model, X, y, X_test, y_test, accuracy = converted(name, 2)
    onnx.save(model, tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", X=X, y=y)
    result = runner(
        "train", "model.onnx", "--data", "data.npz", "-o", "trained.onnx",
        "--loss", "log", "--reduction", "mean", "--optimizer", "sgd", "--lr", str(LR),
        "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    proba = _probabilities(onnx.load(tmp_path / "trained.onnx"), X_test)
    _assert_still_a_classifier(proba, _probabilities(model, X_test), y_test, accuracy)


def test_training_a_post_processing_constant_by_name_raises():
    """Naming skl2onnx's ``unity`` (the 1 of ``1 - p``) trains it: the rows stop summing to
    1 and the estimator says so instead of returning the broken model."""
    model, X, y, *_ = converted("sgd_log", 2)
    clf = OrtGradientClassifier(
        model,
        weights_to_train=["coef", "intercept", "unity"],
        max_iter=2,
        batch_size=BATCH,
        learning_rate=LearningRateSGD(eta0=0.5),
        learning_loss=select_learning_loss("log", "mean"),
        random_state=0,
    )
    with pytest.raises(BrokenDistributionError, match=r"'probabilities'.*'unity'"):
        clf.fit(X, y)
